"""The typed configuration of a hybrid training run.

Every key, its type and its default live here; each field's ``metadata`` holds
its help text and the constraints that :mod:`hybrid.config.validate` checks
(``choices``, ``ge``/``gt``/``le``/``lt``). ``docs/config.md`` lists the same
keys, and a test keeps the two in step.

Sections (``zero``, ``optimizer``, ...) are nested dataclasses; in a dict, JSON
or YAML file they are nested mappings, and in overrides they are dotted paths
(``"optimizer.lr"``). Later features add keys to their section (ZeRO-3 and
offload go into :class:`ZeroConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd")
DECAY_STYLES = ("constant", "linear", "cosine")
WARMUP_STYLES = ("linear", "log")
RECOMPUTE = ("none", "full", "selective")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu")


def _field(default=dataclasses.MISSING, *, help: str, factory=dataclasses.MISSING, **constraints):
    meta = {"help": help, **constraints}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class LossScalingConfig:
    """fp16 loss scaling. Ignored unless ``precision`` is ``fp16`` (bf16 and fp32 never scale)."""

    loss_scale: float = _field(0.0, ge=0.0, help="0 selects dynamic loss scaling; a positive value is a "
                                                 "static scale")
    initial_scale_power: int = _field(16, ge=0, le=64, help="dynamic scaling starts at 2**initial_scale_power")
    loss_scale_window: int = _field(1000, ge=1, help="steps without overflow before the scale doubles")
    hysteresis: int = _field(2, ge=1, help="overflows tolerated before the scale is halved")
    min_loss_scale: float = _field(1.0, gt=0.0, help="the dynamic scale never drops below this")


@dataclasses.dataclass
class ZeroConfig:
    """The ZeRO optimizer over the data-parallel group."""

    stage: int = _field(0, help="0: data parallel (all-reduce); 1: + partitioned fp32 master "
                                                     "and optimizer states; 2: + partitioned gradients; 3: + "
                                                     "partitioned parameters")
    bucket_size: int = _field(25_000_000, ge=1, help="elements per gradient bucket reduced as one collective")
    overlap_comm: bool = _field(True, help="launch each bucket's reduction during backward as soon as it fills")
    offload_optimizer: str = _field("none", choices=OFFLOAD_DEVICES, help="cpu: fp32 master weights and optimizer "
                                                                          "state in host memory, stepped by the "
                                                                          "CPU Adam (stages 1-3)")
    persistence_threshold: int = _field(100_000, ge=0, help="stage 3: parameters with at most this many elements "
                                                            "stay whole on every rank")
    max_live_parameters: int = _field(1_000_000_000, ge=1, help="stage 3: elements of gathered parameters held "
                                                                "at once")
    prefetch_bucket_size: int = _field(50_000_000, ge=0, help="stage 3: elements gathered ahead of the module "
                                                              "that needs them; 0 disables prefetch")


@dataclasses.dataclass
class OptimizerConfig:
    """The inner optimizer that steps the fp32 master partitions."""

    type: str = _field("adamw", choices=OPTIMIZERS, help="adamw (decoupled weight decay), adam (L2 weight "
                                                          "decay added to the gradient) or sgd")
    lr: float = _field(1e-3, gt=0.0, help="peak learning rate (after warmup)")
    betas: Tuple[float, float] = _field(factory=lambda: (0.9, 0.999), help="Adam (beta1, beta2), each in [0, 1)")
    eps: float = _field(1e-8, gt=0.0, help="Adam epsilon")
    weight_decay: float = _field(0.0, ge=0.0, help="weight decay coefficient")
    momentum: float = _field(0.0, ge=0.0, lt=1.0, help="SGD momentum (sgd only)")
    decay_1d_params: bool = _field(False, help="false: parameters with at most one dimension (biases, norm "
                                               "weights) get no weight decay; true: every parameter decays")


@dataclasses.dataclass
class SchedulerConfig:
    """The learning-rate schedule: optional warmup, then constant, linear or cosine decay to ``min_lr``."""

    type: str = _field("constant", choices=DECAY_STYLES, help="decay style after warmup")
    warmup_iters: int = _field(0, ge=0, help="optimizer steps of warmup from warmup_start_lr to optimizer.lr")
    warmup_style: str = _field("linear", choices=WARMUP_STYLES, help="linear, or log (the warmup of "
                                                                     "DeepSpeed's default warmup_type)")
    warmup_start_lr: float = _field(0.0, ge=0.0, help="learning rate at the first warmup step")
    decay_iters: Optional[int] = _field(None, ge=1, help="optimizer step at which decay reaches min_lr, "
                                                         "counted from the start (warmup included); "
                                                         "needed by linear and cosine")
    min_lr: float = _field(0.0, ge=0.0, help="learning rate at and after decay_iters")


@dataclasses.dataclass
class TensorBoardConfig:
    """TensorBoard event files, written by global rank 0 only."""

    enabled: bool = _field(False, help="write TensorBoard event files")
    output_path: str = _field("runs", help="directory that holds the job directories")
    job_name: str = _field("hybrid", help="events go to output_path/job_name")


@dataclasses.dataclass
class HybridConfig:
    """Everything :func:`hybrid.initialize` needs besides the model and the topology."""

    precision: str = _field("fp32", choices=PRECISIONS, help="training precision of the model's parameters "
                                                            "and activations; master weights are always fp32")
    autocast: bool = _field(False, help="false: the engine casts an fp32 model to the low precision (the ZeRO "
                                        "mixed-precision path); true: parameters stay fp32 and forward runs "
                                        "under torch.autocast")
    loss_scaling: LossScalingConfig = _field(factory=LossScalingConfig, help="fp16 loss scaling")
    zero: ZeroConfig = _field(factory=ZeroConfig, help="ZeRO optimizer")
    optimizer: OptimizerConfig = _field(factory=OptimizerConfig, help="inner optimizer")
    scheduler: SchedulerConfig = _field(factory=SchedulerConfig, help="learning-rate schedule")
    clip_grad: float = _field(0.0, ge=0.0, help="clip the global gradient L2 norm to this value; 0 disables")
    micro_batch_size: Optional[int] = _field(None, ge=1, help="samples per data-parallel rank per micro-step")
    gradient_accumulation_steps: Optional[int] = _field(None, ge=1, help="micro-steps per optimizer step")
    global_batch_size: Optional[int] = _field(None, ge=1, help="samples per optimizer step over all "
                                                              "data-parallel ranks")
    tensor_parallel_size: Optional[int] = _field(None, ge=1, help="TP ranks per model replica; unset: take "
                                                                 "the topology's (1 without one)")
    recompute: str = _field("none", choices=RECOMPUTE, help="activation recomputation of the model "
                                                            "(model_zoo models)")
    tensorboard: TensorBoardConfig = _field(factory=TensorBoardConfig, help="TensorBoard logging")
    seed: int = _field(1234, ge=0, help="random seed; the trainer seeds with it before building the model")
    steps_per_print: int = _field(10, ge=0, help="log a progress line every this many optimizer steps "
                                                "(rank 0); 0 disables")
    use_fused_kernels: bool = _field(True, help="use hybrid's fused optimizer kernels when they are built")

    # ---- conveniences (defined in sibling modules; bound here so users need one import) ----
    @classmethod
    def from_dict(cls, data) -> "HybridConfig":
        """Build and validate from a native (non-DeepSpeed) nested mapping."""
        from hybrid.config.parse import parse_native

        return parse_native(data)

    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML-serialisable) that :meth:`from_dict` reads back."""
        from hybrid.config.parse import to_plain

        return to_plain(self)

    def with_overrides(self, overrides) -> "HybridConfig":
        """A new, validated config with dotted-path overrides applied (``{"optimizer.lr": 3e-4}``)."""
        from hybrid.config.parse import apply_overrides

        return apply_overrides(self, overrides)

    def resolve_batch(self, dp_size: int):
        """Micro batch, accumulation steps and global batch for ``dp_size`` data-parallel ranks.

        See :func:`hybrid.config.batch.resolve_batch`.
        """
        from hybrid.config.batch import resolve_batch

        return resolve_batch(self.micro_batch_size, self.gradient_accumulation_steps,
                             self.global_batch_size, dp_size)
