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


# ---- raw collectives (no autograd) -------------------------------------------------
def _all_reduce(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    if topo.tp_size == 1:
        return x
    # A fresh buffer: the incoming tensor may be shared with other graph edges.
    out = x.contiguous().clone()
    topo.comm.all_reduce(out, AXIS)
    return out


def _split_last(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    return x if topo.tp_size == 1 else traceable.chunk(x, topo.tp_size, topo.tp_rank, -1)


def _gather_last(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    n = topo.tp_size
    if n == 1:
        return x
    x = x.contiguous()
    # Gathered along dim 0 (the layout every backend accepts), then rank-ordered along the last dim.
    buf = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    topo.comm.all_gather_into_tensor(buf, x, AXIS)
    return traceable.ranks_to_last(buf, x.shape, n)


def _split_first(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    return x if topo.tp_size == 1 else traceable.chunk(x, topo.tp_size, topo.tp_rank, 0)


def _gather_first(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    n = topo.tp_size
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    topo.comm.all_gather_into_tensor(out, x, AXIS)
    return out


def _reduce_scatter_first(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    n = topo.tp_size
    if n == 1:
        return x
    traceable.check_splits(x, n, 0)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    topo.comm.reduce_scatter_tensor(out, x, AXIS)
    return out


# ---- autograd functions ----------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.topo), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        return _all_reduce(x, topo)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _split_last(x, topo)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.topo), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _gather_last(x, topo)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.topo), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _split_first(x, topo)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g, ctx.topo), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo, reduce_scatter_grad):
        ctx.topo = topo
        ctx.reduce_scatter_grad = reduce_scatter_grad
        return _gather_first(x, topo)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_scatter_grad:
            return _reduce_scatter_first(g, ctx.topo), None, None
        return _split_first(g, ctx.topo), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _reduce_scatter_first(x, topo)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g, ctx.topo), None


class _SumGradRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo, lo, hi, axis):
        ctx.topo, ctx.lo, ctx.hi, ctx.axis = topo, lo, hi, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        ctx.topo.comm.all_reduce(g[ctx.lo:ctx.hi], ctx.axis)  # rows along dim 0: a contiguous view
        return g, None, None, None, None


# ---- public API ------------------------------------------------------------------------
# With one TP rank each primitive is the identity both ways, and returns its input without an autograd function.
# Inside a compiled region (model_zoo.compile) each one is the same pair of collectives as functional collectives
# that dynamo traces (hybrid.tensor_parallel.traceable): no graph break; eager code keeps the communicator's
# autograd functions above (byte counts, timed waits, gloo's point-to-point paths).
def _compiling() -> bool:
    return torch.compiler.is_compiling()


def copy_to_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``"tp"``.

    Used where a replicated tensor enters a TP-partitioned computation (each
    rank's gradient is a partial sum), and to wrap replicated parameters used
    on sequence-sharded activations.
    """
    if topo.tp_size == 1:
        return x
    return traceable.conjugate(x, topo, IDENTITY, ALL_REDUCE) if _compiling() else _CopyToTP.apply(x, topo)


def reduce_from_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """All-reduce (sum) over ``"tp"`` forward; identity backward. Any shape."""
    if topo.tp_size == 1:
        return x
    return traceable.conjugate(x, topo, ALL_REDUCE, IDENTITY) if _compiling() else _ReduceFromTP.apply(x, topo)


def scatter_to_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[..., n*k] -> [..., k]``: keep this TP rank's last-dim chunk; backward all-gathers it."""
    if topo.tp_size == 1:
        return x
    return traceable.conjugate(x, topo, SPLIT_LAST, GATHER_LAST) if _compiling() else _ScatterToTP.apply(x, topo)


def gather_from_tp_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[..., k] -> [..., n*k]``: all-gather the last dim over ``"tp"`` in rank order; backward splits."""
    if topo.tp_size == 1:
        return x
    return traceable.conjugate(x, topo, GATHER_LAST, SPLIT_LAST) if _compiling() else _GatherFromTP.apply(x, topo)


def scatter_to_sequence_parallel_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[s, ...] -> [s/n, ...]``: keep this TP rank's sequence chunk; backward all-gathers dim 0."""
    if topo.tp_size == 1:
        return x
    return traceable.conjugate(x, topo, SPLIT_FIRST, GATHER_FIRST) if _compiling() else _ScatterToSP.apply(x, topo)


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
    if _compiling():
        return traceable.conjugate(x, topo, GATHER_FIRST, REDUCE_SCATTER_FIRST if reduce_scatter_grad else SPLIT_FIRST)
    return _GatherFromSP.apply(x, topo, reduce_scatter_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[s, ...] -> [s/n, ...]``: sum over ``"tp"`` and keep this rank's chunk; backward all-gathers dim 0."""
    if topo.tp_size == 1:
        return x
    if _compiling():
        return traceable.conjugate(x, topo, REDUCE_SCATTER_FIRST, GATHER_FIRST)
    return _ReduceScatterToSP.apply(x, topo)


def sum_grad_rows(x: torch.Tensor, topo: "Topology", lo: int, hi: int, axis: str) -> torch.Tensor:
    """Identity forward; backward sums rows ``[lo, hi)`` (dim 0) of the gradient over ``axis`` (a ``"tp/k"``).

    Wraps a weight whose rows ``[lo, hi)`` the ``k`` ranks of ``axis`` hold
    alike and use for different outputs: each rank's gradient of them is a
    partial sum, and the sum keeps the copies equal.
    """
    if _compiling():
        return traceable.conjugate(x, topo, IDENTITY, ALL_REDUCE_ROWS, axis, lo, hi)
    return _SumGradRows.apply(x, topo, lo, hi, axis)
