"""Multi-tensor CUDA Adam against torch.optim.AdamW (runs only where a GPU is present)."""

from __future__ import annotations

import pytest
import torch

import hybrid.kernels as hk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_multi_tensor_adam_matches_torch(kernel_env, grad_dtype, offset):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 7, 1023, 16385, 100_003]
    flat = torch.randn(sum(sizes) + offset, device="cuda", generator=gen)
    params, pos = [], offset
    for n in sizes:
        params.append(flat[pos:pos + n])
        pos += n
    refs = [p.clone() for p in params]
    opt = torch.optim.AdamW(refs, weight_decay=0.01, foreach=False, lr=HYPER["lr"])
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    outs = [torch.full(p.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for p in params]
    for step in range(1, 4):
        grads = [torch.randn(p.shape, device="cuda", generator=gen).to(grad_dtype) for p in params]
        for r, g in zip(refs, grads):
            r.grad = g.float()
        opt.step()
        hk.multi_tensor_adam(params, grads, ms, vs, outs, weight_decay=0.01, step=step, **HYPER)
        # Relative to |expected| + rms over all tensors: a one-element tensor has no scale of its own.
        for ours, key in ((params, None), (ms, "exp_avg"), (vs, "exp_avg_sq")):
            got = torch.cat(list(ours))
            want = torch.cat([r if key is None else opt.state[r][key] for r in refs])
            scale = want.abs() + want.pow(2).mean().sqrt()
            assert ((got - want).abs() / scale).max().item() <= 1e-6, key
        for p, o in zip(params, outs):
            assert torch.equal(o.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
