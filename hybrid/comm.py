"""Axis-addressed communication: every collective and point-to-point transfer of the library.

Every collective, and the point-to-point traffic between pipeline stages, goes
through a :class:`Communicator` owned by the :class:`~hybrid.topology.Topology`.
Operations are addressed by *axis* (``"tp"``, ``"dp"``, ``"pp"``, ``"mp"``,
``"world"``) and peers by their rank within the axis group, rather than by raw
process group and global rank, which lets this module:

* count the bytes each operation moved (:meth:`Communicator.report`), both
  as payload (the tensor sizes) and as wire bytes under a ring model;
* return async handles for overlap, including for ops the backend lacks;
* apply its timeout when waiting (and :class:`~hybrid.topology.Topology`
  gives the same timeout to the process groups it creates);
* hide gloo/NCCL differences (gloo has no ``AVG`` reduction).

A group of size one never communicates and moves zero bytes.

Other modules touch ``torch.distributed`` only to set the process groups up,
never to move training data:

* :mod:`hybrid.p2p_collectives` is part of this module: the reduce-scatters
  and all-gathers it runs on gloo as point-to-point messages;
* :mod:`hybrid.comm_handle` holds what an operation returns and raises (its
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

import collections
import dataclasses
import datetime
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hybrid.comm_handle import CollectiveError, Guard, Handle, OpName  # importers read them here too
from hybrid.compression import Quantization
from hybrid.kernels import quantize as _quant
from hybrid.p2p_collectives import DirectReduceScatter, RingReduceScatter, direct_all_gather, direct_tags, ring_tag

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

# torch 2.13 renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
}


@dataclasses.dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    inter_node_bytes: float = 0.0


# Backends whose own reduce-scatter and all-gather cost more than point-to-point messages (gloo's
# reduce-scatter sends an all-reduce's bytes, its all-gather lands in a temporary; benchmarks/p2p_collectives.py):
# the communicator sends the messages itself there (hybrid.p2p_collectives), directly inside a node, the
# reduce-scatter as a ring across nodes.
_P2P_COLLECTIVE_BACKENDS = {"gloo"}


class Communicator:
    """Axis-addressed collectives over a :class:`~hybrid.topology.Topology`'s groups."""

    def __init__(self, topology: "Topology", timeout_s: Optional[float] = None):
        self._topology = topology
        self._timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self._stats: Dict[Tuple[str, str], OpStats] = collections.defaultdict(OpStats)
        # Async operations launched and not yet waited for, so that teardown can wait for them first.
        self._in_flight: Dict[int, Handle] = {}
        self._inter_node_sent = 0.0
        self._blocked_s = 0.0
        # Rings of point-to-point messages still running, advanced whenever this rank communicates.
        self._rings: List[RingReduceScatter] = []
        # Collectives built from point-to-point messages (rings, direct gathers), numbered per axis in issue
        # order, which is the same on every rank: their messages' tags, so that those in flight together
        # never take each other's messages.
        self._p2p_sequence: Dict[str, int] = collections.defaultdict(int)
        self._p2p_shape: Dict[str, Optional[str]] = {}  # _p2p's answer per axis
        self._names: Dict[Tuple[str, str], OpName] = {}
        self._peers: Dict[Tuple[str, int], int] = {}  # (axis, group rank) -> global rank, checked once per peer

    @property
    def timeout(self) -> Optional[datetime.timedelta]:
        """How long any operation may wait (None: the process group's own timeout)."""
        return self._timeout

    # ---- accounting ------------------------------------------------------------
    def reset_stats(self) -> None:
        self._stats.clear()

    def report(self) -> Dict[str, Dict[str, float]]:
        """Bytes moved since the last :meth:`reset_stats`, keyed ``"op/axis"``.

        ``payload_bytes`` is the size of the buffer each call reduced or gathered
        (the full buffer, not this rank's share). ``wire_bytes`` is what one
        rank sends under a ring algorithm: ``2(n-1)/n`` of the buffer for
        all-reduce and ``(n-1)/n`` for reduce-scatter and all-gather. Under that
        model an all-reduce costs the same as a reduce-scatter plus an all-gather.
        A point-to-point ``send`` puts its whole tensor on the wire; the matching
        ``recv`` counts the payload it received and no wire bytes (the sender
        counts them), so summing wire bytes over ranks counts each byte once.

        ``inter_node_bytes`` is the part of what this rank sends that leaves
        its node (:class:`~hybrid.topology.Nodes`), as the backend moves it. The
        model: a collective is a ring in group-rank order, each rank sending to
        the next (the last to the first), so its bytes cross when the next rank
        sits on another node; a broadcast's root sends the buffer to every other
        rank; a ``send`` crosses when its peer does. A quantized reduce-scatter
        is an all-to-all: each peer receives its packed chunk straight from this
        rank, so it crosses once per peer on another node (a quantized
        all-reduce is counted as that reduce-scatter plus a ring all-gather). Summed over a node's ranks it is what the node's link carries.
        """
        return {f"{op}/{axis}": dataclasses.asdict(s) for (op, axis), s in sorted(self._stats.items())}

    def blocked_seconds(self) -> float:
        """Seconds this rank's thread has spent waiting for communication since the communicator was made.

        Blocking collectives count whole; async ones count the time spent in
        :meth:`Handle.wait`. This is the communication that compute did not
        hide (the "exposed" part of a step).
        """
        return self._blocked_s

    def inter_node_total(self) -> float:
        """Bytes this rank has sent off its node since the communicator was made (never reset)."""
        return self._inter_node_sent

    def _record(self, op: str, axis: str, nbytes: int, wire_factor: float, peer: Optional[int] = None,
                fan_out: Optional[List[int]] = None, each: Optional[int] = None) -> None:
        """Count one operation. ``peer``: the global rank a point-to-point transfer goes to; ``fan_out``: the
        global ranks that each receive ``each`` bytes (default ``nbytes``) straight from this rank (a
        broadcast's root, every peer of an all-to-all)."""
        s = self._stats[(op, axis)]
        s.calls += 1
        s.payload_bytes += nbytes
        s.wire_bytes += nbytes * wire_factor
        nodes, me = self._topology.nodes, self._topology.rank
        if fan_out is not None:
            crossing = (nbytes if each is None else each) * sum(nodes.node_of(r) != nodes.node_of(me)
                                                                for r in fan_out)
        elif peer is not None:
            crossing = nbytes * wire_factor if nodes.node_of(peer) != nodes.node_of(me) else 0.0
        else:
            crossing = nbytes * wire_factor if nodes.ring_hop_crosses(self._topology.group_ranks(axis), me) else 0.0
        s.inter_node_bytes += crossing
        self._inter_node_sent += crossing

    def backend(self, axis: str) -> Optional[str]:
        """The backend of ``axis``'s group (``"gloo"``, ``"nccl"``), or None without a process group."""
        return dist.get_backend(self._group(axis)) if dist.is_available() and dist.is_initialized() else None

    # ---- helpers ----------------------------------------------------------------
    def size(self, axis: str) -> int:
        return self._topology.size(axis)

    def _group(self, axis: str):
        return self._topology.group(axis)

    def _name(self, op: str, axis: str) -> OpName:
        key = (op, axis)
        name = self._names.get(key)
        if name is None:  # the same few names on every step: made once
            name = self._names[key] = OpName(op, axis, tuple(self._topology.group_ranks(axis)))
        return name

    def _guard(self, name: OpName) -> Guard:
        """Around every wait: count the time blocked, and name the operation in a backend error."""
        return Guard(name, self._timeout, self._add_blocked)

    def _add_blocked(self, seconds: float) -> None:
        self._blocked_s += seconds

    def _launch(self, op: str, axis: str, fn, async_op: bool, finish: Optional[Callable[[], None]] = None):
        self._advance_rings()
        name = self._name(op, axis)
        with self._guard(name):
            work = fn(async_op)
            if not async_op and finish is not None:
                finish()
        if not async_op:
            return None
        return self._track(Handle(work, finish, self._timeout, lambda: self._guard(name), self._untrack))

    def _advance_rings(self) -> None:
        """Move every ring in flight on as far as its messages have arrived, without blocking."""
        if self._rings:
            self._rings = [ring for ring in self._rings if not ring.advance(block=False)]

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
    def all_reduce(self, tensor: torch.Tensor, axis: str, op: str = "sum",
                   async_op: bool = False, quant: Optional[Quantization] = None,
                   two_level: bool = False) -> Optional[Handle]:
        """In-place all-reduce of ``tensor`` (any shape) over the ``axis`` group.

        With ``quant`` it is a quantized reduce-scatter of ``n`` equal chunks
        (zero-padded) followed by a quantized all-gather of the summed chunks,
        so every rank ends with the same dequantized sum. ``two_level``: see
        :meth:`_two_level_all_reduce`.
        """
        n = self.size(axis)
        if n == 1:
            return Handle() if async_op else None
        tensor = _untracked(tensor)
        if two_level and self._splits_over_nodes(axis):
            return self._two_level_all_reduce(tensor, op, quant, async_op)
        if quant is not None:
            return self._quantized_all_reduce(tensor, axis, op, quant, async_op)
        self._record("all_reduce", axis, _nbytes(tensor), 2.0 * (n - 1) / n)
        finish = (lambda: tensor.div_(n)) if op == "avg" else None
        return self._launch("all_reduce", axis, lambda a: dist.all_reduce(tensor, op=_REDUCE_OPS[op],
                                                                          group=self._group(axis), async_op=a),
                            async_op, finish)

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
            return self._quantized_all_gather(output, input, axis, quant, async_op)
        self._record("all_gather", axis, _nbytes(output), (n - 1) / n)
        return self._gather_flat(output, input, axis, async_op)

    def _gather_flat(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                     finish: Optional[Callable[[], None]] = None) -> Optional[Handle]:
        """The all-gather of flat ``input`` [k] into ``output`` [n*k] (not counted here): direct messages where
        :meth:`_p2p` says so, else the backend's own."""
        if self._p2p(axis) == "direct":
            ranks, me = list(self._topology.group_ranks(axis)), self._topology.rank_in(axis)
            tag = ring_tag(self._next_p2p(axis), 0, self.size(axis) - 1)
            return self._launch("all_gather", axis, lambda a: self._maybe_wait(direct_all_gather(
                output, input, self._group(axis), ranks, me, tag, self._timeout), a), async_op, finish)
        return self._launch("all_gather", axis, lambda a: _all_gather_flat(
            output, input, group=self._group(axis), async_op=a), async_op, finish)

    def _p2p(self, axis: str) -> Optional[str]:
        """How this communicator runs ``axis``'s reduce-scatters and all-gathers itself: ``"direct"`` (its group
        inside one node), ``"ring"`` (across nodes), or None (the backend's own collectives)."""
        if axis in self._p2p_shape:  # fixed once the groups exist; asked on every reduce-scatter and gather
            return self._p2p_shape[axis]
        backend = self.backend(axis)
        if backend not in _P2P_COLLECTIVE_BACKENDS:
            shape = None
        else:
            shape = "ring" if self._topology.nodes.spans_nodes(self._topology.group_ranks(axis)) else "direct"
        if backend is not None:
            self._p2p_shape[axis] = shape
        return shape

    def _next_p2p(self, axis: str, count: int = 1) -> int:
        """The next ``count`` sequence numbers of ``axis``'s point-to-point collectives (their tags)."""
        sequence = self._p2p_sequence[axis]
        self._p2p_sequence[axis] += count
        return sequence

    @staticmethod
    def _maybe_wait(works, async_op: bool):
        if async_op:
            return works
        works.wait()
        return None

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
        node, then across nodes (:meth:`_two_level_reduce_scatter`).
        """
        n = self.size(axis)
        output = _untracked(output)
        if not isinstance(input, torch.Tensor):
            segments = [_untracked(s).view(-1) for s in input]
            total = sum(s.numel() for s in segments)
            if total != n * output.numel() or any(s.numel() % n for s in segments):
                raise ValueError(f"reduce_scatter_tensor over {axis}: segments of {[s.numel() for s in segments]} "
                                 f"elements, expected multiples of {n} adding up to {n} x {output.numel()}")
            splits = two_level and self._splits_over_nodes(axis)
            if len(segments) > 1 and n > 1 and quant is None and not splits and self._p2p(axis):
                self._record("reduce_scatter", axis, total * segments[0].element_size(), (n - 1) / n)
                return self._p2p_reduce_scatter(output, segments, axis, op, async_op)
            input = segments[0] if len(segments) == 1 else torch.cat([s.view(n, -1) for s in segments], 1).view(-1)
        input = _untracked(input)
        if two_level and self._splits_over_nodes(axis):
            return self._two_level_reduce_scatter(output, input, op, quant, async_op)
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter_tensor over {axis}: input has {input.numel()} "
                             f"elements, expected {n} x {output.numel()}")
        if n == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input.view_as(output))
            return Handle() if async_op else None
        if quant is not None:
            return self._quantized_reduce_scatter(output, input, axis, op, quant, async_op)
        self._record("reduce_scatter", axis, _nbytes(input), (n - 1) / n)
        if self._p2p(axis):
            return self._p2p_reduce_scatter(output, input, axis, op, async_op)
        finish = (lambda: output.div_(n)) if op == "avg" else None
        return self._launch("reduce_scatter", axis, lambda a: _reduce_scatter_flat(
            output, input, op=_REDUCE_OPS[op], group=self._group(axis), async_op=a),
            async_op, finish)

    def _p2p_reduce_scatter(self, output: torch.Tensor, input: Union[torch.Tensor, List[torch.Tensor]], axis: str,
                            op: str, async_op: bool) -> Optional[Handle]:
        """A reduce-scatter over ``axis`` (of a tensor or segments) as point-to-point messages
        (:mod:`hybrid.p2p_collectives`, :meth:`_p2p` picks the shape): ``(n-1)/n`` of ``input`` sent per rank."""
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter_tensor over {axis}: op {op!r} is not supported on this backend "
                             f"(sum or avg)")
        self._advance_rings()
        name = self._name("reduce_scatter", axis)
        n, group, me = self.size(axis), self._group(axis), self._topology.rank_in(axis)
        ranks, divide_by = list(self._topology.group_ranks(axis)), (n if op == "avg" else None)
        if self._p2p(axis) == "direct":
            pieces = 1 if isinstance(input, torch.Tensor) else len(input)
            sequence = self._next_p2p(axis, direct_tags(n, pieces))
            with self._guard(name):
                direct = DirectReduceScatter(output, input, group, ranks, me, sequence, self._timeout, divide_by)
            handle = Handle(direct.waits, direct.finish, self._timeout, lambda: self._guard(name), self._untrack)
            if not async_op:
                handle.wait()
                return None
            return self._track(handle)
        sequence = self._next_p2p(axis)
        with self._guard(name):
            ring = RingReduceScatter(output, input, group, ranks, me, sequence, self._timeout,
                                     lambda: self._guard(name), divide_by=divide_by)
        if not async_op:
            ring.finish()
            return None
        self._rings.append(ring)
        return self._track(Handle(None, ring.finish, self._timeout, None, self._untrack))

    def _quantized_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: str, op: str,
                                  quant: Quantization, async_op: bool) -> Optional[Handle]:
        """All-to-all of ``input`` [n*k] packed per chunk ([n, W] bytes), then an fp32 sum at the receiver."""
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter_tensor over {axis}: op {op!r} cannot be quantized (sum or avg)")
        n, k = self.size(axis), output.numel()
        wire = _quant.pack(input.reshape(n, k), quant.bits, quant.block)
        received = torch.empty_like(wire)

        def finish() -> None:
            _quant.unpack_sum(received, k, quant.bits, quant.block, out=output.view(-1))
            if op == "avg":
                output.div_(n)
        return self._all_to_all("reduce_scatter", received, wire, axis, async_op, finish)

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

    def _all_to_all(self, op: str, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                    finish: Optional[Callable[[], None]]) -> Optional[Handle]:
        """One all-to-all of ``input`` [n, ...] rows, counted as ``op``: every peer receives its row straight
        from this rank."""
        n, me = self.size(axis), self._topology.rank
        self._record(op, axis, _nbytes(input), (n - 1) / n,
                     fan_out=[r for r in self._topology.group_ranks(axis) if r != me], each=_nbytes(input[0]))
        return self._launch(op, axis, lambda a: dist.all_to_all_single(
            output, input, group=self._group(axis), async_op=a), async_op, finish)

    def _then(self, rest: Callable[[], None], async_op: bool) -> Optional[Handle]:
        """The second half of a composite operation: run now, or when the returned handle is waited for."""
        if not async_op:
            rest()
            return None
        return self._track(Handle(None, rest, self._timeout, None, self._untrack))

    # ---- two levels: inside the node, then across nodes ----------------------------------------------
    def _splits_over_nodes(self, axis: str) -> bool:
        """Whether a two-level collective over ``axis`` has two levels here (``dp`` with ranks on several
        nodes and several on each node); otherwise the flat collective is the same thing."""
        if axis != "dp":
            raise ValueError(f"a two-level collective runs over 'dp' only, not {axis!r}")
        return self.size("dp_node") > 1 and self.size("dp_cross") > 1

    def _two_level_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str,
                                  quant: Optional[Quantization], async_op: bool) -> Optional[Handle]:
        """Reduce-scatter over ``dp`` as a reduce-scatter inside the node, then one across nodes.

        ``dp`` rank ``i*l + j`` is rank ``j`` of node ``i`` (``l`` ranks per node,
        ``m`` nodes; :meth:`hybrid.topology.Nodes.split`). ``input`` [m*l*c] is
        reordered to [l, m, c] so that the ``dp_node`` reduce-scatter leaves
        node rank ``j`` the node's sum of chunks ``i*l + j`` for every ``i``
        ([m*c]); the ``dp_cross`` reduce-scatter over the ``m`` ranks at
        position ``j`` then leaves each its own chunk [c]. Only that second
        step, ``(m-1)/m`` of ``m*c`` per rank, leaves the node, and only it is
        quantized (``quant``): the node's own link is fast, so compressing
        there would add error and save little.
        """
        l, m, c = self.size("dp_node"), self.size("dp_cross"), output.numel()
        staged = input.reshape(m, l, c).transpose(0, 1).contiguous()
        node_sum = torch.empty(m * c, dtype=input.dtype, device=input.device)
        first = self.reduce_scatter_tensor(node_sum, staged.view(-1), "dp_node", async_op=True)

        def across() -> None:
            first.wait()
            self.reduce_scatter_tensor(output, node_sum, "dp_cross", quant=quant)
            if op == "avg":
                output.div_(l * m)
        return self._then(across, async_op)

    def _two_level_all_reduce(self, tensor: torch.Tensor, op: str, quant: Optional[Quantization],
                              async_op: bool) -> Optional[Handle]:
        """All-reduce over ``dp`` as a reduce-scatter inside the node, an all-reduce of that [numel/l] share
        across nodes (quantized with ``quant``), and an all-gather inside the node; ``tensor`` is zero-padded
        to a multiple of the ``l`` ranks per node."""
        l, numel = self.size("dp_node"), tensor.numel()
        flat = tensor.view(-1)
        source, share = _padded(flat, l)
        mine = torch.empty(share, dtype=tensor.dtype, device=tensor.device)
        first = self.reduce_scatter_tensor(mine, source, "dp_node", async_op=True)

        def rest() -> None:
            first.wait()
            self.all_reduce(mine, "dp_cross", op="sum", quant=quant)
            if op == "avg":
                mine.div_(l * self.size("dp_cross"))
            self.all_gather_into_tensor(source, mine, "dp_node")
            if source is not flat:
                flat.copy_(source[:numel])
        return self._then(rest, async_op)

    def _quantized_all_reduce(self, tensor: torch.Tensor, axis: str, op: str, quant: Quantization,
                              async_op: bool) -> Optional[Handle]:
        """:meth:`_quantized_reduce_scatter` of ``tensor`` cut into ``n`` chunks of ``k = ceil(numel / n)``
        (the last zero-padded), then :meth:`_quantized_all_gather` of the summed chunk, launched when the
        handle is waited for."""
        n, numel = self.size(axis), tensor.numel()
        flat = tensor.view(-1)
        source, k = _padded(flat, n)
        mine = torch.empty(k, dtype=torch.float32, device=tensor.device)

        def gather() -> None:
            gathered = torch.empty(n * k, dtype=torch.float32, device=tensor.device)
            self._quantized_all_gather(gathered, mine, axis, quant, async_op=False)
            flat.copy_(gathered[:numel])
        first = self._quantized_reduce_scatter(mine, source, axis, op, quant, async_op=True)

        def rest() -> None:
            first.wait()
            gather()
        return self._then(rest, async_op)

    def _quantized_all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str, quant: Quantization,
                              async_op: bool) -> Optional[Handle]:
        """All-gather of ``input`` [k] packed ([1, W] bytes per rank), dequantized into ``output`` [n*k]."""
        n, k = self.size(axis), input.numel()
        wire = _quant.pack(input.reshape(1, k), quant.bits, quant.block)
        gathered = torch.empty(n, wire.shape[1], dtype=wire.dtype, device=wire.device)
        self._record("all_gather", axis, _nbytes(gathered), (n - 1) / n)

        def finish() -> None:
            values = _quant.unpack(gathered, k, quant.bits, quant.block)
            output.view(n, k).copy_(values)
        return self._gather_flat(gathered.view(-1), wire.view(-1), axis, async_op, finish)

    def all_gather(self, tensors: List[torch.Tensor], input: torch.Tensor, axis: str) -> None:
        """Gather equally shaped ``input`` from every rank of ``axis`` into the list ``tensors``."""
        n = self.size(axis)
        if n == 1:
            tensors[0].copy_(input)
            return
        self._record("all_gather", axis, _nbytes(input) * n, (n - 1) / n)
        with self._guard(self._name("all_gather", axis)):
            dist.all_gather([_untracked(t) for t in tensors], _untracked(input), group=self._group(axis))

    def broadcast(self, tensor: torch.Tensor, axis: str, src: int = 0) -> None:
        """Broadcast ``tensor`` from group rank ``src`` of ``axis`` to the rest of the group."""
        n = self.size(axis)
        if n == 1:
            return
        ranks = self._topology.group_ranks(axis)
        src_global = ranks[src]
        # gloo's broadcast sends from the root to every other rank directly.
        self._record("broadcast", axis, _nbytes(tensor), 1.0,
                     fan_out=[r for r in ranks if r != src_global] if self._topology.rank == src_global else [])
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
    def send(self, tensor: torch.Tensor, axis: str, dst: int, async_op: bool = False,
             tag: int = 0) -> Optional[Handle]:
        """Send ``tensor`` to rank ``dst`` of this rank's ``axis`` group (e.g. ``pp_rank + 1``, the next stage).

        The peer must post the matching :meth:`recv` of a tensor of the same size and dtype. Transfers between
        two ranks are matched in the order they are posted, separately for each ``tag`` (gloo honours tags;
        NCCL ignores them, so there one pair of ranks carries one stream only).
        """
        return self._point_to_point("send", dist.isend, tensor, axis, dst, async_op, tag)

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
        self._advance_rings()
        with self._guard(name):
            work = issue(_untracked(tensor), peer, group=self._group(axis), tag=tag)
        handle = Handle(work, None, self._timeout, lambda: self._guard(name), self._untrack)
        if async_op:
            return self._track(handle)
        handle.wait()
        return None

    def _peer(self, axis: str, rank: int, verb: str) -> int:
        """The global rank of group rank ``rank`` of ``axis``, which must be another rank than this one."""
        n, me = self.size(axis), self._topology.rank_in(axis)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < n or rank == me:
            raise ValueError(f"cannot {verb} rank {rank!r} of the {axis} group: the peer must be another rank of "
                             f"that group, in [0, {n}) and not this rank's own {me}")
        return self._topology.group_ranks(axis)[rank]


def _padded(flat: torch.Tensor, parts: int) -> Tuple[torch.Tensor, int]:
    """``flat`` [numel] as ``parts`` equal chunks: itself when they divide it, else a zero-padded copy; and the
    chunk size ``ceil(numel / parts)``."""
    k = -(-flat.numel() // parts)
    if k * parts == flat.numel():
        return flat, k
    padded = torch.zeros(k * parts, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()].copy_(flat)
    return padded, k


def _untracked(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory without its autograd identity, for the backend to hold.

    A backend can let go of its reference after the call returned (gloo's worker thread, NCCL's watchdog). A
    tensor that becomes an autograd output (a tensor-parallel mapping's result: its ``grad_fn`` is attached
    after the collective) or a view of one would keep the graph behind it, saved tensors and all, alive
    until then; under full recomputation that moved the measured peak. The alias shares the storage and
    offset, so results land in ``t`` as before."""
    return t.detach()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
