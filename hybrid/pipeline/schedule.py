"""Pipeline schedules: the ordered forward and backward work of each pipeline rank.

A schedule is a pure function ``(pp_rank, pp, microbatches, chunks) -> [Action]``.
It says only what to compute, in which order; the executor
(:mod:`hybrid.pipeline.executor`) derives the transfers from it: a forward of
any part but the first receives its input from the previous part, a backward
of any part but the last receives its output's gradient from the next part.
Sends are asynchronous, and a rank blocks only to receive, so a schedule is
deadlock-free exactly when :func:`hybrid.pipeline.simulate.simulate` finishes
it; the tests check every schedule that way for many sizes.

Every rank runs its forwards in one shared order of (micro-batch, chunk), and
its backwards in another: the transfers between two ranks then arrive in the
order they are awaited, which :func:`~hybrid.pipeline.simulate.simulate` also
checks.
"""

from __future__ import annotations

from typing import Callable, Dict, List

from hybrid.config.errors import ConfigError
from hybrid.config.schema import PIPELINE_SCHEDULES
from hybrid.pipeline import gpipe, interleaved, one_f_one_b
from hybrid.pipeline.actions import BACKWARD, FORWARD, Action

__all__ = ["Action", "BACKWARD", "FORWARD", "SCHEDULES", "build", "forward_only"]

ScheduleFn = Callable[[int, int, int, int], List[Action]]


def forward_only(pp_rank: int, pp: int, microbatches: int, chunks: int = 1) -> List[Action]:
    """Evaluation and loss-only passes: every forward in the shared order, no backward."""
    return [Action(FORWARD, mb, c) for mb, c in interleaved.forward_order(pp, microbatches, chunks)]


# pipeline.schedule's choices (PIPELINE_SCHEDULES, the config's list) -> the module that orders the work
SCHEDULES: Dict[str, ScheduleFn] = {"gpipe": gpipe.actions, "1f1b": one_f_one_b.actions,
                                    "interleaved": interleaved.actions}


def build(name: str, pp_rank: int, pp: int, microbatches: int, chunks: int = 1) -> List[Action]:
    """The actions of ``pp_rank`` under schedule ``name``; refuses combinations the schedule cannot run."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if chunks > 1 and name != "interleaved":
        raise ConfigError(f"{chunks} virtual stages per rank need the interleaved schedule, not {name!r}; set "
                          f"--pipeline-schedule interleaved or drop --num-layers-per-virtual-pipeline-stage")
    if microbatches < 1:
        raise ConfigError(f"a pipeline step needs at least one micro-batch, got {microbatches}")
    return SCHEDULES[name](pp_rank, pp, microbatches, chunks)
