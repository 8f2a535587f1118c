"""The language-model loss of sequences split over the context-parallel ranks.

Each rank of a ``"cp"`` group holds ``1 / cp`` of every sequence's tokens.
The loss one process computes is ``sum(loss * mask) / sum(mask)`` over all of
them, so the numerator and the count are summed over ``"cp"`` (forward: an
all-reduce; backward: each rank's gradient reaches its own tokens only), and
every rank of the group returns the same value.

The parameters' gradients on the ``cp`` ranks are then partial sums of one
sequence's gradient, which ZeRO reduces over ``dp x cp`` ranks
(:meth:`hybrid.topology.Topology.data_view`) dividing by ``dp x cp``: the
gradient of the returned loss is therefore multiplied by ``cp`` in backward
(its value is the true loss), so that the reduction yields the sum over the
``cp`` ranks and the mean over the ``dp`` ranks, as one process would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

AXIS = "cp"


class _SumOverCP(torch.autograd.Function):
    """Forward: the sum over ``"cp"``; backward: identity (each rank's share reaches its own tokens)."""

    @staticmethod
    def forward(ctx, x, topo):
        out = x.clone()
        topo.comm.all_reduce(out, AXIS)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def sum_over_cp(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``x`` summed over the ``"cp"`` group in forward (an all-reduce); backward: identity, each rank's share of
    the gradient reaching its own tokens. ``x`` itself at cp 1."""
    return _SumOverCP.apply(x, topo) if topo.cp_size > 1 else x


def with_cp_factor(loss: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``loss`` (a value of the whole sequences, equal on the ``"cp"`` ranks) whose gradient carries the factor
    ``cp`` in backward (the module docstring); ``loss`` itself at cp 1."""
    return _ScaleGrad.apply(loss, float(topo.cp_size)) if topo.cp_size > 1 else loss


def context_parallel_mean(token_loss: torch.Tensor, mask: "torch.Tensor | None", topo: "Topology") -> torch.Tensor:
    """The mean of ``token_loss`` (this rank's tokens, any shape; times ``mask`` when given) over every token of
    the ``"cp"`` group, a scalar equal on its ranks; its gradient carries the factor ``cp`` (module docstring)."""
    if mask is None:
        numerator, count = token_loss.sum(), float(token_loss.numel())
        count = torch.tensor([count], dtype=torch.float64, device=token_loss.device)
    else:
        numerator = (token_loss * mask).sum()
        count = mask.detach().sum().reshape(1).to(torch.float64)
    numerator = sum_over_cp(numerator.reshape(1), topo)
    topo.comm.all_reduce(count, AXIS)
    return with_cp_factor((numerator / count.to(numerator.dtype))[0], topo)
