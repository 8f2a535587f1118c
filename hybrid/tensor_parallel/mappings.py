"""Autograd communication primitives for tensor (and sequence) parallelism.

Each primitive is a pair of collectives over the ``"tp"`` axis of a
:class:`~hybrid.topology.Topology`: one in the forward pass and its adjoint in
the backward pass. With one TP rank every primitive is the identity.

Tensor-parallel (last-dim) primitives::

    copy_to_tp_region        fwd: identity           bwd: all-reduce
    reduce_from_tp_region    fwd: all-reduce         bwd: identity
    scatter_to_tp_region     fwd: split last dim     bwd: all-gather last dim
    gather_from_tp_region    fwd: all-gather last    bwd: split last dim

Sequence-parallel primitives act on dim 0, the sequence dim of the
``[s, b, h]`` activations used inside the model::

    scatter_to_sequence_parallel_region         fwd: split dim 0        bwd: all-gather dim 0
    gather_from_sequence_parallel_region        fwd: all-gather dim 0   bwd: reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region  fwd: reduce-scatter 0   bwd: all-gather dim 0

A replicated piece of a TP-partitioned weight (a key/value head that several
TP ranks hold under grouped-query attention) goes through::

    sum_grad_rows            fwd: identity           bwd: all-reduce rows [lo, hi) over "tp/k"

Every collective goes through ``topology.comm`` on the ``"tp"`` group (or a
``"tp/k"`` sub-group of it), except inside a compiled region
(``torch.compiler.is_compiling()``, :mod:`model_zoo.compile`): there each
primitive is the same pair of collectives on the same group as functional
collectives that dynamo traces (:mod:`hybrid.tensor_parallel.traceable`,
which also says how the communicator still counts them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybrid.tensor_parallel import traceable
from hybrid.tensor_parallel.traceable import (ALL_REDUCE, ALL_REDUCE_ROWS, GATHER_FIRST, GATHER_LAST, IDENTITY,
                                              REDUCE_SCATTER_FIRST, SPLIT_FIRST, SPLIT_LAST)

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

AXIS = "tp"


# ---- the transforms, eagerly (no autograd) ------------------------------------------------
# Each takes (x, topo, axis, lo, hi) and runs through ``topo.comm`` on ``axis`` (of more than one rank: the public
# functions return a one-rank axis's input as it is).
def _all_reduce(x: torch.Tensor, topo: "Topology", axis: str, lo: int, hi: int) -> torch.Tensor:
    # A fresh buffer: the incoming tensor may be shared with other graph edges.
    out = x.contiguous().clone()
    topo.comm.all_reduce(out, axis)
    return out


def _all_reduce_rows(x: torch.Tensor, topo: "Topology", axis: str, lo: int, hi: int) -> torch.Tensor:
    out = x.contiguous().clone()
    topo.comm.all_reduce(out[lo:hi], axis)  # rows along dim 0: a contiguous view
    return out


def _gather_first(x: torch.Tensor, topo: "Topology", axis: str, lo: int, hi: int) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((topo.size(axis) * x.shape[0],) + tuple(x.shape[1:]))
    topo.comm.all_gather_into_tensor(out, x, axis)
    return out


def _gather_last(x: torch.Tensor, topo: "Topology", axis: str, lo: int, hi: int) -> torch.Tensor:
    # Gathered along dim 0 (the layout every backend accepts), then rank-ordered along the last dim.
    return traceable.ranks_to_last(_gather_first(x, topo, axis, lo, hi), x.shape, topo.size(axis))


def _reduce_scatter_first(x: torch.Tensor, topo: "Topology", axis: str, lo: int, hi: int) -> torch.Tensor:
    n = topo.size(axis)
    traceable.check_splits(x, n, 0)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    topo.comm.reduce_scatter_tensor(out, x, axis)
    return out


_EAGER = {
    IDENTITY: lambda x, topo, axis, lo, hi: x.view_as(x),
    SPLIT_LAST: lambda x, topo, axis, lo, hi: traceable.chunk(x, topo.size(axis), topo.rank_in(axis), -1),
    SPLIT_FIRST: lambda x, topo, axis, lo, hi: traceable.chunk(x, topo.size(axis), topo.rank_in(axis), 0),
    ALL_REDUCE: _all_reduce, ALL_REDUCE_ROWS: _all_reduce_rows, GATHER_FIRST: _gather_first,
    GATHER_LAST: _gather_last, REDUCE_SCATTER_FIRST: _reduce_scatter_first,
}


class _EagerConjugate(torch.autograd.Function):
    """Forward ``fwd``, backward ``bwd`` (two transforms, each the other's adjoint) through the communicator."""

    @staticmethod
    def forward(ctx, x, topo, fwd, bwd, axis, lo, hi):
        ctx.args = (topo, bwd, axis, lo, hi)
        return _EAGER[fwd](x, topo, axis, lo, hi)

    @staticmethod
    def backward(ctx, g):
        topo, bwd, axis, lo, hi = ctx.args
        return (_EAGER[bwd](g, topo, axis, lo, hi),) + (None,) * 6


# ---- public API ------------------------------------------------------------------------
# With one TP rank each primitive is the identity both ways, and returns its input without an autograd function.
# Inside a compiled region (model_zoo.compile) each one is the same pair of collectives as functional collectives
# that dynamo traces (hybrid.tensor_parallel.traceable): no graph break; eager code runs the pair through the
# communicator (byte counts, timed waits, gloo's point-to-point paths). Each primitive names its pair once.
def _pair(x: torch.Tensor, topo: "Topology", fwd: str, bwd: str, axis: str = AXIS, lo: int = 0,
          hi: int = 0) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return traceable.conjugate(x, topo, fwd, bwd, axis, lo, hi)
    return _EagerConjugate.apply(x, topo, fwd, bwd, axis, lo, hi)


def copy_to_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``"tp"``.

    Used where a replicated tensor enters a TP-partitioned computation (each
    rank's gradient is a partial sum), and to wrap replicated parameters used
    on sequence-sharded activations.
    """
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, IDENTITY, ALL_REDUCE)


def reduce_from_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """All-reduce (sum) over ``"tp"`` forward; identity backward. Any shape."""
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, ALL_REDUCE, IDENTITY)


def scatter_to_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[..., n*k] -> [..., k]``: keep this TP rank's last-dim chunk; backward all-gathers it."""
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, SPLIT_LAST, GATHER_LAST)


def gather_from_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[..., k] -> [..., n*k]``: all-gather the last dim over ``"tp"`` in rank order; backward splits."""
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, GATHER_LAST, SPLIT_LAST)


def scatter_to_sequence_parallel_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[s, ...] -> [s/n, ...]``: keep this TP rank's sequence chunk; backward all-gathers dim 0."""
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, SPLIT_FIRST, GATHER_FIRST)


def gather_from_sequence_parallel_region(x: torch.Tensor, topo: "Topology",
                                         reduce_scatter_grad: bool = True) -> torch.Tensor:
    """``[s/n, ...] -> [s, ...]``: all-gather dim 0 over ``"tp"``.

    Backward reduce-scatters the gradient (the gathered tensor feeds
    TP-partitioned weights, so each rank holds a partial gradient); with
    ``reduce_scatter_grad=False`` it only keeps this rank's chunk (the gathered
    tensor was used identically on every rank).
    """
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, GATHER_FIRST, REDUCE_SCATTER_FIRST if reduce_scatter_grad else SPLIT_FIRST)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[s, ...] -> [s/n, ...]``: sum over ``"tp"`` and keep this rank's chunk; backward all-gathers dim 0."""
    if topo.tp_size == 1:
        return x
    return _pair(x, topo, REDUCE_SCATTER_FIRST, GATHER_FIRST)


def sum_grad_rows(x: torch.Tensor, topo: "Topology", lo: int, hi: int, axis: str) -> torch.Tensor:
    """Identity forward; backward sums rows ``[lo, hi)`` (dim 0) of the gradient over ``axis`` (a ``"tp/k"``).

    Wraps a weight whose rows ``[lo, hi)`` the ``k`` ranks of ``axis`` hold
    alike and use for different outputs: each rank's gradient of them is a
    partial sum, and the sum keeps the copies equal.
    """
    return _pair(x, topo, IDENTITY, ALL_REDUCE_ROWS, axis, lo, hi)
