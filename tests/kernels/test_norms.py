"""layer_norm / rms_norm: torch path on CPU, fused path (when a GPU is present) vs torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import hybrid.kernels as hk
from tests.numerics import U64, gamma, layer_norm_bound, max_ratio, rms_normed_bound, unit_roundoff

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _hf_rms_norm(x, weight, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        module.weight.copy_(weight)
    module.weight.data = module.weight.data.to(weight.dtype)
    return module(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpu_layer_norm_matches_torch_forward_and_backward(kernel_env, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 37, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(37, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(37, generator=gen).to(dtype).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU has no compiled norm: no warning expected
        y = hk.layer_norm(x, w, b, 1e-5)
    ref = F.layer_norm(x, (37,), w, b, 1e-5)
    assert y.dtype == dtype and torch.equal(y, ref)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    ref_grads = torch.autograd.grad(ref, (x, w, b), dy)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
    # And the math itself, in float64.
    x64 = x.detach().double()
    expect = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    expect = expect * w.detach().double() + b.detach().double()
    assert max_ratio(y, expect, layer_norm_bound(x, w, b, 1e-5, out_dtype=dtype)) <= 1
    # The same op in float64 pins the formula (eps inside the root, biased variance) some 1e8 times
    # more tightly than the fp32 rounding bound can: e.g. an eps off by 2x moves y by ~5e-6 relative.
    y64 = hk.layer_norm(x64, w.detach().double(), b.detach().double(), 1e-5)
    assert max_ratio(y64, expect, layer_norm_bound(x, w, b, 1e-5, out_dtype=torch.float64, u=2 * U64)) <= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("weight_dtype", ["same", "fp32"])
def test_cpu_rms_norm_matches_hf_llama_rms_norm(kernel_env, dtype, weight_dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype if weight_dtype == "same" else torch.float32)
    w.requires_grad_()
    y = hk.rms_norm(x, w, 1e-6)
    ref = _hf_rms_norm(x, w.detach(), 1e-6)
    assert y.dtype == ref.dtype == torch.promote_types(dtype, w.dtype)
    assert torch.equal(y, ref)
    dy = torch.randn(y.shape, generator=gen).to(y.dtype)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64 = x.detach().double()
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    # gw = sum over the 12 tokens of dy * n', where n' is the fp32 normalised x cast to x's dtype;
    # each product is rounded to gw's dtype, summed with fp32 accumulation, and the sum rounded to it.
    out_err = rms_normed_bound(x, 1e-6) + unit_roundoff(dtype) * n.abs()
    terms = (dy.double() * n).abs()
    u_gw = unit_roundoff(gw.dtype)
    want = (dy.double() * n).sum((0, 1))
    bound = ((dy.double().abs() * out_err).sum((0, 1)) + (u_gw + gamma(terms[..., 0].numel())) * terms.sum((0, 1))
             + u_gw * want.abs())
    assert max_ratio(gw, want, bound) <= 1
    assert gx.shape == x.shape and gx.dtype == dtype


def test_use_kernel_false_is_plain_torch(kernel_env):
    x = torch.randn(3, 8)
    w, b = torch.randn(8), torch.randn(8)
    assert torch.equal(hk.layer_norm(x, w, b, 1e-5, use_kernel=False), F.layer_norm(x, (8,), w, b, 1e-5))
    assert torch.equal(hk.rms_norm(x, w, 1e-6, use_kernel=False), hk.rms_norm_reference(x, w, 1e-6))


# ------------------------------------------------------------ CUDA parity --

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("hidden", [1, 37, 768, 4096])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_fused_norm_matches_torch_on_cuda(kernel_env, dtype, hidden, rms):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, hidden, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype).requires_grad_()
    b = None if rms else (0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype).requires_grad_()
    y = hk.rms_norm(x, w, 1e-6) if rms else hk.layer_norm(x, w, b, 1e-5)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    br = None if rms else b.detach().double().requires_grad_()
    ref = hk.rms_norm_reference(xr, wr, 1e-6) if rms else F.layer_norm(xr, (hidden,), wr, br, 1e-5)
    dy = torch.randn(y.shape, device="cuda", generator=gen).to(y.dtype)
    got = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    want = torch.autograd.grad(ref, [t for t in (xr, wr, br) if t is not None], dy.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, r in zip((y,) + got, (ref,) + want):
        err = (g.double() - r).norm() / r.norm().clamp_min(1e-12)
        assert err < tol, f"relative error {err:.2e}"
