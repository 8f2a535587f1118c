"""Axis-addressed communication: every collective and point-to-point transfer of the library.

Every collective, and the point-to-point traffic between pipeline stages, goes
through a :class:`Communicator`, which :class:`~hybrid.topology.Topology` builds
over its :class:`~hybrid.group_table.GroupTable` (the communicator sees only
that table's :class:`~hybrid.group_table.AxisGroups` view, never the topology).
Operations are addressed by *axis* (``"tp"``, ``"dp"``, ``"pp"``, ``"mp"``,
``"world"``) and peers by their rank within the axis group, rather than by raw
process group and global rank, which lets this module:

* count the bytes each operation moved (:meth:`Communicator.report`), both
  as payload (the tensor sizes) and as wire bytes under a ring model;
* return async handles for overlap, including for ops the backend lacks;
* apply its timeout when waiting (and the topology gives the same timeout to
  the process groups it creates);
* hide gloo/NCCL differences (gloo has no ``AVG`` reduction).

A group of size one never communicates and moves zero bytes.

Other modules touch ``torch.distributed`` only to set the process groups up,
never to move training data:

* the modules ``hybrid.comm_*`` and :mod:`hybrid.p2p_collectives` are part of
  this module, one job each: :mod:`hybrid.comm_p2p` runs the reduce-scatters
  and all-gathers it sends as point-to-point messages on gloo (their message
  algorithms are :mod:`hybrid.p2p_collectives`), :mod:`hybrid.comm_compressed`
  the quantized exchanges, :mod:`hybrid.comm_two_level` the reductions inside
  the node then across nodes, :mod:`hybrid.comm_accounting` the byte and
  blocked-time accounting, :mod:`hybrid.comm_tensors` the tensor helpers;
  :mod:`hybrid.comm_handle` holds what an operation returns and raises (its
  handle, its name in errors), which this module re-exports;
* :mod:`hybrid.distributed` creates and destroys the default (world) group;
* :mod:`hybrid.topology` reads the world's rank, size and backend and creates
  the per-axis groups (``new_group`` is itself collective over the world);
* :mod:`hybrid.data.index_cache`, when its caller passes no rank and barrier
  (the trainer passes ``topology.rank`` and ``topology.comm.barrier``), reads
  the world rank and issues one world barrier so that standalone users of the
  datasets share one index cache; ``hybrid.data`` depends on no other part of
  hybrid, so it does not build a Topology for that.
"""

from __future__ import annotations

import datetime
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hybrid import comm_compressed, comm_two_level
from hybrid.comm_accounting import RING_WIRE_FACTOR, Traffic
from hybrid.comm_handle import CollectiveError, Guard, Handle, OpName  # importers read them here too
from hybrid.comm_p2p import PointToPointCollectives
from hybrid.comm_tensors import nbytes as _nbytes
from hybrid.comm_tensors import untracked as _untracked
from hybrid.compile_marks import eager
from hybrid.compression import Quantization
from hybrid.group_table import AliasedGroups, AxisGroups

# A collective is a gloo/NCCL call with byte accounting and a timed wait that torch.compile cannot trace: a compiled
# region (model_zoo.compile) runs each method marked @eager as one graph break, nothing beneath it traced.

# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
}


class Communicator:
    """Axis-addressed collectives over the process groups of ``groups`` (a topology's
    :class:`~hybrid.group_table.GroupTable`, or anything with its :class:`~hybrid.group_table.AxisGroups`
    queries)."""

    def __init__(self, groups: AxisGroups, timeout_s: Optional[float] = None):
        self._groups = groups
        self._timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self._traffic = Traffic(groups)
        # Async operations launched and not yet waited for, so that teardown can wait for them first.
        self._in_flight: Dict[int, Handle] = {}
        self._messages = PointToPointCollectives(groups, self)
        self._names: Dict[Tuple[str, str], OpName] = {}
        self._peers: Dict[Tuple[str, int], int] = {}  # (axis, group rank) -> global rank, checked once per peer
        self._real_axis: Callable[[str], str] = str  # the axis that answers for an aliased one (aliased())

    def aliased(self, groups: "AliasedGroups") -> "Communicator":
        """This communicator over ``groups``, an :class:`~hybrid.group_table.AliasedGroups` of its own: the same
        byte counts, waits and in-flight operations, with each aliased axis answered (and counted) by its real
        one. :meth:`hybrid.topology.Topology.expert_data_view` makes its communicator so."""
        view = Communicator.__new__(Communicator)
        view.__dict__.update(self.__dict__)
        view._groups = groups
        view._messages = PointToPointCollectives(groups, view)
        view._names, view._peers = {}, {}
        view._real_axis = groups.real_axis
        return view

    @property
    def timeout(self) -> Optional[datetime.timedelta]:
        """How long any operation may wait (None: the process group's own timeout)."""
        return self._timeout

    # ---- accounting (hybrid.comm_accounting) ------------------------------------------------
    def reset_stats(self) -> None:
        self._traffic.reset()

    def report(self) -> Dict[str, Dict[str, float]]:
        """Bytes moved since the last :meth:`reset_stats`, keyed ``"op/axis"``: ``calls``, ``payload_bytes``,
        ``wire_bytes`` and ``inter_node_bytes`` (the model: :meth:`hybrid.comm_accounting.Traffic.report`)."""
        return self._traffic.report()

    def blocked_seconds(self) -> float:
        """Seconds this rank's thread has spent waiting for communication since the communicator was made.

        Blocking collectives count whole; async ones count the time spent in
        :meth:`Handle.wait`. This is the communication that compute did not
        hide (the "exposed" part of a step).
        """
        return self._traffic.blocked_seconds()

    def inter_node_total(self) -> float:
        """Bytes this rank has sent off its node since the communicator was made (never reset)."""
        return self._traffic.inter_node_total()

    def _record(self, op: str, axis: str, nbytes: int, wire_factor: float, peer: Optional[int] = None,
                fan_out: Optional[List[int]] = None, each: Optional[int] = None,
                sends: Optional[Dict[int, int]] = None) -> None:
        """Count one operation (:meth:`hybrid.comm_accounting.Traffic.record`)."""
        self._traffic.record(op, self._real_axis(axis), nbytes, wire_factor, peer, fan_out, each, sends)

    def record_traced(self, op: str, axis: str, nbytes: int) -> None:
        """Count an ``all_reduce``, ``all_gather`` or ``reduce_scatter`` of ``nbytes`` payload over ``axis`` that a
        compiled region ran as a functional collective (:mod:`hybrid.tensor_parallel.traceable`), as this
        communicator counts its own; not timed (``blocked_seconds`` leaves it out)."""
        self._record(op, axis, nbytes, RING_WIRE_FACTOR[op](self.size(axis)))

    def backend(self, axis: str) -> Optional[str]:
        """The backend of ``axis``'s group (``"gloo"``, ``"nccl"``), or None without a process group."""
        return dist.get_backend(self._group(axis)) if dist.is_available() and dist.is_initialized() else None

    # ---- helpers ----------------------------------------------------------------
    def size(self, axis: str) -> int:
        return self._groups.size(axis)

    def _group(self, axis: str):
        return self._groups.group(axis)

    def _name(self, op: str, axis: str) -> OpName:
        key = (op, axis)
        name = self._names.get(key)
        if name is None:  # the same few names on every step: made once
            name = self._names[key] = OpName(op, self._real_axis(axis), tuple(self._groups.group_ranks(axis)))
        return name

    def _guard(self, name: OpName) -> Guard:
        """Around every wait: count the time blocked, and name the operation in a backend error."""
        return Guard(name, self._timeout, self._traffic.add_blocked)

    def _launch(self, op: str, axis: str, fn, async_op: bool, finish: Optional[Callable[[], None]] = None):
        self._messages.advance()
        name = self._name(op, axis)
        with self._guard(name):
            work = fn(async_op)
            if not async_op and finish is not None:
                finish()
        if not async_op:
            return None
        return self._track(Handle(work, finish, self._timeout, lambda: self._guard(name), self._untrack))

    def _track(self, handle: Handle) -> Handle:
        self._in_flight[id(handle)] = handle
        return handle

    def _untrack(self, handle: Handle) -> None:
        self._in_flight.pop(id(handle), None)

    def abandon(self, handles: List[Handle]) -> None:
        """Stop tracking ``handles`` without waiting: after an operation failed (a peer is gone or stuck), their
        peers will not complete them, and :meth:`drain` would spend a whole timeout on each."""
        for handle in handles:
            self._untrack(handle)

    def drain(self) -> None:
        """Wait for every async operation launched and not yet waited for (teardown calls this first).

        Each wait is bounded by the timeout; the first failure is raised after the rest were waited for.
        """
        first: Optional[BaseException] = None
        for handle in list(self._in_flight.values()):
            try:
                handle.wait()
            except CollectiveError as e:
                first = first or e
                self._untrack(handle)
        if first is not None:
            raise first

    # ---- collectives ------------------------------------------------------------
    @eager
    def all_reduce(self, tensor: torch.Tensor, axis: str, op: str = "sum",
                   async_op: bool = False, quant: Optional[Quantization] = None,
                   two_level: bool = False) -> Optional[Handle]:
        """In-place all-reduce of ``tensor`` (any shape) over the ``axis`` group.

        With ``quant`` it is a quantized reduce-scatter of ``n`` equal chunks
        (zero-padded) followed by a quantized all-gather of the summed chunks,
        so every rank ends with the same dequantized sum. ``two_level``: see
        :func:`hybrid.comm_two_level.all_reduce`.
        """
        n = self.size(axis)
        if n == 1:
            return Handle() if async_op else None
        tensor = _untracked(tensor)
        if two_level and comm_two_level.splits_over_nodes(self, axis):
            return comm_two_level.all_reduce(self, tensor, op, quant, async_op)
        if quant is not None:
            return comm_compressed.all_reduce(self, tensor, axis, op, quant, async_op)
        self._record("all_reduce", axis, _nbytes(tensor), RING_WIRE_FACTOR["all_reduce"](n))
        finish = (lambda: tensor.div_(n)) if op == "avg" else None
        return self._launch("all_reduce", axis, lambda a: dist.all_reduce(tensor, op=_REDUCE_OPS[op],
                                                                          group=self._group(axis), async_op=a),
                            async_op, finish)

    @eager
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                               async_op: bool = False, quant: Optional[Quantization] = None) -> Optional[Handle]:
        """Gather ``input`` [k, ...] from every rank of ``axis`` into ``output`` [n*k, ...], in group-rank order.

        gloo needs ``output`` flat along dim 0 (not shaped [n, k, ...]). With
        ``quant``, every rank sends its chunk packed (:mod:`hybrid.kernels.quantize`)
        and ``output`` receives every chunk dequantized, this rank's own
        included, so all ranks hold the same values.
        """
        n = self.size(axis)
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather_into_tensor over {axis}: output has {output.numel()} "
                             f"elements, expected {n} x {input.numel()}")
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view_as(output))
            return Handle() if async_op else None
        output, input = _untracked(output), _untracked(input)
        if quant is not None:
            return comm_compressed.all_gather(self, output, input, axis, quant, async_op)
        self._record("all_gather", axis, _nbytes(output), RING_WIRE_FACTOR["all_gather"](n))
        return self._gather_flat(output, input, axis, async_op)

    def _gather_flat(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                     finish: Optional[Callable[[], None]] = None) -> Optional[Handle]:
        """The all-gather of flat ``input`` [k] into ``output`` [n*k] (not counted here): direct messages where
        :meth:`_p2p` says so, else the backend's own."""
        if self._p2p(axis) == "direct":
            return self._messages.all_gather(output, input, axis, async_op, finish)
        return self._launch("all_gather", axis, lambda a: _all_gather_flat(
            output, input, group=self._group(axis), async_op=a), async_op, finish)

    def _p2p(self, axis: str) -> Optional[str]:
        """How this communicator runs ``axis``'s reduce-scatters and all-gathers itself: ``"direct"``, ``"ring"``
        or None (the backend's own collectives; :meth:`hybrid.comm_p2p.PointToPointCollectives.shape`)."""
        return self._messages.shape(axis)

    @eager
    def reduce_scatter_tensor(self, output: torch.Tensor, input: Union[torch.Tensor, Sequence[torch.Tensor]],
                              axis: str, op: str = "sum", async_op: bool = False,
                              quant: Optional[Quantization] = None, two_level: bool = False) -> Optional[Handle]:
        """Reduce ``input`` [n*k] over ``axis`` and keep this rank's chunk in ``output`` [k].

        ``input`` may also be a list of segments ``s_j`` [n*k_j] (``k = sum
        k_j``), reduced as if interleaved chunk by chunk, ``[s_0 chunk 0, s_1
        chunk 0, .. | s_0 chunk 1, ..]``: this rank keeps ``[s_0 chunk r, s_1
        chunk r, ..]``. The ring (gloo) reads them in place; the other paths
        build the interleaved tensor first. With ``quant``, chunk ``i`` of
        ``input`` is packed and sent to rank ``i`` by one all-to-all; each
        rank dequantizes the ``n`` copies of its chunk and adds them in fp32,
        in group-rank order. ``two_level`` (axis ``dp`` only, after
        :meth:`~hybrid.topology.Topology.enable_node_axes`): first inside the
        node, then across nodes (:func:`hybrid.comm_two_level.reduce_scatter`).
        """
        n = self.size(axis)
        output = _untracked(output)
        if not isinstance(input, torch.Tensor):
            segments = [_untracked(s).view(-1) for s in input]
            total = sum(s.numel() for s in segments)
            if total != n * output.numel() or any(s.numel() % n for s in segments):
                raise ValueError(f"reduce_scatter_tensor over {axis}: segments of {[s.numel() for s in segments]} "
                                 f"elements, expected multiples of {n} adding up to {n} x {output.numel()}")
            splits = two_level and comm_two_level.splits_over_nodes(self, axis)
            if len(segments) > 1 and n > 1 and quant is None and not splits and self._p2p(axis):
                self._record("reduce_scatter", axis, total * segments[0].element_size(),
                             RING_WIRE_FACTOR["reduce_scatter"](n))
                return self._messages.reduce_scatter(output, segments, axis, op, async_op)
            input = segments[0] if len(segments) == 1 else torch.cat([s.view(n, -1) for s in segments], 1).view(-1)
        input = _untracked(input)
        if two_level and comm_two_level.splits_over_nodes(self, axis):
            return comm_two_level.reduce_scatter(self, output, input, op, quant, async_op)
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter_tensor over {axis}: input has {input.numel()} "
                             f"elements, expected {n} x {output.numel()}")
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view_as(output))
            return Handle() if async_op else None
        if quant is not None:
            return comm_compressed.reduce_scatter(self, output, input, axis, op, quant, async_op)
        self._record("reduce_scatter", axis, _nbytes(input), RING_WIRE_FACTOR["reduce_scatter"](n))
        if self._p2p(axis):
            return self._messages.reduce_scatter(output, input, axis, op, async_op)
        finish = (lambda: output.div_(n)) if op == "avg" else None
        return self._launch("reduce_scatter", axis, lambda a: _reduce_scatter_flat(
            output, input, op=_REDUCE_OPS[op], group=self._group(axis), async_op=a),
            async_op, finish)

    @eager
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                          async_op: bool = False) -> Optional[Handle]:
        """Row ``i`` of ``input`` [n, ...] goes to rank ``i`` of ``axis``; row ``i`` of ``output`` (same shape)
        comes from rank ``i`` (this rank's own row is copied)."""
        n = self.size(axis)
        if input.shape != output.shape or input.shape[0] != n:
            raise ValueError(f"all_to_all_single over {axis}: input {tuple(input.shape)} and output "
                             f"{tuple(output.shape)} must both have {n} rows")
        if n == 1:
            output.copy_(input)
            return Handle() if async_op else None
        return self._all_to_all("all_to_all", _untracked(output), _untracked(input), axis, async_op, None)

    @eager
    def all_to_all_v(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                     input_splits: Sequence[int], axis: str, async_op: bool = False,
                     op: str = "all_to_all_v") -> Optional[Handle]:
        """An all-to-all with variable splits along dim 0: ``input_splits[i]`` rows of ``input`` (in order) go to
        rank ``i`` of ``axis``, and ``output_splits[i]`` rows of ``output`` come from it (this rank's own are
        copied). Counted as ``op`` with the bytes each peer receives (what the MoE token dispatch moves)."""
        n = self.size(axis)
        if len(input_splits) != n or len(output_splits) != n or sum(input_splits) != input.shape[0] or \
                sum(output_splits) != output.shape[0] or input.shape[1:] != output.shape[1:]:
            raise ValueError(f"all_to_all_v over {axis}: splits {list(input_splits)} -> {list(output_splits)} do "
                             f"not cut input {tuple(input.shape)} and output {tuple(output.shape)} into {n} parts")
        if n == 1:
            output.copy_(input)
            return Handle() if async_op else None
        row = _nbytes(input) // max(1, input.shape[0]) if input.shape[0] else input[0:1].numel() * input.element_size()
        ranks = self._groups.group_ranks(axis)
        self._record(op, axis, _nbytes(input), 0.0, sends={r: k * row for r, k in zip(ranks, input_splits)})
        out_s, in_s = [int(k) for k in output_splits], [int(k) for k in input_splits]
        return self._launch(op, axis, lambda a: dist.all_to_all_single(
            _untracked(output), _untracked(input), output_split_sizes=out_s, input_split_sizes=in_s,
            group=self._group(axis), async_op=a), async_op)

    def _all_to_all(self, op: str, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                    finish: Optional[Callable[[], None]]) -> Optional[Handle]:
        """One all-to-all of ``input`` [n, ...] rows, counted as ``op``: every peer receives its row straight
        from this rank."""
        n, me = self.size(axis), self._groups.rank
        self._record(op, axis, _nbytes(input), (n - 1) / n,
                     fan_out=[r for r in self._groups.group_ranks(axis) if r != me], each=_nbytes(input[0]))
        return self._launch(op, axis, lambda a: dist.all_to_all_single(
            output, input, group=self._group(axis), async_op=a), async_op, finish)

    def _then(self, rest: Callable[[], None], async_op: bool) -> Optional[Handle]:
        """The second half of a composite operation: run now, or when the returned handle is waited for."""
        if not async_op:
            rest()
            return None
        return self._track(Handle(None, rest, self._timeout, None, self._untrack))

    @eager
    def all_gather(self, tensors: List[torch.Tensor], input: torch.Tensor, axis: str) -> None:
        """Gather equally shaped ``input`` from every rank of ``axis`` into the list ``tensors``."""
        n = self.size(axis)
        if n == 1:
            tensors[0].copy_(input)
            return
        self._record("all_gather", axis, _nbytes(input) * n, RING_WIRE_FACTOR["all_gather"](n))
        with self._guard(self._name("all_gather", axis)):
            dist.all_gather([_untracked(t) for t in tensors], _untracked(input), group=self._group(axis))

    @eager
    def broadcast(self, tensor: torch.Tensor, axis: str, src: int = 0) -> None:
        """Broadcast ``tensor`` from group rank ``src`` of ``axis`` to the rest of the group."""
        n = self.size(axis)
        if n == 1:
            return
        ranks = self._groups.group_ranks(axis)
        src_global = ranks[src]
        # gloo's broadcast sends from the root to every other rank directly.
        self._record("broadcast", axis, _nbytes(tensor), 1.0,
                     fan_out=[r for r in ranks if r != src_global] if self._groups.rank == src_global else [])
        with self._guard(self._name("broadcast", axis)):
            dist.broadcast(_untracked(tensor), src=src_global, group=self._group(axis))

    def all_gather_object(self, obj, axis: str = "world") -> list:
        """Gather a picklable Python object from every rank of ``axis`` (small metadata only)."""
        n = self.size(axis)
        if n == 1:
            return [obj]
        out: list = [None] * n
        with self._guard(self._name("all_gather_object", axis)):
            dist.all_gather_object(out, obj, group=self._group(axis))
        return out

    def barrier(self, axis: str = "world") -> None:
        if self.size(axis) == 1:
            return
        with self._guard(self._name("barrier", axis)):
            dist.barrier(group=self._group(axis))

    # ---- point to point ---------------------------------------------------------
    @eager
    def send(self, tensor: torch.Tensor, axis: str, dst: int, async_op: bool = False,
             tag: int = 0) -> Optional[Handle]:
        """Send ``tensor`` to rank ``dst`` of this rank's ``axis`` group (e.g. ``pp_rank + 1``, the next stage).

        The peer must post the matching :meth:`recv` of a tensor of the same size and dtype. Transfers between
        two ranks are matched in the order they are posted, separately for each ``tag`` (gloo honours tags;
        NCCL ignores them, so there one pair of ranks carries one stream only).
        """
        return self._point_to_point("send", dist.isend, tensor, axis, dst, async_op, tag)

    @eager
    def recv(self, tensor: torch.Tensor, axis: str, src: int, async_op: bool = False,
             tag: int = 0) -> Optional[Handle]:
        """Receive into ``tensor`` from rank ``src`` of this rank's ``axis`` group (e.g. ``pp_rank - 1``)."""
        return self._point_to_point("recv", dist.irecv, tensor, axis, src, async_op, tag)

    def _point_to_point(self, op: str, issue, tensor: torch.Tensor, axis: str, rank: int,
                        async_op: bool, tag: int) -> Optional[Handle]:
        # Always issued as isend/irecv: the blocking forms cannot take this communicator's timeout.
        peer = self._peers.get((axis, rank))
        if peer is None:  # a pipeline stage talks to the same one or two peers all along
            peer = self._peers[(axis, rank)] = self._peer(axis, rank, "send to" if op == "send" else "receive from")
        name = self._name(f"{op} {'to' if op == 'send' else 'from'} rank {rank}", axis)
        # The sender counts the wire bytes, so summing over ranks counts each byte once.
        self._record(op, axis, _nbytes(tensor), 1.0 if op == "send" else 0.0, peer=peer)
        self._messages.advance()
        with self._guard(name):
            work = issue(_untracked(tensor), peer, group=self._group(axis), tag=tag)
        handle = Handle(work, None, self._timeout, lambda: self._guard(name), self._untrack)
        if async_op:
            return self._track(handle)
        handle.wait()
        return None

    def _peer(self, axis: str, rank: int, verb: str) -> int:
        """The global rank of group rank ``rank`` of ``axis``, which must be another rank than this one."""
        n, me = self.size(axis), self._groups.rank_in(axis)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < n or rank == me:
            raise ValueError(f"cannot {verb} rank {rank!r} of the {axis} group: the peer must be another rank of "
                             f"that group, in [0, {n}) and not this rank's own {me}")
        return self._groups.group_ranks(axis)[rank]
