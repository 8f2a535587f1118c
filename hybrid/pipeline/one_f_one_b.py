"""1F1B (PipeDream-flush): the memory-bounded default.

Rank ``s`` of ``p`` first runs ``min(p - s - 1, m)`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards.
At most ``p - s`` micro-batches are in flight on rank ``s`` (``p`` on the
first), whatever ``m`` is; the idle fraction is GPipe's ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from typing import List

from hybrid.pipeline.actions import BACKWARD, FORWARD, Action


def warmup_forwards(pp_rank: int, pp: int, microbatches: int) -> int:
    return min(pp - pp_rank - 1, microbatches)


def actions(pp_rank: int, pp: int, microbatches: int, chunks: int = 1) -> List[Action]:
    warmup = warmup_forwards(pp_rank, pp, microbatches)
    out = [Action(FORWARD, mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        out += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    out += [Action(BACKWARD, mb) for mb in range(microbatches - warmup, microbatches)]
    return out
