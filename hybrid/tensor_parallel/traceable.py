"""The tensor-parallel mappings as ``torch.compile`` traces them: functional collectives, no graph break.

Inside a compiled region (``torch.compiler.is_compiling()``, :mod:`model_zoo.compile`), each primitive of
:mod:`hybrid.tensor_parallel.mappings` with more than one TP rank runs :func:`conjugate`: the same forward collective
and the same conjugate backward collective as its eager autograd function, written with
``torch.distributed._functional_collectives`` (``_c10d_functional`` ops: dynamo puts them in the graph, AOTAutograd
traces the backward, inductor schedules them) over the axis's own process group, named by its group name. One
:class:`_Conjugate` autograd function holds every pair: dynamo traces its forward and backward into the block's
graph (an ``autograd_function_apply`` node), so a dense block at TP2 is one graph.

What changes against the eager path (:class:`hybrid.comm.Communicator`, which stays as it is for eager code):

* **Accounting.** Compiled code cannot call the communicator's counters. Each primitive notes, as it is traced, the
  collective its forward runs and, when the input needs a gradient, the one its backward will run, with the bytes
  their shapes give (static shapes: constants of the graph). Dynamo replays those list appends each time the
  compiled block runs (after its graph); the block's eager wrapper (``model_zoo.compile``) takes them with
  :func:`drain` and counts them with :meth:`Communicator.record_traced <hybrid.comm.Communicator.record_traced>`:
  the forward ones at once, the backward ones from a hook on the block's output when its gradient arrives (once
  per backward: a full-recompute replay of the block runs the forward collectives again, as eager code does, and
  not the backward ones). The report (``"op/axis"``: calls, payload, wire and inter-node bytes) is then the one an
  eager run gives, except where the two runs differ in what they run (a replay that checkpoint stops early stops
  an eager block before its last collectives, a compiled one after its whole graph). ``blocked_seconds`` leaves
  them out: the wait is a graph node, not timed.
* **Timeouts.** The functional collectives wait with their process group's timeout, and
  :class:`hybrid.topology.Topology` creates every group with the job's (``timeout_s``), so a stuck peer fails the
  step after the same time; the error names the process group, not the operation.
* **Backend paths.** The communicator's point-to-point reduce-scatters and all-gathers on gloo
  (:mod:`hybrid.comm_p2p`) are an eager optimisation; compiled code calls the backend's own. Same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

import torch
import torch.distributed._functional_collectives as funcol

from hybrid.comm_tensors import nbytes as _nbytes

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.comm import Communicator
    from hybrid.topology import Topology

# What each transform of a tensor is, and (for the collectives) the communicator's name for it:
IDENTITY = "identity"
SPLIT_LAST, SPLIT_FIRST = "split_last", "split_first"  # keep this rank's chunk of the last / first dim
ALL_REDUCE = "all_reduce"                              # sum over the group, same shape
ALL_REDUCE_ROWS = "all_reduce_rows"                    # sum rows [lo, hi) of dim 0 over the group, keep the rest
GATHER_LAST, GATHER_FIRST = "gather_last", "gather_first"  # all-gather along the last / first dim, rank order
REDUCE_SCATTER_FIRST = "reduce_scatter_first"          # sum over the group, keep this rank's dim-0 chunk
_COUNTED_AS = {ALL_REDUCE: "all_reduce", ALL_REDUCE_ROWS: "all_reduce", GATHER_LAST: "all_gather",
               GATHER_FIRST: "all_gather", REDUCE_SCATTER_FIRST: "reduce_scatter"}

# (op, axis, payload bytes, backward?) of the collectives the compiled blocks ran since the last drain(): appended
# by the compiled code (dynamo replays the appends), emptied by drain() after each block call.
_NOTES: List[Tuple[str, str, int, bool]] = []


def check_splits(x: torch.Tensor, n: int, dim: int) -> None:
    """Refuse an ``x`` whose ``dim`` (``-1``: the TP-partitioned features, ``0``: the sequence under sequence
    parallelism) does not split into ``n`` equal chunks."""
    if x.shape[dim] % n != 0:
        if dim == 0:
            raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {n}; "
                             f"with sequence_parallel=True the sequence must split evenly over TP ranks")
        raise ValueError(f"last dim {x.shape[dim]} is not divisible by the tensor-parallel size {n}")


def chunk(x: torch.Tensor, n: int, rank: int, dim: int) -> torch.Tensor:
    """Chunk ``rank`` of ``n`` equal ones of ``x`` along ``dim`` (:func:`check_splits`), contiguous."""
    check_splits(x, n, dim)
    return x.chunk(n, dim=dim)[rank].contiguous()


def ranks_to_last(gathered: torch.Tensor, shape: torch.Size, n: int) -> torch.Tensor:
    """``gathered`` ``[n*s, ..., k]`` (the ``n`` ranks' ``shape`` pieces along dim 0) as ``[s, ..., n*k]`` with rank
    r's piece at columns ``[r*k, (r+1)*k)``."""
    return gathered.view((n,) + tuple(shape)).movedim(0, -2).reshape(*shape[:-1], n * shape[-1])


def _transform(kind: str, x: torch.Tensor, group: str, n: int, rank: int, lo: int, hi: int) -> torch.Tensor:
    """``kind`` applied to ``x`` over the process group named ``group`` (``n`` ranks, this one ``rank``)."""
    if kind == IDENTITY:
        return x.view_as(x)
    if kind == SPLIT_LAST:
        return chunk(x, n, rank, -1)
    if kind == SPLIT_FIRST:
        return chunk(x, n, rank, 0)
    if kind == ALL_REDUCE:
        return funcol.all_reduce(x.contiguous(), "sum", group)
    if kind == ALL_REDUCE_ROWS:
        x = x.contiguous()
        return torch.slice_scatter(x, funcol.all_reduce(x[lo:hi], "sum", group), 0, lo, hi)
    if kind == GATHER_FIRST:
        return funcol.all_gather_single(x.contiguous(), 0, group)
    if kind == GATHER_LAST:
        return ranks_to_last(funcol.all_gather_single(x.contiguous(), 0, group), x.shape, n)
    if kind == REDUCE_SCATTER_FIRST:
        check_splits(x, n, 0)
        return funcol.reduce_scatter_single(x.contiguous(), "sum", 0, group)
    raise ValueError(f"unknown tensor-parallel transform {kind!r}")


class _Conjugate(torch.autograd.Function):
    """Forward ``fwd``, backward ``bwd`` (two of this module's transforms, each the other's adjoint)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, group, n, rank, lo, hi):
        ctx.args = (bwd, group, n, rank, lo, hi)
        return _transform(fwd, x, group, n, rank, lo, hi)

    @staticmethod
    def backward(ctx, g):
        bwd, group, n, rank, lo, hi = ctx.args
        return (_transform(bwd, g, group, n, rank, lo, hi),) + (None,) * 7


def _note(kind: str, axis: str, x: torch.Tensor, n: int, lo: int, hi: int, backward: bool) -> None:
    """Note the collective ``kind`` applied to ``x`` (nothing for a local transform), with the payload the
    communicator would count: the reduced buffer for an all-reduce and a reduce-scatter's input, the gathered
    buffer for an all-gather."""
    op = _COUNTED_AS.get(kind)
    if op is None:
        return
    nbytes = _nbytes(x)
    if kind == ALL_REDUCE_ROWS:
        nbytes = nbytes // x.shape[0] * (hi - lo)
    elif op == "all_gather":
        nbytes *= n
    _NOTES.append((op, axis, nbytes, backward))


def conjugate(x: torch.Tensor, topo: "Topology", fwd: str, bwd: str, axis: str = "tp", lo: int = 0,
              hi: int = 0) -> torch.Tensor:
    """``fwd`` of ``x`` over ``axis`` (a process group of more than one rank), ``bwd`` of its gradient, as functional
    collectives that dynamo traces; each collective noted for the communicator's report (:func:`drain`)."""
    group = topo.group(axis).group_name
    n, rank = topo.size(axis), topo.rank_in(axis)
    y = _Conjugate.apply(x, fwd, bwd, group, n, rank, lo, hi)
    _note(fwd, axis, x, n, lo, hi, False)
    if torch.is_grad_enabled() and x.requires_grad:
        _note(bwd, axis, y, n, lo, hi, True)
    return y


Note = Tuple[str, str, int]  # (op, axis, payload bytes): one collective, as Communicator.record_traced counts it


def drain() -> Tuple[List[Note], List[Note]]:
    """The forward and the backward collectives noted since the last call (the compiled block that just ran).
    Whatever compiles code that calls the mappings calls this after each call (``model_zoo.compile`` does), or the
    notes pile up."""
    forward = [(op, axis, nbytes) for op, axis, nbytes, backward in _NOTES if not backward]
    backward = [(op, axis, nbytes) for op, axis, nbytes, is_backward in _NOTES if is_backward]
    _NOTES.clear()
    return forward, backward


def count(comm: "Communicator", notes: List[Note]) -> None:
    """Count ``notes`` (from :func:`drain`) with ``comm``."""
    for op, axis, nbytes in notes:
        comm.record_traced(op, axis, nbytes)
