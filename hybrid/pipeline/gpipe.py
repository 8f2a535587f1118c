"""GPipe: every micro-batch's forward, then every backward in reverse order.

The reference schedule: simplest to reason about, and the most memory hungry
(each rank keeps all ``m`` micro-batches' activations until the backwards
start). Idle fraction per rank ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from typing import List

from hybrid.pipeline.actions import BACKWARD, FORWARD, Action


def actions(pp_rank: int, pp: int, microbatches: int, chunks: int = 1) -> List[Action]:
    del pp_rank, pp  # every rank runs the same list
    return ([Action(FORWARD, mb) for mb in range(microbatches)]
            + [Action(BACKWARD, mb) for mb in reversed(range(microbatches))])
