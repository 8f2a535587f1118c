"""The bound on ZeRO-3 gradient reductions in flight: what a bucket may hold, and how many elements are on the wire.

``zero.bucket_size`` (DeepSpeed's ``reduce_bucket_size``) bounds both:

* a bucket is launched *before* a unit that would take it past
  ``bucket_size`` elements joins it (:func:`closes_before`), so no bucket
  exceeds ``bucket_size`` unless one unit alone does;
* the inputs of the reduce-scatters on the wire hold at most
  :func:`inflight_limit` elements: ``MAX_INFLIGHT_BUCKETS`` buckets, one
  reducing while the next fills (DeepSpeed's double buffer under
  ``overlap_comm``). Before a bucket is concatenated and launched, the oldest
  ones land until it fits (:meth:`InflightReductions.make_room`); a bucket
  larger than the limit goes out alone.

Every in-flight input also holds a reduced output ``[numel / N_d]`` and, on
gloo, the point-to-point receive buffers (:func:`hybrid.p2p_collectives.scratch_chunks`),
so the limit bounds those too.
These rules are shared by :class:`hybrid.zero.stage3_grads.Stage3GradReducer`
and the planner's replay of it (:func:`hybrid.plan.estimate.stage3_gradient_flow`).
"""

from __future__ import annotations

import collections
from typing import Callable, Deque, Tuple

from hybrid.comm import Handle

# Buckets on the wire at once: one reducing while the next fills overlaps communication with backward.
MAX_INFLIGHT_BUCKETS = 2


def closes_before(open_numel: int, unit_numel: int, bucket_numel: int) -> bool:
    """Whether the open bucket (``open_numel`` elements) is launched before a unit of ``unit_numel`` joins it."""
    return open_numel > 0 and open_numel + unit_numel > bucket_numel


def inflight_limit(bucket_numel: int) -> int:
    """Input elements of the reduce-scatters allowed on the wire at once."""
    return MAX_INFLIGHT_BUCKETS * bucket_numel


class InflightReductions:
    """Reduce-scatters launched and not landed yet, oldest first, each with the elements of its input.

    Landing an entry waits for its handle, then runs its ``finish`` (which
    writes the reduced chunk into the gradient partition).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._queue: Deque[Tuple[Handle, Callable[[], None], int]] = collections.deque()
        self.numel = 0  # input elements on the wire

    def __len__(self) -> int:
        return len(self._queue)

    def make_room(self, numel: int) -> None:
        """Land the oldest reductions until ``numel`` more input elements fit the limit (or none is left)."""
        while self._queue and self.numel + numel > self.limit:
            self.land_oldest()

    def add(self, handle: Handle, finish: Callable[[], None], numel: int) -> None:
        self._queue.append((handle, finish, numel))
        self.numel += numel

    def land_oldest(self) -> None:
        handle, finish, numel = self._queue.popleft()
        handle.wait()
        self.numel -= numel
        finish()

    def land_all(self) -> None:
        while self._queue:
            self.land_oldest()
