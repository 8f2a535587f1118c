"""Reduce-scatter and all-gather built from point-to-point messages, for backends whose own ones cost more.

gloo's ``reduce_scatter`` reduces the whole buffer on every rank and keeps a
slice: it sends what an all-reduce sends, ``2(n-1)/n`` of the buffer per
rank (measured at the interface: 2.0x the buffer in total at world 2, 6.0x at
world 4). Its ``all_gather`` sends the ideal ``(n-1)/n`` but lands the result
in a temporary and copies it out. Sent as point-to-point messages, either one
moves ``(n-1)/n`` of the buffer per rank and lands it in place, which is what
makes ZeRO's reduce-scatter plus all-gather cost one all-reduce.
``python benchmarks/p2p_collectives.py`` (world 4 on one machine, 8 MB
buffers, slowest rank's wall time and all ranks' CPU time): reduce-scatter
20.6 ms / 35.6 ms (gloo), 11.8 / 17.8 (ring), 10.6 / 18.0 (direct); all-gather
11.6 / 18.7 (gloo), 8.0 / 13.6 (direct).

Two shapes, chosen by :class:`hybrid.comm_p2p.PointToPointCollectives` for the communicator:

* **direct**, inside a node: every rank posts, at once, a send of each
  peer's chunk and a receive of each peer's contribution to its own. One
  round, no progress to drive; a reduce-scatter holds ``n - 1`` received
  chunks (:func:`scratch_chunks`) and adds them to its own chunk in a fixed
  order (``x_r + x_{r-1} + ... + x_{r+1}``, indices mod ``n``).
* **ring**, across nodes (a reduce-scatter only; the library's all-gather is
  already a ring there): each rank sends only to its successor, so a group
  over several nodes crosses each node boundary twice per step instead of
  once per pair of ranks on either side. Over the ``n`` ranks of one group in
  group-rank order, with the input ``x`` of ``n`` chunks of ``k`` elements::

    step s = 0 .. n-2:  rank r sends its partial sum of chunk (r - s - 1) mod n to rank r + 1
                        and receives the partial sum of chunk (r - s - 2) mod n from rank r - 1,
                        to which it adds its own x[(r - s - 2) mod n]

  After the last step rank ``r`` holds the sum of chunk ``r`` over the group,
  added up in the order ``x_{r+1} + x_{r+2} + ... + x_r``. It needs two
  ``[k]`` buffers (one at ``n = 2``). Its steps are driven from outside:
  :meth:`RingReduceScatter.advance` completes what has arrived without
  blocking, :meth:`RingReduceScatter.finish` blocks until the end.

The input may be several *segments* ``s_j`` of ``n*k_j`` elements instead of
one tensor: chunk ``c`` is then the concatenation of every segment's chunk
``c`` (``k = sum k_j``), as if the segments were interleaved chunk by chunk,
without building that ``[n*k]`` tensor. The sums are the same, element by
element, in the same order (the direct shape sends each piece as its own
message; the ring packs its first send's pieces, ``k`` elements).

Each operation's messages carry their own tags (:func:`ring_tag`, from a
per-axis sequence number every rank assigns alike), so operations in flight
at the same time never take each other's messages, whatever order the ranks
wait for them in.
"""

from __future__ import annotations

import datetime
from typing import Callable, ContextManager, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

TAG_SPACE = 1 << 30  # gloo tags are non-negative int32; 0 is left to plain send/recv


def scratch_chunks(n: int, segments: int = 1, direct: bool = True) -> int:
    """Chunk-sized ``[k]`` buffers one reduce-scatter over ``n`` ranks holds until it finishes: ``direct``, the
    ``n - 1`` chunks received; a ring, the receive buffer and the running partial sum when ``n > 2`` or the
    input comes in several ``segments`` (the first send packs their pieces there); none when there is no one to
    talk to."""
    if n < 2:
        return 0
    if direct:
        return n - 1
    return 2 if n > 2 or segments > 1 else 1


def ring_tag(sequence: int, step: int, steps: int) -> int:
    """The message tag of ``step`` of the ``sequence``-th point-to-point collective of a group (the same on every
    rank); an operation that needs more than ``steps`` tags takes several sequence numbers."""
    return 1 + (sequence * max(steps, 1) + step) % (TAG_SPACE - 1)


def _segments(input: Union[torch.Tensor, Sequence[torch.Tensor]], n: int) -> Tuple[List[torch.Tensor], List[int]]:
    """The input as flat segments, and each one's share of a chunk (``k_j``)."""
    segments = [input.view(-1)] if isinstance(input, torch.Tensor) else [s.view(-1) for s in input]
    return segments, [s.numel() // n for s in segments]


class _Waits:
    """Point-to-point works waited for as one, each within ``timeout``."""

    def __init__(self, works: list, timeout: Optional[datetime.timedelta]):
        self.works = works
        self.timeout = timeout

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> None:
        timeout = timeout or self.timeout
        for work in self.works:
            if timeout is not None:
                work.wait(timeout)
            else:
                work.wait()


def direct_all_gather(output: torch.Tensor, input: torch.Tensor, group, ranks: List[int], me: int, tag: int,
                      timeout: Optional[datetime.timedelta]) -> _Waits:
    """All-gather of ``input`` [k] into ``output`` [n*k] (group-rank order): ``input`` goes to every peer, and each
    peer's chunk is received straight into its place (this rank's own is copied). Returns what to wait for."""
    n = len(ranks)
    chunks, mine = output.view(-1).chunk(n), input.reshape(-1)
    chunks[me].copy_(mine)
    works = []
    for step in range(1, n):
        works.append(dist.isend(mine, ranks[(me + step) % n], group=group, tag=tag))
        source = (me - step) % n
        works.append(dist.irecv(chunks[source], ranks[source], group=group, tag=tag))
    return _Waits(works, timeout)


def direct_tags(n: int, segments: int) -> int:
    """Sequence numbers a direct reduce-scatter of ``segments`` pieces per peer takes (one tag per piece)."""
    return -(-segments // max(n - 1, 1))


class DirectReduceScatter:
    """One reduce-scatter of ``input`` [n*k] (or segments) into ``output`` [k] by direct messages (see the module
    docstring): every send and receive is posted here; :meth:`finish` waits for them and adds.

    ``group``/``ranks``/``me`` as :class:`RingReduceScatter`; ``sequence``: the first of the
    :func:`direct_tags` sequence numbers it takes. ``output`` may be this rank's own chunk of ``input``."""

    def __init__(self, output: torch.Tensor, input: Union[torch.Tensor, Sequence[torch.Tensor]], group,
                 ranks: List[int], me: int, sequence: int, timeout: Optional[datetime.timedelta],
                 divide_by: Optional[int] = None):
        n = len(ranks)
        self.output = output.view(-1)
        self.segments, self.sizes = _segments(input, n)
        self.me, self.n, self.divide_by = me, n, divide_by
        k = self.output.numel()
        self.received = torch.empty(n - 1, k, dtype=self.output.dtype, device=self.output.device)
        works = []
        for step in range(1, n):
            peer, source = (me + step) % n, (me - step) % n
            o = 0
            for j, (segment, kj) in enumerate(zip(self.segments, self.sizes)):
                tag = ring_tag(sequence, j, n - 1)
                works.append(dist.isend(segment[peer * kj: (peer + 1) * kj], ranks[peer], group=group, tag=tag))
                works.append(dist.irecv(self.received[step - 1, o: o + kj], ranks[source], group=group, tag=tag))
                o += kj
        self.waits = _Waits(works, timeout)

    def finish(self) -> None:
        """Add the received chunks to this rank's own (after :attr:`waits` completed)."""
        o = 0
        for segment, kj in zip(self.segments, self.sizes):
            own = segment[self.me * kj: (self.me + 1) * kj]
            if own.data_ptr() != self.output[o: o + kj].data_ptr():
                self.output[o: o + kj].copy_(own)
            o += kj
        for row in self.received:  # from rank r-1, r-2, ..., r+1: one fixed order
            self.output.add_(row)
        if self.divide_by is not None:
            self.output.div_(self.divide_by)
        self.received = None


class RingReduceScatter:
    """One reduce-scatter of ``input`` [n*k] (or segments, see the module docstring) over a process group into
    ``output`` [k], as a ring.

    ``group``/``ranks``: the process group and its members' global ranks in
    group-rank order; ``me``: this rank's index in ``ranks``. ``output`` may be
    this rank's own chunk of ``input`` (reduce in place; one segment only);
    the other chunks of ``input`` are only read. ``guard(what)`` wraps every
    blocking wait (it names the operation in errors and counts the time blocked).
    """

    def __init__(self, output: torch.Tensor, input: Union[torch.Tensor, Sequence[torch.Tensor]], group,
                 ranks: List[int], me: int, sequence: int, timeout: Optional[datetime.timedelta],
                 guard: Callable[[], ContextManager[None]], divide_by: Optional[int] = None):
        self.n = len(ranks)
        self.k = output.numel()
        self.me = me
        self.output = output.view(-1)
        self.segments, self.sizes = _segments(input, self.n)  # k_j: each segment's share of a chunk
        self.group = group
        self.next = ranks[(me + 1) % self.n]
        self.prev = ranks[(me - 1) % self.n]
        self.sequence = sequence
        self.timeout = timeout
        self.guard = guard
        self.divide_by = divide_by
        self.step = 0
        self.recv = torch.empty_like(self.output)
        # The running partial sum that is sent on (steps 1 .. n-2; not needed on a ring of two), and where the
        # first send packs the pieces of several segments.
        several = len(self.segments) > 1
        several_scratch = scratch_chunks(self.n, len(self.segments), direct=False) > 1
        self.acc = torch.empty_like(self.output) if several_scratch else None
        self.works = _Waits([], timeout)
        self.done = False
        first = self.chunk(self._send_index(0))
        if several:
            torch.cat(first, out=self.acc)
        self._post(self.acc if several else first[0])

    def chunk(self, i: int) -> List[torch.Tensor]:
        """The pieces of chunk ``i``, one per segment."""
        return [s[i * k: (i + 1) * k] for s, k in zip(self.segments, self.sizes)]

    def _add(self, mine: List[torch.Tensor], out: torch.Tensor) -> None:
        """``out = recv + mine``, piece by piece."""
        o = 0
        for piece in mine:
            k = piece.numel()
            torch.add(self.recv[o: o + k], piece, out=out[o: o + k])
            o += k

    def _send_index(self, step: int) -> int:
        return (self.me - step - 1) % self.n

    def _recv_index(self, step: int) -> int:
        return (self.me - step - 2) % self.n

    def _post(self, send: torch.Tensor) -> None:
        tag = ring_tag(self.sequence, self.step, self.n - 1)
        self.works = _Waits([dist.isend(send, self.next, group=self.group, tag=tag),
                             dist.irecv(self.recv, self.prev, group=self.group, tag=tag)], self.timeout)

    def _wait_step(self) -> None:
        with self.guard():
            self.works.wait()

    def _arrived(self) -> bool:
        return all(work.is_completed() for work in self.works.works)

    def advance(self, block: bool) -> bool:
        """Complete the steps whose messages have arrived (all of them when ``block``); True once done."""
        while not self.done:
            if not block and not self._arrived():
                return False
            self._wait_step()
            mine = self.chunk(self._recv_index(self.step))
            if self.step == self.n - 2:
                self._add(mine, self.output)
                if self.divide_by is not None:
                    self.output.div_(self.divide_by)
                self.works = _Waits([], self.timeout)
                self.done = True
            else:
                # The send of this step has completed, so the partial sum may be overwritten.
                self._add(mine, self.acc)
                self.step += 1
                self._post(self.acc)
        return True

    def finish(self) -> None:
        self.advance(block=True)
