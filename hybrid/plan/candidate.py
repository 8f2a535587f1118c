"""What the planner varies: a parallel layout plus the choices that change memory but not the layout.

A :class:`Candidate` is one way to run the model that the planner evaluates:
a :class:`hybrid.layout.ParallelLayout` (TP, DP and pipeline sizes, ZeRO
stage, precision -- validated there, the same type a live job and its
checkpoints use) together with CPU offload, recomputation, the micro batch,
sequence parallelism and, with a pipeline, its schedule and virtual stages.
Whether offload can be used with the stage is the one rule of
:func:`hybrid.layout.offload_problem`, whether the stage composes with a
pipeline that of :func:`hybrid.layout.pipeline_problem`, and a pipeline's
layers are split as a job with the same settings splits them
(:func:`hybrid.pipeline.split.split_from_config`).
"""

from __future__ import annotations

import dataclasses

from hybrid.config.schema import PIPELINE_SCHEDULES, PipelineConfig
from hybrid.layout import LayoutError, ParallelLayout, StageTraits, ZeroStage, offload_problem, pipeline_problem
from hybrid.pipeline.split import StageSplit, split_from_config
from model_zoo.config import RECOMPUTE, GPTConfig

# What the planner assumes when it is not told: mixed precision, as large runs train.
DEFAULT_PRECISION = "bf16"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the model: a parallel layout, offload, recomputation, micro batch, sequence parallelism,
    and the pipeline's schedule (``pipeline.schedule``) and model chunks per pipeline rank (``virtual_stages``,
    the interleaved schedule's ``v``)."""

    parallel: ParallelLayout
    offload: str = "none"
    recompute: str = "none"
    micro_batch: int = 1
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    # context-parallel ranks splitting each sequence (hybrid.plan.context_parallel); ``parallel.dp`` excludes them
    cp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, ParallelLayout):
            raise LayoutError(f"a candidate's parallel layout must be a ParallelLayout, got {self.parallel!r}")
        problem = (offload_problem(self.parallel.zero_stage, self.offload)
                   or pipeline_problem(self.parallel.zero_stage, self.parallel.pp))
        if problem:
            raise LayoutError(problem)
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise LayoutError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got "
                              f"{self.pipeline_schedule!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise LayoutError(f"virtual_stages must be an integer >= 1, got {self.virtual_stages!r}")
        if self.virtual_stages > 1 and (self.pipeline_schedule != "interleaved" or self.pp == 1):
            raise LayoutError(f"{self.virtual_stages} virtual stages need a pipeline (pp > 1) with the interleaved "
                              f"schedule")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool) or self.micro_batch < 1:
            raise LayoutError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")
        if not isinstance(self.cp, int) or isinstance(self.cp, bool) or self.cp < 1:
            raise LayoutError(f"cp (--context-parallel-size) must be an integer >= 1, got {self.cp!r}")

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    def stage_split(self, config: GPTConfig) -> StageSplit:
        """The layers of each pipeline rank (and chunk), as a job run with this candidate's settings splits them:
        the balanced rule, or ``num_layers / (pp x v)`` layers per chunk with ``v`` virtual stages. A
        :class:`hybrid.config.errors.ConfigError` when the layers cannot be split so."""
        per_chunk = config.num_layers // (self.pp * self.virtual_stages) if self.virtual_stages > 1 else None
        settings = PipelineConfig(size=self.pp, schedule=self.pipeline_schedule, layers_per_virtual_stage=per_chunk)
        return split_from_config(settings, config.num_layers, self.pp)

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
        pipeline = ""
        if self.pp > 1:
            chunks = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
            pipeline = f" pp={self.pp} {self.pipeline_schedule}{chunks}"
        ep = f" ep={self.parallel.ep}" if self.parallel.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"tp={self.tp}{sp}{cp} dp={self.dp}{ep}{pipeline} zero={int(self.zero_stage)} offload={self.offload} "
                f"recompute={self.recompute} micro={self.micro_batch}")
