"""What a candidate layout does not decide: the optimizer, the ZeRO knobs and the device profile.

The ZeRO knobs default to what a training run would use: the defaults of
:class:`hybrid.config.ZeroConfig`, read from its fields, so that the planner
and the configuration cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hybrid.compression import (ONE_BIT_OPTIMIZERS, ONEBIT_ADAM, ONEBIT_BITS, Quantization, compression_problem,
                                gradient_quantization, hpz_problem, onebit_problem, weight_quantization)
from hybrid.config import CheckpointConfig, ZeroConfig
from hybrid.plan.activations import CUDA, DeviceProfile
from hybrid.zero.param_gather import keep_numel

DEFAULT_FRAGMENTATION = 0.10


def zero_field(key: str) -> dataclasses.Field:
    """The field of ``zero.<key>`` in the training configuration (its default, and its ``help`` and
    ``choices`` in ``metadata``)."""
    return _field_of(ZeroConfig, key)


def checkpoint_field(key: str) -> dataclasses.Field:
    """The field of ``checkpoint.<key>`` in the training configuration (its ``flag`` and ``help``)."""
    return _field_of(CheckpointConfig, key)


def _field_of(section, key: str) -> dataclasses.Field:
    for field in dataclasses.fields(section):
        if field.name == key:
            return field
    raise KeyError(f"{section.__name__} has no field {key!r}")


def zero_default(key: str):
    """The default of ``zero.<key>`` in the training configuration."""
    return zero_field(key).default


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """The optimizer and ZeRO knobs of a run (config keys in comments), and whose device to count."""

    optimizer: str = "adamw"  # optimizer.type (onebit_adam: counted in its compressed phase, after freeze_step)
    weight_decay: bool = True  # optimizer.weight_decay > 0: 1-D parameters get a group of their own
    momentum: bool = False  # SGD only
    compiled_adam: bool = True  # hybrid's compiled Adam reads bf16/fp16 gradients without an fp32 copy
    bucket_size: int = zero_default("bucket_size")
    stage3_persistence_threshold: int = zero_default("persistence_threshold")
    stage3_live_parameters: int = zero_default("max_live_parameters")
    stage3_prefetch: int = zero_default("prefetch_bucket_size")
    stage3_reuse: int = zero_default("max_reuse_distance")  # zero.max_reuse_distance: kept from forward on
    reduce_once: bool = zero_default("reduce_once")  # zero.reduce_once: stage 2 keeps whole gradients, reduces once
    overlap_param_gather: bool = zero_default("overlap_param_gather")  # zero.overlap_param_gather: stages 1-2
    quantized_gradients: str = zero_default("quantized_gradients")  # zero.quantized_gradients: format name
    quantized_weights: str = zero_default("quantized_weights")  # zero.quantized_weights: format name
    quantization_block: int = zero_default("quantization_block")  # zero.quantization_block: elements per scale
    two_level_reduce: bool = zero_default("two_level_reduce")  # zero.two_level_reduce: inside nodes, then across
    hpz_partition_size: int = zero_default("hpz_partition_size")  # zero.hpz_partition_size: stage 3's hpZ (1: off)
    async_save: bool = False  # checkpoint.async_save: a background save's host copy counts in host memory
    async_save_chunk_mb: Optional[int] = None  # checkpoint.async_save_chunk_mb: bounds that copy
    fragmentation: float = DEFAULT_FRAGMENTATION
    profile: DeviceProfile = CUDA

    def __post_init__(self) -> None:
        """An unknown format, or a bad block with a format on, is wrong at every stage: ValueError, in the
        words of :mod:`hybrid.compression` (the stage rule is :meth:`compression_problem`)."""
        gradient_quantization(self.quantized_gradients, self.quantization_block)
        weight_quantization(self.quantized_weights, self.quantization_block)
        problem = hpz_problem(3, self.hpz_partition_size)  # at stage 3, only a size that is not one is refused
        if problem:
            raise ValueError(f"zero.hpz_partition_size: {problem}")

    @property
    def stage3_keep(self) -> int:
        """Elements of the recorded gather sequence within which stage 3's forward keeps a unit gathered
        (:func:`hybrid.zero.param_gather.keep_numel` of the prefetch window and ``zero.max_reuse_distance``)."""
        return keep_numel(self.stage3_prefetch, self.stage3_reuse)

    @property
    def gradient_quant(self) -> Optional[Quantization]:
        """The format of the data-parallel gradient reduction (None: the gradients' own dtype)."""
        return gradient_quantization(self.quantized_gradients, self.quantization_block)

    @property
    def weight_quant(self) -> Optional[Quantization]:
        """The format of the parameter all-gathers (None: the parameters' own dtype)."""
        return weight_quantization(self.quantized_weights, self.quantization_block)

    @property
    def whole_gradients(self) -> bool:
        """Whether stage 2 keeps the whole gradient and reduces it once per step: ``zero.reduce_once``, or
        a 1-bit optimizer, whose local steps need each rank's whole local gradient."""
        return self.reduce_once or self.optimizer in ONE_BIT_OPTIMIZERS

    @property
    def momentum_quant(self) -> Optional[Quantization]:
        """1-bit Adam's momentum format (``optimizer.type = onebit_adam``; None for other optimizers)."""
        return Quantization(ONEBIT_BITS, self.quantization_block) if self.optimizer == ONEBIT_ADAM else None

    def compression_problem(self, stage: int) -> Optional[str]:
        """Why the compression settings (hpZ included) cannot run at ZeRO ``stage`` (None when they can): the rules
        of :func:`hybrid.compression.compression_problem` and :func:`hybrid.compression.hpz_problem`, in their own
        words."""
        problem = compression_problem(stage, self.quantized_gradients, self.quantized_weights,
                                      self.quantization_block)
        if problem:
            return problem[1]
        if self.optimizer in ONE_BIT_OPTIMIZERS:
            problem = onebit_problem(stage, "none", self.two_level_reduce, self.optimizer)
            if problem:
                return problem[1]
        return hpz_problem(stage, self.hpz_partition_size)


DEFAULT_SETUP = TrainingSetup()  # every knob at the training configuration's default
