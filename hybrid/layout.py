"""What a parallel layout is, and what each ZeRO stage partitions: the one definition of both.

Everything that reasons about stages reads :data:`STAGE_TRAITS` (the
optimizers, configuration validation, checkpoints, resharding, the planner)
instead of comparing stage numbers; everything that describes a run's layout
uses :class:`ParallelLayout`, which :meth:`hybrid.topology.Topology.layout`
builds for a live job and checkpoints store in ``metadata.json``.
:func:`precision_traits` says which precision a run keeps its parameters,
gradients and buffers in (the DeepSpeed intake checks ``data_types`` with it).

This module is plain data: it imports no torch and, from hybrid, only the
plain-data :mod:`hybrid.grid` (whose rule says what the sizes multiply to), so
configuration code and offline tools can use it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Optional, Tuple

from hybrid.grid import expert_parallel_problem, world_size_of


class LayoutError(ValueError):
    """A ZeRO stage, offload choice or parallel layout that cannot be used."""


class ZeroStage(enum.IntEnum):
    """The ZeRO stages; each partitions one more kind of training state over the data-parallel group."""

    DISABLED = 0  # plain data parallelism: every rank holds everything, gradients are all-reduced
    OPTIMIZER_STATES = 1  # fp32 master weights and optimizer state partitioned
    GRADIENTS = 2  # ... and the reduced gradients
    PARAMETERS = 3  # ... and the low-precision parameters themselves


@dataclasses.dataclass(frozen=True)
class StageTraits:
    """What one stage partitions over the DP group (each True means 1/dp of it per rank)."""

    optimizer_states: bool
    gradients: bool
    parameters: bool

    @property
    def allows_offload(self) -> bool:
        """Offload moves the partitioned optimizer state to host memory, so there must be a partition."""
        return self.optimizer_states

    @property
    def gathers_after_step(self) -> bool:
        """Whether each rank steps only its partition of whole parameters, so the update ends with an
        all-gather of the new weights over the DP group (stage 3 gathers its parameters per module instead)."""
        return self.optimizer_states and not self.parameters


STAGE_TRAITS: Dict[ZeroStage, StageTraits] = {
    ZeroStage.DISABLED: StageTraits(optimizer_states=False, gradients=False, parameters=False),
    ZeroStage.OPTIMIZER_STATES: StageTraits(optimizer_states=True, gradients=False, parameters=False),
    ZeroStage.GRADIENTS: StageTraits(optimizer_states=True, gradients=True, parameters=False),
    ZeroStage.PARAMETERS: StageTraits(optimizer_states=True, gradients=True, parameters=True),
}

ZERO_STAGES: Tuple[int, ...] = tuple(int(s) for s in ZeroStage)
OFFLOAD_DEVICES: Tuple[str, ...] = ("none", "cpu")
# The training precisions, each with the torch dtype it runs in, named as torch names it (``torch.<name>``,
# which is also the name a Hugging Face config.json gives it as "torch_dtype"). The one statement of both:
# hybrid.dtypes builds the torch dtypes, byte sizes and file-format names from it.
PRECISION_DTYPES: Dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PRECISIONS: Tuple[str, ...] = tuple(PRECISION_DTYPES)


@dataclasses.dataclass(frozen=True)
class PrecisionTraits:
    """Which precision (one of :data:`PRECISIONS`) a run keeps each kind of tensor in."""

    params: str  # the trained parameters, as forward and backward see them
    grads: str  # the gradients, accumulated over the micro-steps of a global batch
    buffers: Optional[str]  # what floating-point buffers are cast to; None: they keep the dtype the model gave them


def precision_traits(precision: str, autocast: bool = False) -> PrecisionTraits:
    """What a run at ``precision`` (with ``autocast``) keeps in which precision: the one statement of the rule.

    Without autocast the engine casts the model, parameters and floating-point
    buffers alike, to a low ``precision`` (``hybrid.engine.precision``); with
    autocast, or at fp32, nothing is cast and the parameters are fp32. The
    gradients are accumulated in the parameters' own dtype at every ZeRO stage:
    each stage allocates its gradient store in the dtype of the parameters it
    holds (the whole flat buffers of stages 0-1 and of ``zero.reduce_once``,
    stage 2's partition that every micro-step's reduced bucket is added into,
    stage 3's partition, and their host copies under ``offload_optimizer``).
    """
    if precision not in PRECISIONS:
        raise LayoutError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if autocast or precision == "fp32":
        return PrecisionTraits(params="fp32", grads="fp32", buffers=None)
    return PrecisionTraits(params=precision, grads=precision, buffers=precision)


def _stage_list(stages) -> str:
    names = [str(int(s)) for s in stages]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def zero_stage(value: Any, key: str = "zero stage") -> ZeroStage:
    """``value`` as a :class:`ZeroStage`; ``key`` names the setting in the error (a flag or config key)."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in ZERO_STAGES:
        raise LayoutError(f"{key} must be {_stage_list(ZeroStage)}, got {value!r}")
    return ZeroStage(value)


def stage_traits(stage: int) -> StageTraits:
    return STAGE_TRAITS[zero_stage(stage)]


def partition_count(stage: int, dp: int) -> int:
    """How many pieces the optimizer state is cut into: ``dp`` when the stage partitions it, else 1."""
    return dp if stage_traits(stage).optimizer_states else 1


def keeps_whole_gradients(traits: StageTraits, reduce_once: bool = False) -> bool:
    """Whether each rank accumulates the whole gradient and reduces it once per step, on the last micro-step.

    Otherwise (the stages that partition gradients) a rank keeps only its
    gradient partition, so every micro-step's gradients are reduced as
    backward produces them. ``reduce_once`` (``zero.reduce_once``) makes a stage
    that partitions gradients but not parameters keep them whole instead: the
    data-parallel bytes of stage 1 for the gradient memory of stage 1.
    """
    return not traits.gradients or (reduce_once and not traits.parameters)


def reduce_once_problem(stage: int, reduce_once: bool) -> Optional[str]:
    """Why ``zero.reduce_once`` cannot be used at ``stage`` (None when it can)."""
    traits = stage_traits(stage)
    if reduce_once and traits.parameters:
        allowed = [s for s in ZeroStage if not STAGE_TRAITS[s].parameters]
        return (f"zero.reduce_once needs ZeRO stage {_stage_list(allowed)}: stage {int(stage)} partitions the "
                f"parameters, so its gradients are produced one unit at a time and reduced as they come")
    return None


def overlap_param_gather_problem(stage: int, overlap: bool) -> Optional[str]:
    """Why ``zero.overlap_param_gather`` cannot be used at ``stage`` (None when it can)."""
    traits = stage_traits(stage)
    if overlap and not traits.gathers_after_step:
        allowed = [s for s in ZeroStage if STAGE_TRAITS[s].gathers_after_step]
        why = ("it gathers each module's parameters in forward and already prefetches the next "
               "(zero.prefetch_bucket_size)" if traits.parameters else "every rank steps the whole model, "
               "so no weights are gathered after the step")
        return f"zero.overlap_param_gather needs ZeRO stage {_stage_list(allowed)}: at stage {int(stage)} {why}"
    return None


def offload_problem(stage: int, offload: str) -> Optional[str]:
    """Why ``offload`` cannot be used at ``stage`` (None when it can): the offload rule, written once."""
    if offload not in OFFLOAD_DEVICES:
        return f"offload must be one of {', '.join(OFFLOAD_DEVICES)}, got {offload!r}"
    if offload != "none" and not stage_traits(stage).allows_offload:
        allowed = [s for s in ZeroStage if STAGE_TRAITS[s].allows_offload]
        return (f"offload to {offload} needs ZeRO stage {_stage_list(allowed)}: stage {int(stage)} keeps no "
                f"partitioned optimizer state to move")
    return None


def pipeline_problem(stage: int, pp: int) -> Optional[str]:
    """Why ZeRO ``stage`` cannot run with ``pp`` pipeline stages (None when it can): the pipeline rule, once."""
    if pp > 1 and stage_traits(stage).parameters:
        return (f"ZeRO stage {int(stage)} partitions the parameters, which each pipeline stage would gather once "
                f"per micro-batch and chunk; use stage 0, 1 or 2 with pipeline parallelism")
    return None


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How one job lays its ranks out and partitions its state.

    ``tp`` x ``dp`` x ``pp`` ranks (TP innermost, see :mod:`hybrid.grid`),
    the ZeRO stage over ``dp`` and the training precision. Validated on
    construction; ``to_json``/``from_json`` are the form checkpoints store.
    There is no ``cp``: a context-parallel job's layout (and so its checkpoints') has
    for ``dp`` the ``dp x cp`` ranks its ZeRO partitions span
    (:meth:`hybrid.topology.Topology.layout`, :mod:`hybrid.engine.checkpoint`), since
    nothing saved depends on the sequence split.
    """

    tp: int
    dp: int
    pp: int = 1
    zero_stage: ZeroStage = ZeroStage.DISABLED
    precision: str = "fp32"
    ep: int = 1  # expert parallel: the ep consecutive dp ranks that share out the experts (hybrid.grid)

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout {name} must be an integer >= 1, got {value!r}")
        problem = expert_parallel_problem(self.dp, 1, self.ep)
        if problem:
            raise LayoutError(problem)
        object.__setattr__(self, "zero_stage", zero_stage(self.zero_stage, "layout zero_stage"))
        if self.precision not in PRECISIONS:
            raise LayoutError(f"layout precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    @property
    def world_size(self) -> int:
        return world_size_of(tp=self.tp, dp=self.dp, pp=self.pp)

    @property
    def traits(self) -> StageTraits:
        return STAGE_TRAITS[self.zero_stage]

    @property
    def partition_count(self) -> int:
        """Pieces of the optimizer state (one per DP rank when the stage partitions it)."""
        return partition_count(self.zero_stage, self.dp)

    def replace(self, **changes: Any) -> "ParallelLayout":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"tp={self.tp} dp={self.dp} pp={self.pp}{ep} zero={int(self.zero_stage)} {self.precision}"

    def to_json(self) -> Dict[str, Any]:
        out = {"tp": self.tp, "dp": self.dp, "pp": self.pp, "zero_stage": int(self.zero_stage),
               "precision": self.precision}
        if self.ep > 1:  # written only where it means something: a dense run's metadata stays as it was
            out["ep"] = self.ep
        return out

    @classmethod
    def from_json(cls, data: Any) -> "ParallelLayout":
        if not isinstance(data, dict):
            raise LayoutError(f"layout must be a JSON object, got {data!r}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise LayoutError(f"layout has unknown keys {sorted(unknown)}")
        return cls(**data)
