"""A ring reduce-scatter built from point-to-point messages, for backends whose own one moves too much.

gloo's ``reduce_scatter`` reduces the whole buffer on every rank and keeps a
slice: it sends what an all-reduce sends, ``2(n-1)/n`` of the buffer per
rank (measured at the interface: 2.0x the buffer in total at world 2, 6.0x at
world 4). A ring sends ``(n-1)/n``, half of that, which is what makes ZeRO's
reduce-scatter plus all-gather cost one all-reduce.

The ring, over the ``n`` ranks of one group in group-rank order, with the
input ``x`` of ``n`` chunks of ``k`` elements::

    step s = 0 .. n-2:  rank r sends its partial sum of chunk (r - s - 1) mod n to rank r + 1
                        and receives the partial sum of chunk (r - s - 2) mod n from rank r - 1,
                        to which it adds its own x[(r - s - 2) mod n]

After the last step rank ``r`` holds the sum of chunk ``r`` over the group,
added up in the order ``x_{r+1} + x_{r+2} + ... + x_r`` (one fixed order per
chunk, the same on every run). It needs two ``[k]`` buffers (one at ``n =
2``), where an all-to-all would need ``[n*k]``.

The input may be several *segments* ``s_j`` of ``n*k_j`` elements instead of
one tensor: chunk ``c`` is then the concatenation of every segment's chunk
``c`` (``k = sum k_j``), as if the segments were interleaved chunk by chunk,
without building that ``[n*k]`` tensor. The sums are the same, element by
element, in the same order; only the first send packs its pieces (``k``
elements).

Steps are driven from outside: :meth:`RingReduceScatter.advance` completes
what has arrived without blocking, :meth:`RingReduceScatter.finish` blocks
until the end. Each operation's messages carry their own tags, so rings in
flight at the same time never take each other's messages, whatever order
the ranks advance them in.
"""

from __future__ import annotations

import datetime
from typing import Callable, ContextManager, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

TAG_SPACE = 1 << 30  # gloo tags are non-negative int32; 0 is left to plain send/recv


def scratch_chunks(n: int, segments: int = 1) -> int:
    """Chunk-sized ``[k]`` buffers one ring over ``n`` ranks holds until it finishes: the receive buffer, and the
    running partial sum when ``n > 2`` or the input comes in several ``segments`` (the first send packs their
    pieces there); none when there is no one to talk to."""
    return 0 if n < 2 else (2 if n > 2 or segments > 1 else 1)


def ring_tag(sequence: int, step: int, steps: int) -> int:
    """The message tag of ``step`` of the ``sequence``-th ring of a group (the same on every rank)."""
    return 1 + (sequence * max(steps, 1) + step) % (TAG_SPACE - 1)


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
        segments = [input] if isinstance(input, torch.Tensor) else list(input)
        self.segments = [s.view(-1) for s in segments]
        self.sizes = [s.numel() // self.n for s in self.segments]  # k_j: each segment's share of a chunk
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
        self.acc = torch.empty_like(self.output) if scratch_chunks(self.n, len(self.segments)) > 1 else None
        self.works: list = []
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
        self.works = [dist.isend(send, self.next, group=self.group, tag=tag),
                      dist.irecv(self.recv, self.prev, group=self.group, tag=tag)]

    def _wait_step(self) -> None:
        with self.guard():
            for work in self.works:
                if self.timeout is not None:
                    work.wait(self.timeout)
                else:
                    work.wait()

    def _arrived(self) -> bool:
        return all(work.is_completed() for work in self.works)

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
                self.works = []
                self.done = True
            else:
                # The send of this step has completed, so the partial sum may be overwritten.
                self._add(mine, self.acc)
                self.step += 1
                self._post(self.acc)
        return True

    def finish(self) -> None:
        self.advance(block=True)
