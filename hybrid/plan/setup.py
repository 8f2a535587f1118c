"""What a candidate layout does not decide: the optimizer, the ZeRO knobs and the device profile.

The ZeRO knobs default to what a training run would use: the defaults of
:class:`hybrid.config.ZeroConfig`, read from its fields, so that the planner
and the configuration cannot drift apart.
"""

from __future__ import annotations

import dataclasses

from hybrid.config import ZeroConfig
from hybrid.plan.activations import CUDA, DeviceProfile

DEFAULT_FRAGMENTATION = 0.10


def zero_default(key: str):
    """The default of ``zero.<key>`` in the training configuration."""
    for field in dataclasses.fields(ZeroConfig):
        if field.name == key:
            return field.default
    raise KeyError(f"ZeroConfig has no field {key!r}")


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """The optimizer and ZeRO knobs of a run (config keys in comments), and whose device to count."""

    optimizer: str = "adamw"  # optimizer.type
    weight_decay: bool = True  # optimizer.weight_decay > 0: 1-D parameters get a group of their own
    momentum: bool = False  # SGD only
    compiled_adam: bool = True  # hybrid's compiled Adam reads bf16/fp16 gradients without an fp32 copy
    bucket_size: int = zero_default("bucket_size")
    stage3_persistence_threshold: int = zero_default("persistence_threshold")
    stage3_live_parameters: int = zero_default("max_live_parameters")
    stage3_prefetch: int = zero_default("prefetch_bucket_size")
    reduce_once: bool = zero_default("reduce_once")  # zero.reduce_once: stage 2 keeps whole gradients, reduces once
    fragmentation: float = DEFAULT_FRAGMENTATION
    profile: DeviceProfile = CUDA
