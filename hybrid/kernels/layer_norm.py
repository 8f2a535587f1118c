"""LayerNorm and RMSNorm: the fused CUDA kernels as custom ops with autograd formulas, torch elsewhere.

Both functions are plain differentiable functions of their inputs. Under sequence
parallelism the norm *module* of model_zoo reduces the weight gradient over the tensor
parallel group; nothing here communicates.

Shapes: ``x`` is ``[..., hidden]``; ``weight``/``bias`` are ``[hidden]``. The fused path is
taken for CUDA tensors of fp32/fp16/bf16 whose weight is x's dtype or fp32, when the
backward's per-block column accumulators fit in shared memory (hidden up to ~27k with a
bias on an H100/H200); other cases use torch without a warning, since they are a
documented limit rather than a missing op.

The kernels are the ``torch.library`` ops ``hybrid::layer_norm_forward``/``_backward`` and
``hybrid::rms_norm_forward``/``_backward`` (fake implementations and autograd formulas
registered), so compiled graphs hold them; see docs/kernels.md, "Custom ops".
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybrid.compile_marks import constant_result
from hybrid.kernels.library import custom_op
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


@constant_result
def _fused_max_hidden(device_index: int, rms: bool, has_bias: bool) -> int:
    """Largest ``hidden`` the cuda_norm op takes on this device, 0 without the op.

    A constant to ``torch.compile`` (decided once, while tracing), so the registry lookup and
    the pybind call stay out of the compiled graph."""
    op = default_registry().get("cuda_norm")
    return 0 if op is None else int(op.max_hidden(rms, has_bias, device_index))


def _fits_kernel(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], rms: bool) -> bool:
    """Whether the cuda_norm kernel runs this case (decided without touching the registry
    inside a compiled region)."""
    if not _fused_supported(x, weight, bias):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return x.shape[-1] <= _fused_max_hidden(index, rms, bias is not None)


# ------------------------------------------------------------- custom ops --
# hybrid::layer_norm_forward / rms_norm_forward and their backward ops. The CUDA tensors of
# the fused cases run the cuda_norm kernels; anything else (CPU tensors, float64, a missing
# op) runs _forward_torch / _backward_torch, the same contract and formulas written in torch
# (fp32 statistics, float64 for float64 inputs). layer_norm()/rms_norm() call the ops only
# where the kernel runs; the torch formulas are what opcheck and gradcheck exercise on CPU.

def _launch_context(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0


def _out_dtype(x: Tensor, weight: Tensor, rms: bool) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if rms else x.dtype


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _kernel_for(x: Tensor, weight: Tensor, bias: Optional[Tensor], rms: bool):
    """The cuda_norm module when it runs this case, else None (the torch formulas)."""
    return default_registry().get("cuda_norm") if _fits_kernel(x, weight, bias, rms) else None


def _forward_torch(x2: Tensor, w: Tensor, b: Optional[Tensor], y: Tensor, mean: Optional[Tensor], rstd: Tensor,
                   eps: float, rms: bool) -> None:
    """The kernel's forward in torch: x2 [rows, hidden] -> y, mean [rows] (LayerNorm), rstd [rows]."""
    acc = _acc_dtype(x2)
    xf = x2.to(acc)
    mu = torch.zeros(x2.shape[0], dtype=acc, device=x2.device) if rms else xf.mean(-1)
    r = torch.rsqrt((xf - mu[:, None]).pow(2).mean(-1) + eps)
    xhat = (xf - mu[:, None]) * r[:, None]
    if rms:  # the normalized value is cast to x's dtype before the weight, as in rms_norm_reference
        y.copy_(w.to(acc) * xhat.to(x2.dtype).to(acc))
    else:
        y.copy_(xhat * w.to(acc) + (0 if b is None else b.to(acc)))
    if mean is not None:
        mean.copy_(mu)
    rstd.copy_(r)


def _backward_torch(dy: Tensor, x2: Tensor, w: Tensor, mean: Optional[Tensor], rstd: Tensor, dx: Tensor, dw: Tensor,
                    db: Optional[Tensor], rms: bool) -> None:
    """The kernel's backward in torch: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``,
    ``g = dy * w`` (RMSNorm drops ``mean(g)``); ``dw``/``db`` are column sums over rows."""
    acc = _acc_dtype(x2)
    d, xf, wf = dy.to(acc), x2.to(acc), w.to(acc)
    mu = torch.zeros_like(rstd, dtype=acc) if rms else mean.to(acc)
    r = rstd.to(acc)[:, None]
    xhat = (xf - mu[:, None]) * r
    g = d * wf
    mean_gx = (g * xhat).mean(-1, keepdim=True)
    mean_g = 0 if rms else g.mean(-1, keepdim=True)
    dx.copy_(r * (g - mean_g - xhat * mean_gx))
    factor = xhat.to(x2.dtype).to(acc) if rms else xhat
    dw.copy_((d * factor).sum(0))
    if db is not None:
        db.copy_(d.sum(0))


def _norm_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, rms: bool):
    """(y shaped like x, mean [rows] or None, rstd [rows]) for x [..., hidden]."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    w = weight.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(x2.shape, dtype=_out_dtype(x, weight, rms), device=x.device)
    mean = None if rms else torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    op = _kernel_for(x2, w, b, rms)
    if op is None:
        _forward_torch(x2, w, b, y, mean, rstd, eps, rms)
    else:
        with _launch_context(x.device):
            op.norm_forward(x2, w, b, y, mean, rstd, float(eps), rms, _stream(x.device))
    return y.view(x.shape), mean, rstd


def _norm_backward(dy: Tensor, x: Tensor, weight: Tensor, mean: Optional[Tensor], rstd: Tensor, has_bias: bool,
                   rms: bool):
    """(dx shaped like x, dweight, dbias or None) from dy (shaped like x, the forward's output dtype)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    w = weight.contiguous()
    dy2 = dy.reshape(x2.shape).to(_out_dtype(x, weight, rms)).contiguous()
    dx = torch.empty_like(x2)
    dw = torch.empty_like(w)
    db = torch.empty_like(w) if has_bias else None
    op = _kernel_for(x2, w, db, rms)
    if op is None:
        _backward_torch(dy2, x2, w, mean, rstd, dx, dw, db, rms)
    else:
        with _launch_context(x.device):
            op.norm_backward(dy2, x2, w, mean, rstd, dx, dw, db, rms, _stream(x.device))
    return dx.view(x.shape), dw, db


def _stats_fake(x: Tensor) -> Tensor:
    return x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)  # Size.numel() would specialize


@custom_op("layer_norm_forward")
def _layer_norm_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """``hybrid::layer_norm_forward``: x [..., hidden], weight/bias [hidden] -> (y like x, in x's
    dtype, contiguous; mean [rows] fp32; rstd [rows] fp32), rows = x.numel() / hidden."""
    return _norm_forward(x, weight, bias, eps, rms=False)


@_layer_norm_forward.register_fake
def _layer_norm_forward_fake(x, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _stats_fake(x), _stats_fake(x)


@custom_op("layer_norm_backward")
def _layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, has_bias: bool
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``hybrid::layer_norm_backward``: (dx like x, dweight like weight, dbias like weight, or
    an empty [0] tensor of weight's dtype when ``has_bias`` is False)."""
    dx, dw, db = _norm_backward(dy, x, weight, mean, rstd, has_bias, rms=False)
    return dx, dw, weight.new_empty(0) if db is None else db


@_layer_norm_backward.register_fake
def _layer_norm_backward_fake(dy, x, weight, mean, rstd, has_bias):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(weight) if has_bias else weight.new_empty(0))


@custom_op("rms_norm_forward")
def _rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``hybrid::rms_norm_forward``: x [..., hidden], weight [hidden] -> (y like x, dtype
    promote_types(x, weight), contiguous; rstd [rows] fp32)."""
    y, _, rstd = _norm_forward(x, weight, None, eps, rms=True)
    return y, rstd


@_rms_norm_forward.register_fake
def _rms_norm_forward_fake(x, weight, eps):
    y = torch.empty_like(x, dtype=_out_dtype(x, weight, True), memory_format=torch.contiguous_format)
    return y, _stats_fake(x)


@custom_op("rms_norm_backward")
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``hybrid::rms_norm_backward``: (dx like x, dweight like weight)."""
    dx, dw, _ = _norm_backward(dy, x, weight, None, rstd, False, rms=True)
    return dx, dw


@_rms_norm_backward.register_fake
def _rms_norm_backward_fake(dy, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward(dy, x, weight, mean, rstd, ctx.has_bias)
    return dx, dw, db if ctx.has_bias else None, None


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


_layer_norm_forward.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)
_rms_norm_forward.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# ------------------------------------------------------------- public API --

def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5, *,
               use_kernel: bool = True) -> Tensor:
    """LayerNorm over the last dim of ``x`` ([..., hidden]) with fp32 statistics; output has x's dtype.

    ``hybrid::layer_norm_forward`` where the CUDA kernel runs, ``F.layer_norm`` elsewhere."""
    if not (use_kernel and _fits_kernel(x, weight, bias, False)):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _layer_norm_forward(x, weight, bias, float(eps))[0]


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, use_kernel: bool = True) -> Tensor:
    """RMSNorm over the last dim: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.

    Output dtype is ``promote_types(x.dtype, weight.dtype)``, as in that expression.
    ``hybrid::rms_norm_forward`` where the CUDA kernel runs, :func:`rms_norm_reference` elsewhere.
    """
    if not (use_kernel and _fits_kernel(x, weight, None, True)):
        return rms_norm_reference(x, weight, eps)
    return _rms_norm_forward(x, weight, float(eps))[0]
