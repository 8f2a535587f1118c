"""The inner optimizer: one update of flat master partitions, in place.

A flat group's partition arrives as a short list of 1-D tensors (one chunk per
segment, see :mod:`hybrid.zero.flat_buffer`), so every update is a handful of
multi-tensor calls -- never a Python loop over parameters. Optimizer state
(Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's momentum) is one contiguous tensor
per group, viewed as the same chunks, created on ``state_device`` (the
parameters' device today; the CPU when the optimizer is offloaded).

Gradients are multiplied by ``grad_factor`` on the fly: the optimizer folds
loss unscaling, the 1/dp of the DP average and gradient clipping into that
one number. When the parameters are bf16/fp16, the step also leaves the
rounded new weights in the parameter chunks (``lowp``).

Adam/AdamW run on the compiled kernel of :mod:`hybrid.kernels` when it is
available (it reads bf16/fp16 gradients directly and fuses the low-precision
copy-out), else on torch's own (:func:`torch_adam_step`): the private fused op
``torch._fused_adamw_`` / ``torch._fused_adam_`` while torch has it, or the
public functional ``torch.optim.adamw.adamw`` / ``torch.optim.adam.adam``.

``bias_correction=False`` (DeepSpeed's ``optimizer.params.bias_correction:
false``) steps by ``lr * m / (sqrt(v) + eps)`` with the moments as they stand.
Neither the compiled kernels nor torch's ops have that switch, so it runs on
:func:`uncorrected_adam_step` (a few ``torch._foreach`` passes) instead.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw

KINDS = ("adamw", "adam", "sgd", "lamb")


def compiled_adam_available(device: torch.device) -> bool:
    """Whether :mod:`hybrid.kernels` can run its compiled Adam on ``device`` (built on first use)."""
    try:
        from hybrid.kernels import default_registry
    except ImportError:
        return False
    return default_registry().get("cuda_adam" if device.type == "cuda" else "cpu_adam") is not None


def _inner_adam_step(params: List[torch.Tensor], grads: List[torch.Tensor],
                     exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
                     lowp: Optional[List[torch.Tensor]], *, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: int, adamw: bool, grad_factor: float, compiled: bool,
                     bias_correction: bool = True) -> None:
    """One Adam/AdamW update of flat master tensors in place. ``grads`` may be overwritten.

    ``step`` is the 1-based update count (bias correction). AdamW decays the
    weights (decoupled); Adam adds ``weight_decay * param`` to the gradient.
    ``lowp`` (optional) receives the updated weights rounded to its dtype.
    ``bias_correction`` False needs ``compiled`` False (the kernels always correct).
    """
    if compiled and not bias_correction:
        raise ValueError("the compiled Adam kernel always corrects the moments' bias; run bias_correction=False "
                         "with compiled=False (InnerOptimizer does)")
    if compiled:
        from hybrid.kernels import multi_tensor_adam

        multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, lowp, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay, step=step, adamw=adamw, grad_scale=grad_factor)
        return
    device, dtype = params[0].device, params[0].dtype
    if grads[0].dtype != dtype or grads[0].device != device:
        grads = [g.to(device=device, dtype=dtype) for g in grads]
    torch_adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, step=step, adamw=adamw, grad_factor=grad_factor,
                    bias_correction=bias_correction)
    if lowp is not None:
        torch._foreach_copy_(lowp, params)


def fused_adam_op(adamw: bool) -> Optional[Callable[..., None]]:
    """torch's private fused Adam/AdamW op (``torch._fused_adamw_`` / ``torch._fused_adam_``), or None when this
    torch has none. The one place hybrid names it; ``tests/zero/test_fused_adam_op.py`` fails when it is gone."""
    return getattr(torch, "_fused_adamw_" if adamw else "_fused_adam_", None)


def torch_adam_step(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                    exp_avg_sqs: List[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, adamw: bool, grad_factor: float,
                    fused: Optional[bool] = None, bias_correction: bool = True) -> None:
    """One Adam/AdamW update of 1-D fp32 tensors in place with torch's kernels. ``grads`` may be overwritten.

    ``grads`` are multiplied by ``grad_factor``; ``step`` is the 1-based update
    count. ``fused`` None runs the private fused op when this torch has it (one
    pass over memory), else the public functional API's foreach path (a few
    passes, same arithmetic up to rounding); True or False forces one.
    ``bias_correction`` False runs :func:`uncorrected_adam_step` (torch's ops
    always correct), which ``fused=True`` cannot.
    """
    if not bias_correction:
        if fused:
            raise ValueError("torch's fused Adam op always corrects the moments' bias; pass fused=None with "
                             "bias_correction=False")
        uncorrected_adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, adamw=adamw, grad_factor=grad_factor)
        return
    op = fused_adam_op(adamw) if fused is not False else None
    if fused and op is None:
        raise RuntimeError(f"torch {torch.__version__} has no fused {'AdamW' if adamw else 'Adam'} op; "
                           f"pass fused=None to use the public one")
    device = params[0].device
    if op is not None:
        steps = [torch.tensor(float(step), device=device)] * len(params)
        # torch's fused kernel divides gradients by grad_scale.
        scale = None if grad_factor == 1.0 else torch.tensor(1.0 / grad_factor, device=device)
        op(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
           weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
        return
    # The functional API takes no grad_scale outside its fused path, and counts the step itself: each step
    # tensor (one per tensor, on the CPU as torch.optim keeps them) is incremented before it is used.
    if grad_factor != 1.0:
        for g in grads:
            g.mul_(grad_factor)
    steps = [torch.tensor(float(step - 1)) for _ in params]
    functional = functional_adamw if adamw else functional_adam
    functional(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, fused=False, amsgrad=False,
               beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


def uncorrected_adam_step(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                          exp_avg_sqs: List[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, adamw: bool, grad_factor: float) -> None:
    """Adam/AdamW without bias correction on 1-D tensors of one dtype and device, in place; ``grads`` may be
    overwritten.

    With ``g = grad_factor * grad`` (plus ``weight_decay * p`` for Adam's L2 decay)::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g * g
        p <- p * (1 - lr * weight_decay)   (AdamW only)
        p <- p - lr * m / (sqrt(v) + eps)

    the update of DeepSpeed's Adam with ``bias_correction: false``: no ``1 / (1 - beta1^t)``,
    no ``1 / (1 - beta2^t)``, so no step count is needed.
    """
    if grad_factor != 1.0:
        torch._foreach_mul_(grads, grad_factor)
    if weight_decay:
        if adamw:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            torch._foreach_add_(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr)


def _inner_sgd_step(params: List[torch.Tensor], grads: List[torch.Tensor],
                    momentum_buffers: Optional[List[torch.Tensor]], *, lr: float, momentum: float,
                    weight_decay: float, first: bool, grad_factor: float) -> None:
    """SGD with optional momentum and L2 weight decay (no dampening, no Nesterov). ``grads`` may be overwritten."""
    if grad_factor != 1.0:
        torch._foreach_mul_(grads, grad_factor)
    if weight_decay:
        torch._foreach_add_(grads, params, alpha=weight_decay)
    if momentum_buffers is not None:
        if first:
            torch._foreach_copy_(momentum_buffers, grads)
        else:
            torch._foreach_mul_(momentum_buffers, momentum)
            torch._foreach_add_(momentum_buffers, grads)
        grads = momentum_buffers
    torch._foreach_add_(params, grads, alpha=-lr)


def lamb_step(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
              exp_avg_sqs: List[torch.Tensor], lowp: Optional[List[torch.Tensor]], owners: List[torch.Tensor],
              count: int, reduce: Optional[Callable[[torch.Tensor], None]], *, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, step: int, grad_factor: float, bias_correction: bool,
              max_coeff: float, min_coeff: float) -> None:
    """One LAMB update of flat master chunks in place, DeepSpeed's (its FusedLamb kernel's arithmetic).

    With ``g`` the gradient times ``grad_factor``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``update = m / (sqrt(v) + eps) + weight_decay w``; each parameter's trust ratio is ``||w|| / ||update||`` over
    its elements (both before the step), clamped to ``[min_coeff, max_coeff]``, 1 where either norm is 0; then
    ``w -= step_size * ratio * update`` with ``step_size = lr sqrt(1 - b2^t) / (1 - b1^t)`` (bias correction) or
    ``lr``. ``owners[i]``: the parameter (0..count-1) of each element of chunk ``i``, ``count`` for padding.
    ``reduce``: sums the per-parameter partial sums of squares [2, count + 1] over the ranks that hold the other
    parts of the parameters (the dp group), or None when this rank holds them whole. ``grads`` may be overwritten.
    """
    device, dtype = params[0].device, params[0].dtype
    grads = [g.to(device=device, dtype=dtype) * grad_factor for g in grads]
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    updates = torch._foreach_div(exp_avgs, torch._foreach_add(torch._foreach_sqrt(exp_avg_sqs), eps))
    if weight_decay:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    sums = torch.zeros(2, count + 1, dtype=torch.float32, device=device)  # rows: ||w||^2, ||update||^2
    for w, u, owner in zip(params, updates, owners):
        sums[0].index_add_(0, owner, w.float().square())
        sums[1].index_add_(0, owner, u.float().square())
    if reduce is not None:
        reduce(sums)
    w_norm, u_norm = sums.sqrt()
    ratio = torch.where((w_norm > 0) & (u_norm > 0), (w_norm / u_norm).clamp(min_coeff, max_coeff),
                        torch.ones_like(w_norm))
    step_size = lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step) if bias_correction else lr
    for w, u, owner in zip(params, updates, owners):
        w.sub_(u * ratio[owner].to(dtype), alpha=step_size)
    if lowp is not None:
        torch._foreach_copy_(lowp, params)


def _split(flat: torch.Tensor, numels: List[int]) -> List[torch.Tensor]:
    return list(torch.split(flat, numels))


class _GroupState:
    def __init__(self, masters: List[torch.Tensor], lowp: Optional[List[torch.Tensor]], decays: bool,
                 names: List[str], device: torch.device, owner: "InnerOptimizer",
                 param_owners: Optional[List[torch.Tensor]] = None, param_count: int = 0,
                 decoupled_lr: bool = False):
        self.masters = masters
        self.decoupled_lr = decoupled_lr  # steps at the owner's decoupled_lr (embedding and output weights)
        self.param_owners = param_owners  # lamb: per chunk, the parameter of each element (param_count: padding)
        self.param_count = param_count
        self.lowp = lowp
        self.decays = decays
        self._owner = owner
        self.numels = [m.numel() for m in masters]
        total = sum(self.numels)
        dtype = masters[0].dtype
        self.state: Dict[str, torch.Tensor] = {n: torch.zeros(total, dtype=dtype, device=device)
                                               for n in names}
        self.views = {n: _split(t, self.numels) for n, t in self.state.items()}

    @property
    def weight_decay(self) -> float:
        """The optimizer's current weight decay for a decaying group (it may change between steps), else 0."""
        return self._owner.weight_decay if self.decays else 0.0

    @property
    def lr(self) -> float:
        """This step's learning rate: the optimizer's, or its decoupled one for a decoupled group."""
        if self.decoupled_lr:
            if self._owner.decoupled_lr is None:
                raise ValueError("a decoupled group (optimizer.decoupled_lr) needs the step's decoupled_lr")
            return self._owner.decoupled_lr
        return self._owner.lr


class InnerOptimizer:
    """AdamW, Adam, SGD or LAMB over lists of flat master chunks, one list per flat group.

    LAMB's groups need the parameter of each element (:meth:`add_group`'s ``param_owners``) and, where a rank
    holds only part of its parameters, :attr:`norm_reduce` (the sum of its per-parameter partial sums over dp).
    """

    def __init__(self, kind: str, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, use_kernels: bool = True,
                 bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01):
        if kind not in KINDS:
            raise ValueError(f"unknown optimizer {kind!r}; expected one of {', '.join(KINDS)} "
                             f"(config key optimizer.type)")
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr} (config key optimizer.params.lr)")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {tuple(betas)} "
                             f"(config key optimizer.params.betas)")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps} (config key optimizer.params.eps)")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay} "
                             f"(config key optimizer.params.weight_decay)")
        if momentum < 0 or momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum} (config key optimizer.params.momentum)")
        self.kind = kind
        self.lr = lr
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = eps
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.bias_correction = bool(bias_correction)  # Adam/AdamW: divide the moments by 1 - beta^t
        self.max_coeff, self.min_coeff = float(max_coeff), float(min_coeff)  # LAMB's trust-ratio clamp
        self.norm_reduce: Optional[Callable[[torch.Tensor], None]] = None  # LAMB: see the class docstring
        self.decoupled_lr: Optional[float] = None  # the decoupled groups' rate this step (optimizer.decoupled_lr)
        self.step_count = 0  # updates applied (skipped steps do not count)
        self.groups: List[_GroupState] = []
        self.use_kernels = use_kernels
        self.compiled: Optional[bool] = None  # decided by the first group: compiled Adam or torch's

    @property
    def state_names(self) -> List[str]:
        if self.kind in ("adamw", "adam", "lamb"):
            return ["exp_avg", "exp_avg_sq"]
        return ["momentum_buffer"] if self.momentum else []

    def add_group(self, masters: List[torch.Tensor], decay: bool, lowp: Optional[List[torch.Tensor]] = None,
                  state_device: Optional[torch.device] = None, param_owners: Optional[List[torch.Tensor]] = None,
                  param_count: int = 0, decoupled_lr: bool = False) -> None:
        """Register one flat group's master chunks (1-D, all of the master dtype).

        ``lowp``: chunks (same sizes) that must hold the rounded weights after every step. ``param_owners``,
        ``param_count``: LAMB's (int64 chunks, the parameter 0..param_count-1 of each element, param_count for
        padding).
        """
        if self.kind == "lamb" and param_owners is None:
            raise ValueError("LAMB needs each group's param_owners: the parameter of each element")
        device = state_device if state_device is not None else masters[0].device
        if self.compiled is None:
            # the compiled kernels always correct the moments' bias: without it, torch's ops run instead
            self.compiled = (self.use_kernels and self.kind in ("adamw", "adam") and self.bias_correction
                             and masters[0].dtype == torch.float32 and compiled_adam_available(masters[0].device))
        self.groups.append(_GroupState(masters, lowp, decay, self.state_names, device, self, param_owners,
                                       param_count, decoupled_lr))

    def step(self, grads: List[List[torch.Tensor]], grad_factor: float, lr: Optional[float] = None) -> None:
        """Update every group's masters from ``grads[g]`` (chunks matching the masters) times ``grad_factor``."""
        if lr is not None:
            self.lr = lr
        self.step_count += 1
        for group, g_chunks in zip(self.groups, grads):
            if self.kind == "lamb":
                lamb_step(group.masters, g_chunks, group.views["exp_avg"], group.views["exp_avg_sq"], group.lowp,
                          group.param_owners, group.param_count, self.norm_reduce, lr=group.lr, beta1=self.betas[0],
                          beta2=self.betas[1], eps=self.eps, weight_decay=group.weight_decay, step=self.step_count,
                          grad_factor=grad_factor, bias_correction=self.bias_correction, max_coeff=self.max_coeff,
                          min_coeff=self.min_coeff)
            elif self.kind == "sgd":
                master = group.masters[0]
                if g_chunks[0].dtype != master.dtype or g_chunks[0].device != master.device:
                    g_chunks = [g.to(device=master.device, dtype=master.dtype) for g in g_chunks]
                _inner_sgd_step(group.masters, g_chunks, group.views.get("momentum_buffer"), lr=group.lr,
                                momentum=self.momentum, weight_decay=group.weight_decay,
                                first=self.step_count == 1, grad_factor=grad_factor)
                if group.lowp is not None:
                    torch._foreach_copy_(group.lowp, group.masters)
            else:
                _inner_adam_step(group.masters, g_chunks, group.views["exp_avg"], group.views["exp_avg_sq"],
                                 group.lowp, lr=group.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                                 weight_decay=group.weight_decay, step=self.step_count,
                                 adamw=self.kind == "adamw", grad_factor=grad_factor, compiled=bool(self.compiled),
                                 bias_correction=self.bias_correction)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for g in self.groups for t in g.state.values())

    def state_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step_count, "lr": self.lr,
                "groups": [dict(g.state) for g in self.groups]}

    def load_state_dict(self, sd: dict) -> None:
        if sd["kind"] != self.kind:
            raise ValueError(f"checkpoint was written by optimizer {sd['kind']!r} but this run uses "
                             f"{self.kind!r}; set optimizer.type to {sd['kind']!r} or start fresh")
        if len(sd["groups"]) != len(self.groups):
            raise ValueError(f"checkpoint has {len(sd['groups'])} parameter groups, this model has "
                             f"{len(self.groups)}")
        for g, saved in zip(self.groups, sd["groups"]):
            for name, t in g.state.items():
                if name not in saved or saved[name].numel() != t.numel():
                    raise ValueError(f"optimizer state {name!r} in the checkpoint does not match this "
                                     f"partition ({t.numel()} elements); reshard the checkpoint to this layout")
                t.copy_(saved[name])
        self.step_count = int(sd["step"])
        self.lr = float(sd["lr"])
