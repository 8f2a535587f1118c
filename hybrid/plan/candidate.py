"""What the planner varies: a parallel layout plus the choices that change memory but not the layout.

A :class:`Candidate` is one way to run the model that the planner evaluates:
a :class:`hybrid.layout.ParallelLayout` (TP and DP sizes, ZeRO stage,
precision -- validated there, the same type a live job and its checkpoints
use) together with CPU offload, recomputation, the micro batch and sequence
parallelism. Whether offload can be used with the stage is the one rule of
:func:`hybrid.layout.offload_problem`.
"""

from __future__ import annotations

import dataclasses

from hybrid.layout import LayoutError, ParallelLayout, StageTraits, ZeroStage, offload_problem
from model_zoo.config import RECOMPUTE

# What the planner assumes when it is not told: mixed precision, as large runs train.
DEFAULT_PRECISION = "bf16"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the model: a parallel layout, offload, recomputation, micro batch and sequence parallelism."""

    parallel: ParallelLayout
    offload: str = "none"
    recompute: str = "none"
    micro_batch: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, ParallelLayout):
            raise LayoutError(f"a candidate's parallel layout must be a ParallelLayout, got {self.parallel!r}")
        # The planner models tensor and data parallelism only; a pipeline would change every per-rank figure.
        if self.parallel.pp != 1:
            raise LayoutError(f"the planner models pp=1 only, got pp={self.parallel.pp}")
        problem = offload_problem(self.parallel.zero_stage, self.offload)
        if problem:
            raise LayoutError(problem)
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1:
            raise LayoutError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def zero_stage(self) -> ZeroStage:
        return self.parallel.zero_stage

    @property
    def traits(self) -> StageTraits:
        """What the stage partitions over DP: every stage decision of the planner reads this."""
        return self.parallel.traits

    @property
    def precision(self) -> str:
        return self.parallel.precision

    def describe(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        return (f"tp={self.tp}{sp} dp={self.dp} zero={int(self.zero_stage)} offload={self.offload} "
                f"recompute={self.recompute} micro={self.micro_batch}")
