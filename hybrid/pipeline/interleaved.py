"""Interleaved 1F1B: ``v`` model chunks per rank, so the bubble shrinks ``v``-fold.

Rank ``s`` holds parts ``s, s + p, ..., s + (v - 1) p`` of the model. Forwards
go through the micro-batches in groups of ``p``: the group's ``p`` micro-batches
on chunk 0, then on chunk 1, ... then the next group; backwards do the same
with the chunks reversed. The warm-up is ``2 (p - s - 1) + (v - 1) p``
forwards, then one forward and one backward alternate, then the backwards
drain. The micro-batch count must be a multiple of ``p``. Idle fraction
``(p - 1) / (v m + p - 1)``, at the price of ``v`` times more transfers.
"""

from __future__ import annotations

from typing import List, Tuple

from hybrid.config.errors import ConfigError
from hybrid.pipeline import one_f_one_b
from hybrid.pipeline.actions import BACKWARD, FORWARD, Action


def forward_order(pp: int, microbatches: int, chunks: int) -> List[Tuple[int, int]]:
    """(micro-batch, chunk) of every forward, in the order every rank runs them."""
    if chunks == 1:
        return [(mb, 0) for mb in range(microbatches)]
    order = []
    for group in range(0, microbatches, pp):
        members = range(group, min(group + pp, microbatches))
        order += [(mb, c) for c in range(chunks) for mb in members]
    return order


def backward_order(pp: int, microbatches: int, chunks: int) -> List[Tuple[int, int]]:
    """(micro-batch, chunk) of every backward: :func:`forward_order` with the chunks reversed."""
    return [(mb, chunks - 1 - c) for mb, c in forward_order(pp, microbatches, chunks)]


def warmup_forwards(pp_rank: int, pp: int, microbatches: int, chunks: int) -> int:
    return min(2 * (pp - pp_rank - 1) + (chunks - 1) * pp, microbatches * chunks)


def actions(pp_rank: int, pp: int, microbatches: int, chunks: int = 1) -> List[Action]:
    if chunks == 1:  # one chunk per rank is plain 1F1B (whose warm-up is half this one's)
        return one_f_one_b.actions(pp_rank, pp, microbatches)
    if microbatches % pp != 0:
        raise ConfigError(f"the interleaved schedule needs the micro-batch count ({microbatches}) to be a "
                          f"multiple of pipeline_model_parallel_size={pp}; change the global batch or the "
                          f"micro batch size")
    forwards = [Action(FORWARD, mb, c) for mb, c in forward_order(pp, microbatches, chunks)]
    backwards = [Action(BACKWARD, mb, c) for mb, c in backward_order(pp, microbatches, chunks)]
    warmup = warmup_forwards(pp_rank, pp, microbatches, chunks)
    out = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        out += [forwards[warmup + i], backwards[i]]
    return out + backwards[len(forwards) - warmup:]
