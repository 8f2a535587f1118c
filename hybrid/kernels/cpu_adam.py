"""Adam/AdamW on flat fp32 partitions: the compiled CPU and CUDA ops, with a torch fallback.

``adam_step`` updates one partition in place (CPU op on CPU tensors, the multi-tensor
CUDA kernel on CUDA tensors); ``multi_tensor_adam`` updates lists, one CUDA launch per
(device, grad dtype, copy-out dtype) group. Without the compiled op, or with
``use_kernel=False`` / ``HYBRID_KERNELS=off``, both run :func:`torch_adam_step`, which
matches ``torch.optim.AdamW`` op for op.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import torch
from torch import Tensor

from hybrid.kernels.adam_reference import torch_adam_step
from hybrid.kernels.modes import forced_cpu_isa
from hybrid.kernels.registry import default_registry

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)
# Mirrors hybrid::cuda::DType in csrc/cuda/launchers.h.
_CUDA_DTYPE_CODES = {None: -1, torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _check_adam_args(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, lowp_out: Optional[Tensor],
                     step: int, where: str) -> None:
    for name, t, dtypes in (("param", param, (torch.float32,)), ("grad", grad, _GRAD_DTYPES),
                            ("exp_avg", exp_avg, (torch.float32,)), ("exp_avg_sq", exp_avg_sq, (torch.float32,))):
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{where}: {name} must be {allowed}, got {t.dtype}")
        if t.numel() != param.numel():
            raise ValueError(f"{where}: {name} has {t.numel()} elements but param has {param.numel()}")
        if t.device != param.device:
            raise ValueError(f"{where}: {name} is on {t.device} but param is on {param.device}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous (flat partitions are)")
    if lowp_out is not None:
        if lowp_out.dtype not in _LOWP_DTYPES:
            raise TypeError(f"{where}: lowp_out must be bfloat16 or float16, got {lowp_out.dtype}")
        if lowp_out.numel() != param.numel() or lowp_out.device != param.device or not lowp_out.is_contiguous():
            raise ValueError(f"{where}: lowp_out must be contiguous, on {param.device}, with {param.numel()} elements")
    if int(step) < 1:
        raise ValueError(f"{where}: step must be >= 1 (1 on the first update), got {step}")


def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float, beta1: float,
              beta2: float, eps: float, weight_decay: float, step: int, adamw: bool = True, grad_scale: float = 1.0,
              lowp_out: Optional[Tensor] = None, use_kernel: bool = True) -> None:
    """One in-place Adam/AdamW step on a flat partition.

    Args:
        param, exp_avg, exp_avg_sq: fp32, contiguous, same numel (usually 1-D flat partitions).
        grad: fp32, bf16 or fp16, same numel; multiplied by ``grad_scale`` (unscale x clip) first.
        step: the 1-based step number, for bias correction.
        adamw: decoupled decay (``p *= 1 - lr*wd``) if True, else L2 (``g += wd*p``).
        lowp_out: optional bf16/fp16 tensor that receives ``param.to(dtype)`` (round to nearest even).
        use_kernel: False forces the torch implementation without a warning.
    """
    _check_adam_args(param, grad, exp_avg, exp_avg_sq, lowp_out, step, "adam_step")
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=int(step), adamw=adamw,
                 grad_scale=grad_scale)
    if param.device.type == "cuda":
        multi_tensor_adam([param], [grad], [exp_avg], [exp_avg_sq], None if lowp_out is None else [lowp_out],
                          use_kernel=use_kernel, **hyper)
        return
    op = default_registry().get("cpu_adam") if use_kernel and param.device.type == "cpu" else None
    _host_step(op, forced_cpu_isa() if op is not None else "", param, grad, exp_avg, exp_avg_sq, lowp_out, hyper)


def _host_step(op, isa: str, param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
               lowp_out: Optional[Tensor], hyper: dict) -> None:
    """One validated non-CUDA partition: the CPU op if given, else torch."""
    if op is not None:
        op.adam_step(param, grad, exp_avg, exp_avg_sq, lowp_out, float(hyper["lr"]), float(hyper["beta1"]),
                     float(hyper["beta2"]), float(hyper["eps"]), float(hyper["weight_decay"]), hyper["step"],
                     bool(hyper["adamw"]), float(hyper["grad_scale"]), isa)
    else:
        torch_adam_step(param, grad, exp_avg, exp_avg_sq, lowp_out=lowp_out, **hyper)


def multi_tensor_adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                      exp_avg_sqs: Sequence[Tensor], lowp_outs: Optional[Sequence[Optional[Tensor]]] = None, *,
                      lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                      adamw: bool = True, grad_scale: float = 1.0, use_kernel: bool = True) -> None:
    """:func:`adam_step` over lists; CUDA tensors go through one fused launch per dtype group.

    ``lowp_outs`` is None or a list with one entry (a bf16/fp16 tensor or None) per param.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"multi_tensor_adam: list lengths differ (params {n}, grads {len(grads)}, "
                         f"exp_avgs {len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)})")
    outs = list(lowp_outs) if lowp_outs is not None else [None] * n
    if len(outs) != n:
        raise ValueError(f"multi_tensor_adam: lowp_outs has {len(outs)} entries for {n} params")
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=int(step), adamw=adamw,
                 grad_scale=grad_scale)
    cuda_items, host_items = [], []
    for p, g, m, v, o in zip(params, grads, exp_avgs, exp_avg_sqs, outs):
        _check_adam_args(p, g, m, v, o, step, "multi_tensor_adam")
        (cuda_items if p.device.type == "cuda" else host_items).append((p, g, m, v, o))
    if host_items:
        op = default_registry().get("cpu_adam") if use_kernel else None
        isa = forced_cpu_isa() if op is not None else ""
        for p, g, m, v, o in host_items:
            _host_step(op if p.device.type == "cpu" else None, isa, p, g, m, v, o, hyper)
    if not cuda_items:
        return
    op = default_registry().get("cuda_adam") if use_kernel else None
    if op is None:
        for p, g, m, v, o in cuda_items:
            torch_adam_step(p, g, m, v, lowp_out=o, **hyper)
        return
    groups: dict[tuple, list] = {}
    for item in cuda_items:
        out = item[4]
        groups.setdefault((item[0].device, item[1].dtype, None if out is None else out.dtype), []).append(item)
    for (device, grad_dtype, out_dtype), items in groups.items():
        _launch_cuda_group(op, device, grad_dtype, out_dtype, items, hyper)


def _launch_cuda_group(op, device: torch.device, grad_dtype: torch.dtype, out_dtype: Optional[torch.dtype],
                       items: list, hyper: dict) -> None:
    items = [it for it in items if it[0].numel() > 0]
    if not items:
        return
    key = tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(),
                 p.numel(), g.element_size(), 0 if o is None else o.element_size()) for p, g, m, v, o in items)
    table, total_chunks = _device_table(key, device, int(op.chunk_size()), int(op.table_columns))
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        op.multi_tensor_adam(table, len(items), total_chunks, _CUDA_DTYPE_CODES[grad_dtype],
                             _CUDA_DTYPE_CODES[out_dtype], float(hyper["lr"]), float(hyper["beta1"]),
                             float(hyper["beta2"]), float(hyper["eps"]), float(hyper["weight_decay"]), hyper["step"],
                             bool(hyper["adamw"]), float(hyper["grad_scale"]), int(stream))


@lru_cache(maxsize=64)
def _device_table(key: tuple, device: torch.device, chunk: int, columns: int) -> tuple[Tensor, int]:
    """Device copy of the launch table for one set of tensors (addresses and sizes only).

    The table is a pure function of its key, so a cached copy stays correct even if the
    same addresses are later reused by other tensors of the same sizes.
    """
    rows = []
    first_chunk = 0
    for p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, numel, g_size, o_size in key:
        vector_ok = (p_ptr % 16 == 0 and m_ptr % 16 == 0 and v_ptr % 16 == 0 and g_ptr % (4 * g_size) == 0
                     and (o_ptr == 0 or o_ptr % (4 * o_size) == 0))
        row = [p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, numel, first_chunk, 1 if vector_ok else 0]
        rows.append(row + [0] * (columns - len(row)))
        first_chunk += (numel + chunk - 1) // chunk
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    return table, first_chunk
