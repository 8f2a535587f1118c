"""The Python side of the CUDA ops, exercised on CPU.

The norm ops (``hybrid::layer_norm_forward`` / ``rms_norm_forward`` and their backward ops)
run on CPU tensors through the torch formulas that follow the kernels' contract (fp32
statistics, the backward formulas of csrc/cuda/layer_norm.cu), so the registered autograd
formula and those formulas are checked by gradcheck without a GPU. The Adam launch table
is checked row by row. The kernels themselves run in benchmarks/gpu/check_kernels.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from hybrid.kernels.cpu_adam import _device_table
from hybrid.kernels.layer_norm import rms_norm_reference

LN = importlib.import_module("hybrid.kernels.layer_norm")  # the module (the package exports a function of this name)


class StandInNormOp:
    """The cuda_norm module's interface (2-D contiguous inputs, preallocated outputs, a stream
    argument) over the norm ops' torch formulas. Tests put it where the kernel goes, so the ops'
    kernel-launch branch runs on CPU; benchmarks/gpu/check_kernels.py --dry-run-cpu uses it too."""

    def max_hidden(self, rms, has_bias, device):
        return 1 << 30

    def norm_forward(self, x, w, b, y, mean, rstd, eps, rms, stream):
        assert x.is_contiguous() and x.dim() == 2 and y.is_contiguous() and stream == 0
        LN._forward_torch(x, w, b, y, mean, rstd, eps, rms)

    def norm_backward(self, dy, x, w, mean, rstd, dx, dw, db, rms, stream):
        assert dy.is_contiguous() and x.is_contiguous() and dx.is_contiguous() and stream == 0
        LN._backward_torch(dy, x, w, mean, rstd, dx, dw, db, rms)


def fused_norm(x, w, b, eps, rms):
    """The differentiable custom op, as layer_norm()/rms_norm() call it where the kernel runs."""
    if rms:
        return torch.ops.hybrid.rms_norm_forward(x, w, eps)[0]
    return torch.ops.hybrid.layer_norm_forward(x, w, b, eps)[0]


@pytest.mark.parametrize("branch", ["formulas", "kernel-branch"])
@pytest.mark.parametrize("rms,with_bias", [(False, False), (False, True), (True, False)],
                         ids=["layernorm", "layernorm-bias", "rmsnorm"])
def test_fused_norm_op_passes_gradcheck(monkeypatch, rms, with_bias, branch):
    """``kernel-branch``: the ops hand the kernel's arguments to a stand-in with its interface."""
    if branch == "kernel-branch":
        monkeypatch.setattr(LN, "_kernel_for", lambda *args: StandInNormOp())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    inputs = (x, w) if b is None else (x, w, b)

    def fn(*args):
        return fused_norm(args[0], args[1], args[2] if len(args) > 2 else None, 1e-5, rms)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)
    exact_rms = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = exact_rms if rms else F.layer_norm(x, (7,), w, b, 1e-5)
    torch.testing.assert_close(fn(*inputs), ref, rtol=1e-12, atol=1e-12)


def test_fused_norm_op_dtypes_follow_the_torch_semantics():
    x = torch.randn(5, 16).bfloat16().requires_grad_()
    w32 = torch.randn(16, requires_grad=True)
    y = fused_norm(x, w32, None, 1e-6, True)
    ref = rms_norm_reference(x, w32, 1e-6)
    # The torch formulas run the reference's own ops in the same order (fp32 mean of squares,
    # rsqrt, multiply, cast to bf16, fp32 weight multiply), so the op must add no arithmetic:
    # equal to the bit on any CPU. (A tolerance would have to admit a flipped last bf16 bit,
    # 2^-8 relative, and with it a missing cast before the weight multiply.)
    assert y.dtype == ref.dtype == torch.float32 and torch.equal(y, ref)
    gx, gw = torch.autograd.grad(y.sum(), (x, w32))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    y_ln = fused_norm(x, w32, torch.zeros(16), 1e-5, False)
    assert y_ln.dtype == torch.bfloat16 and y_ln.shape == x.shape


def test_adam_table_rows_offsets_and_alignment_flags():
    flat = torch.zeros(40_000)
    grads = torch.zeros(40_000, dtype=torch.bfloat16)
    views = [(flat[0:16], grads[0:16]), (flat[17:20018], grads[17:20018]), (flat[20018:20019], grads[20018:20019])]
    key = tuple((p.data_ptr(), g.data_ptr(), p.data_ptr(), p.data_ptr(), 0, p.numel(), g.element_size(), 0)
                for p, g in views)
    table, chunks = _device_table(key, torch.device("cpu"), 16384, 8)
    assert table.shape == (3, 8) and table.dtype == torch.int64
    # chunks: 1 + ceil(20001 / 16384) = 2, + 1
    assert chunks == 4 and table[:, 6].tolist() == [0, 1, 3]
    assert table[:, 5].tolist() == [16, 20001, 1]
    assert table[0, 0].item() == views[0][0].data_ptr()
    # The first view is 16-byte aligned; the others start at odd float offsets.
    assert table[:, 7].tolist() == [1, 0, 0]
