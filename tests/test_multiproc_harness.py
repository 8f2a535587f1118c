"""The multi-process harness itself: what its tests rely on."""

from __future__ import annotations

import time

from tests.multiproc import run_distributed


def _first_rank_leaves_early():
    """Rank 0 takes part in creating a group it is not in and leaves; the others build theirs a second later."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.new_group([1, 2])
        return None
    time.sleep(1.0)
    group = dist.new_group([1, 2])
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def test_ranks_outlive_rank_zero():
    """The rendezvous store does not leave with rank 0 (the parent serves it, as torchrun's agent does)."""
    assert run_distributed(_first_rank_leaves_early, 3, timeout=60) == [None, 2.0, 2.0]
