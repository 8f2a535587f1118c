"""Pure-torch Adam/AdamW step, op for op the same as ``torch.optim.AdamW``'s single-tensor path.

Used whenever the compiled op is missing or switched off, so the optimizer's results do
not depend on whether the kernels were built (bit-identical to ``torch.optim.AdamW`` with
``foreach=False``, the CPU default, on fp32 gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def torch_adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, step: int, adamw: bool, grad_scale: float,
                    lowp_out: Tensor | None) -> None:
    """In-place update of ``param``, ``exp_avg``, ``exp_avg_sq`` (all fp32, same numel).

    ``grad`` (fp32/bf16/fp16) is read, never modified; it is multiplied by ``grad_scale``.
    AdamW decays the weight by ``1 - lr * weight_decay``; Adam adds ``weight_decay * param``
    to the gradient. ``lowp_out`` (bf16/fp16), if given, receives ``param.to(dtype)``.
    """
    g = grad.view_as(param)
    if g.dtype != torch.float32:
        g = g.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g.view_as(exp_avg), 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g.view_as(exp_avg_sq), g.view_as(exp_avg_sq), value=1 - beta2)
    step_f = float(step)
    bias_correction1 = 1 - beta1 ** step_f
    bias_correction2 = 1 - beta2 ** step_f
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg.view_as(param), denom.view_as(param), value=-step_size)
    if lowp_out is not None:
        lowp_out.view_as(param).copy_(param)
