"""The communicator's reduce-scatters and all-gathers sent as point-to-point messages, where that costs less.

The message algorithms are :mod:`hybrid.p2p_collectives` (the direct shape
inside a node, the ring across nodes). This module keeps, for one
communicator, what runs them: which shape each axis takes (:meth:`PointToPointCollectives.shape`),
the per-axis sequence numbers their tags come from (every rank issues the same
operations in the same order, so they agree), and the rings still in flight,
moved on whenever the communicator communicates (:meth:`PointToPointCollectives.advance`).
"""

from __future__ import annotations

import collections
import datetime
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Union

import torch

from hybrid.comm_handle import Guard, Handle, OpName
from hybrid.group_table import AxisGroups
from hybrid.p2p_collectives import DirectReduceScatter, RingReduceScatter, direct_all_gather, direct_tags, ring_tag

# Backends whose own reduce-scatter and all-gather cost more than point-to-point messages (gloo's
# reduce-scatter sends an all-reduce's bytes, its all-gather lands in a temporary; benchmarks/p2p_collectives.py):
# the communicator sends the messages itself there, directly inside a node, the reduce-scatter as a ring across
# nodes.
P2P_COLLECTIVE_BACKENDS = {"gloo"}


class _Host(Protocol):
    """What these collectives use of their :class:`~hybrid.comm.Communicator`."""

    @property
    def timeout(self) -> Optional[datetime.timedelta]: ...

    def size(self, axis: str) -> int: ...

    def backend(self, axis: str) -> Optional[str]: ...

    def _group(self, axis: str) -> object: ...

    def _name(self, op: str, axis: str) -> OpName: ...

    def _guard(self, name: OpName) -> Guard: ...

    def _launch(self, op: str, axis: str, fn: Callable, async_op: bool,
                finish: Optional[Callable[[], None]] = None) -> Optional[Handle]: ...

    def _track(self, handle: Handle) -> Handle: ...

    def _untrack(self, handle: Handle) -> None: ...


class PointToPointCollectives:
    """The point-to-point reduce-scatters and all-gathers of one communicator (``host``) over ``groups``."""

    def __init__(self, groups: AxisGroups, host: _Host):
        self._groups = groups
        self._host = host
        # Rings of point-to-point messages still running, advanced whenever this rank communicates.
        self._rings: List[RingReduceScatter] = []
        # Collectives built from point-to-point messages (rings, direct gathers), numbered per axis in issue
        # order, which is the same on every rank: their messages' tags, so that those in flight together
        # never take each other's messages.
        self._sequence: Dict[str, int] = collections.defaultdict(int)
        self._shapes: Dict[str, Optional[str]] = {}  # shape()'s answer per axis

    def shape(self, axis: str) -> Optional[str]:
        """How ``axis``'s reduce-scatters and all-gathers run here: ``"direct"`` (its group inside one node),
        ``"ring"`` (across nodes), or None (the backend's own collectives)."""
        if axis in self._shapes:  # fixed once the groups exist; asked on every reduce-scatter and gather
            return self._shapes[axis]
        backend = self._host.backend(axis)
        if backend not in P2P_COLLECTIVE_BACKENDS:
            shape = None
        else:
            shape = "ring" if self._groups.nodes.spans_nodes(self._groups.group_ranks(axis)) else "direct"
        if backend is not None:
            self._shapes[axis] = shape
        return shape

    def advance(self) -> None:
        """Move every ring in flight on as far as its messages have arrived, without blocking."""
        if self._rings:
            self._rings = [ring for ring in self._rings if not ring.advance(block=False)]

    def _next(self, axis: str, count: int = 1) -> int:
        """The next ``count`` sequence numbers of ``axis``'s point-to-point collectives (their tags)."""
        sequence = self._sequence[axis]
        self._sequence[axis] += count
        return sequence

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                   finish: Optional[Callable[[], None]] = None) -> Optional[Handle]:
        """The direct all-gather of flat ``input`` [k] into ``output`` [n*k] over ``axis`` (not counted here)."""
        host = self._host
        ranks, me = list(self._groups.group_ranks(axis)), self._groups.rank_in(axis)
        tag = ring_tag(self._next(axis), 0, host.size(axis) - 1)
        return host._launch("all_gather", axis, lambda a: _maybe_wait(direct_all_gather(
            output, input, host._group(axis), ranks, me, tag, host.timeout), a), async_op, finish)

    def reduce_scatter(self, output: torch.Tensor, input: Union[torch.Tensor, Sequence[torch.Tensor]], axis: str,
                       op: str, async_op: bool) -> Optional[Handle]:
        """A reduce-scatter over ``axis`` (of a tensor [n*k] or segments, into ``output`` [k]) as point-to-point
        messages in :meth:`shape`'s shape: ``(n-1)/n`` of ``input`` sent per rank (not counted here)."""
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter_tensor over {axis}: op {op!r} is not supported on this backend "
                             f"(sum or avg)")
        host = self._host
        self.advance()
        name = host._name("reduce_scatter", axis)
        n, group, me = host.size(axis), host._group(axis), self._groups.rank_in(axis)
        ranks, divide_by = list(self._groups.group_ranks(axis)), (n if op == "avg" else None)
        if self.shape(axis) == "direct":
            pieces = 1 if isinstance(input, torch.Tensor) else len(input)
            sequence = self._next(axis, direct_tags(n, pieces))
            with host._guard(name):
                direct = DirectReduceScatter(output, input, group, ranks, me, sequence, host.timeout, divide_by)
            handle = Handle(direct.waits, direct.finish, host.timeout, lambda: host._guard(name), host._untrack)
            if not async_op:
                handle.wait()
                return None
            return host._track(handle)
        sequence = self._next(axis)
        with host._guard(name):
            ring = RingReduceScatter(output, input, group, ranks, me, sequence, host.timeout,
                                     lambda: host._guard(name), divide_by=divide_by)
        if not async_op:
            ring.finish()
            return None
        self._rings.append(ring)
        return host._track(Handle(None, ring.finish, host.timeout, None, host._untrack))


def _maybe_wait(works, async_op: bool):
    if async_op:
        return works
    works.wait()
    return None
