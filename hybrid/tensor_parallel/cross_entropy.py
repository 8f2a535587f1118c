"""Cross entropy over vocabulary-parallel logits, without gathering them.

Each TP rank holds the logits of a contiguous slice of the (padded)
vocabulary, ``[..., V_p/tp]``. The softmax normaliser is assembled with one
max all-reduce and one sum all-reduce over ``"tp"``; the full logits never
exist on one rank. Padded vocabulary columns (index >= ``vocab_size``) are
excluded: they never enter the normaliser and their gradient is exactly 0.

With label smoothing ``eps`` the target distribution is
``(1 - eps) * onehot + eps / vocab_size`` over the real vocabulary, so
``loss = (1 - eps) * nll + eps * mean_j(-log p_j)``, as ``F.cross_entropy``.
The arithmetic runs in fp32 whatever the logits' dtype. With
``overwrite_logits`` (fp32 logits the caller will not read again, such as a
model's own head output) the shifted logits, their exponential and the saved
softmax are all computed in the logits' memory: a ``[..., V_p/tp]`` buffer
fewer to allocate and first-touch per call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

_REDUCTIONS = ("none", "sum", "mean")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, topo, vocab_size, label_smoothing, overwrite_logits):
        local_v = logits.shape[-1]
        start = topo.tp_rank * local_v
        n_valid = max(0, min(local_v, vocab_size - start))  # real (unpadded) columns on this rank

        x = logits.float()
        # x may be the caller's fp32 logits themselves: written to only when the caller gave them up
        own = overwrite_logits or x is not logits
        if n_valid < local_v:
            if not own:
                x, own = x.clone(), True
            x[..., n_valid:] = float("-inf")
        row_max = x.amax(dim=-1)  # amax: max without the indices, which nothing here needs
        topo.comm.all_reduce(row_max, "tp", op="max")
        # In place where allowed: a fresh [..., V_p/tp] tensor costs as much as the rest of the forward (page faults)
        x = x.sub_(row_max.unsqueeze(-1)) if own else x - row_max.unsqueeze(-1)

        in_range = (target >= start) & (target < start + local_v)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        # One all-reduce for every per-row sum: [sum exp, target logit, (sum of logits)].
        smooth_sum = x[..., :n_valid].sum(dim=-1) if label_smoothing > 0 else None
        exp = x.exp_()  # the shifted logits are not needed after this: exponentiate them where they are
        parts = [exp.sum(dim=-1), target_logit] + ([smooth_sum] if smooth_sum is not None else [])
        sums = torch.stack(parts)
        topo.comm.all_reduce(sums, "tp")
        sum_exp, target_logit = sums[0], sums[1]

        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            smooth = log_z - sums[2] / vocab_size  # mean over the vocabulary of -log p_j
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, in_range)
        ctx.n_valid, ctx.vocab_size, ctx.label_smoothing = n_valid, vocab_size, label_smoothing
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_range = ctx.saved_tensors
        eps = ctx.label_smoothing
        g = grad_loss.unsqueeze(-1).float()
        # (softmax - target distribution) * g, in two passes over the logits: the product into a new tensor
        # (the saved softmax must survive a second backward), then the target terms times g where they fall
        grad = softmax * g
        hit = in_range.unsqueeze(-1).to(grad.dtype) * (1.0 - eps) * g
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        if eps > 0:
            grad[..., :ctx.n_valid] -= (eps / ctx.vocab_size) * g
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, topology: "Topology", *,
                                 vocab_size: Optional[int] = None, label_smoothing: float = 0.0,
                                 loss_mask: Optional[torch.Tensor] = None,
                                 reduction: str = "none", overwrite_logits: bool = False) -> torch.Tensor:
    """Cross entropy of vocab-parallel ``logits`` ``[..., V_p/tp]`` against ``target`` ``[...]``.

    ``target`` holds global token ids in ``[0, vocab_size)``; ``vocab_size``
    (default: the unpadded ``V_p``) marks where padding starts. ``loss_mask``
    ``[...]`` weighs each token. ``reduction``: ``"none"`` gives the per-token
    loss ``[...]`` (times the mask when given), ``"sum"`` its sum, ``"mean"``
    ``sum(loss * mask) / sum(mask)`` (the plain mean without a mask).
    The result is identical on every rank of the ``"tp"`` group.
    ``overwrite_logits``: the caller will not read ``logits`` again, so the
    softmax may be computed in their memory (fp32 logits; other dtypes are
    converted into a new tensor anyway). The values are the same either way.
    """
    tp = topology.tp_size
    full_v = logits.shape[-1] * tp
    vocab_size = full_v if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= full_v:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {full_v}] (local logits width "
                         f"{logits.shape[-1]} x tp {tp})")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal the logits shape without the vocab "
                         f"dim, {tuple(logits.shape[:-1])}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if loss_mask is not None and tuple(loss_mask.shape) != tuple(target.shape):
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} must equal the target shape "
                         f"{tuple(target.shape)}")
    if target.numel() and bool(((target < 0) | (target >= vocab_size)).any()):
        raise ValueError(f"target ids must lie in [0, vocab_size={vocab_size}); got min {int(target.min())}, "
                         f"max {int(target.max())}")

    loss = _VocabParallelCrossEntropy.apply(logits, target, topology, vocab_size, float(label_smoothing),
                                            bool(overwrite_logits))
    if loss_mask is not None:
        loss = loss * loss_mask.to(loss.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if loss_mask is None:
        return loss.mean()
    # A batch whose mask is all zeros gives 0 rather than 0/0.
    return loss.sum() / loss_mask.to(loss.dtype).sum().clamp_min(torch.finfo(loss.dtype).tiny)
