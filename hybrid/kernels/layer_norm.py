"""LayerNorm and RMSNorm: the fused CUDA kernels as autograd functions, torch elsewhere.

Both functions are plain differentiable functions of their inputs. Under sequence
parallelism the norm *module* of model_zoo reduces the weight gradient over the tensor
parallel group; nothing here communicates.

Shapes: ``x`` is ``[..., hidden]``; ``weight``/``bias`` are ``[hidden]``. The fused path is
taken for CUDA tensors of fp32/fp16/bf16 whose weight is x's dtype or fp32, when the
backward's per-block column accumulators fit in shared memory (hidden up to ~27k with a
bias on an H100/H200); other cases use torch without a warning, since they are a
documented limit rather than a missing op.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid.kernels.registry import default_registry

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_reference(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """RMSNorm computed in fp32 and cast back before the weight (LlamaRMSNorm semantics)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = normed.to(x.dtype)
    return out if weight is None else weight * out


def _fused_supported(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> bool:
    if not x.is_cuda or weight is None or x.dtype not in _FLOAT_TYPES or x.numel() == 0:
        return False
    if weight.dtype not in (x.dtype, torch.float32) or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return False
    if bias is not None and (bias.dtype != weight.dtype or bias.shape != weight.shape):
        return False
    return x.device == weight.device


def _max_hidden(op, device: torch.device, rms: bool, has_bias: bool) -> int:
    return int(op.max_hidden(rms, has_bias, device.index if device.index is not None else 0))


def _launch_context(device: torch.device):
    """Current-device guard for CUDA; CPU tensors (used with stand-in ops in tests) need none."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0


class _FusedNorm(torch.autograd.Function):
    """Autograd wrapper shared by LayerNorm (rms=False) and RMSNorm (rms=True)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, rms: bool, op) -> Tensor:
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()
        w = weight.contiguous()
        b = None if bias is None else bias.contiguous()
        out_dtype = torch.promote_types(x.dtype, weight.dtype) if rms else x.dtype
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rows = x2.shape[0]
        mean = None if rms else torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        with _launch_context(x.device):
            op.norm_forward(x2, w, b, y, mean, rstd, float(eps), rms, _stream(x.device))
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.rms, ctx.op, ctx.has_bias, ctx.x_shape = rms, op, b is not None, x.shape
        return y.view(*x.shape[:-1], hidden)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        x2, w, mean, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).to(torch.promote_types(x2.dtype, w.dtype) if ctx.rms else x2.dtype).contiguous()
        dx = torch.empty_like(x2)
        dw = torch.empty_like(w)
        db = torch.empty_like(w) if ctx.has_bias else None
        with _launch_context(x2.device):
            ctx.op.norm_backward(dy2, x2, w, mean, rstd, dx, dw, db, ctx.rms, _stream(x2.device))
        return dx.view(ctx.x_shape), dw, db, None, None, None


def _fused_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], rms: bool, use_kernel: bool):
    if not use_kernel or not _fused_supported(x, weight, bias):
        return None
    op = default_registry().get("cuda_norm")
    if op is None or x.shape[-1] > _max_hidden(op, x.device, rms, bias is not None):
        return None
    return op


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5, *,
               use_kernel: bool = True) -> Tensor:
    """LayerNorm over the last dim of ``x`` ([..., hidden]) with fp32 statistics; output has x's dtype."""
    op = _fused_op(x, weight, bias, False, use_kernel)
    if op is None:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _FusedNorm.apply(x, weight, bias, eps, False, op)


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, use_kernel: bool = True) -> Tensor:
    """RMSNorm over the last dim: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.

    Output dtype is ``promote_types(x.dtype, weight.dtype)``, as in that expression.
    """
    op = _fused_op(x, weight, None, True, use_kernel)
    if op is None:
        return rms_norm_reference(x, weight, eps)
    return _FusedNorm.apply(x, weight, None, eps, True, op)
