"""The typed configuration of a hybrid training run: one tree, :class:`HybridConfig`.

Every key, its type and its one default live here: the engine's sections and
the root in this module, the sections only the trainer reads in
:mod:`hybrid.config.trainer_sections`, each key declared with
:func:`hybrid.config.fields.field`. Each field's ``metadata`` holds what the
rest of the package derives from it:

* ``help``: the text of ``docs/config.md`` and of ``hybrid-train --help``;
* ``choices``, ``ge``/``gt``/``le``/``lt``: the per-key rules that
  :mod:`hybrid.config.validate` checks;
* ``flag``: the command-line flag when it is not the one derived from the key
  (``zero.bucket_size`` -> ``--zero-bucket-size``); the Megatron-style names
  (``--lr``, ``--tensor-model-parallel-size``) are given this way;
* ``aliases``: further spellings of the same key (:class:`Alias`), e.g. the
  switches ``--bf16``/``--fp16`` for ``precision``.

:mod:`hybrid.config.flags` turns this into flags and flat trainer keys.
``docs/config.md`` lists the same keys, and a test keeps the two in step.

The engine (:func:`hybrid.initialize`) reads the engine keys; the trainer
(``hybrid-train``) reads the tree as a whole, including the sections only it
uses (``model``, ``data``, ``checkpoint``, ``run``, ``eval``, ``logging``,
``distributed``), which the engine ignores (but ``checkpoint.async_save``
and ``checkpoint.async_save_chunk_mb``, which its ``save_checkpoint`` reads,
and ``distributed`` when it starts the process group itself).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, List, Optional, Tuple

from hybrid.compression import DEFAULT_BLOCK, GRADIENT_FORMATS, ONEBIT_ADAM, WEIGHT_FORMATS, ZERO_ONE_ADAM
from hybrid.config.fields import Alias
from hybrid.config.fields import field as _field
from hybrid.config.fields import section as _section
from hybrid.config.trainer_sections import (SCHEDULE_ON_LOAD, CheckpointConfig, DataConfig, DistributedConfig,
                                            EvalConfig, LoggingConfig, ModelConfig, RunConfig)
from hybrid.layout import OFFLOAD_DEVICES, PRECISIONS, ZERO_STAGES
from model_zoo.config import RECOMPUTE  # the model description's (torch-free)

# Choice lists owned by the configuration (the ZeRO stages, offload devices and
# precisions are hybrid.layout's). hybrid.optim.lr_schedule imports the styles.
OPTIMIZERS = ("adamw", "adam", "sgd", ONEBIT_ADAM, ZERO_ONE_ADAM, "lamb")
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "wsd")
# The styles that reach min_lr at a set length (the decay length); inverse-square-root decays without end.
DECAY_STYLES_WITH_END = ("linear", "cosine", "wsd")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")  # the shape of WSD's final anneal
WARMUP_STYLES = ("linear", "log")
WD_INCR_STYLES = ("constant", "linear", "cosine")  # how the weight decay grows from its start to its end
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved")  # hybrid.pipeline.schedule maps each to its module
MASTER_PRECISIONS = ("fp32", "bf16")  # zero.master_precision: bf16 masters and optimizer state are an opt-in mode


def decoupled_lr_problem(optimizer: "OptimizerConfig") -> Optional[str]:
    """Why ``optimizer.decoupled_lr`` cannot be honoured with ``optimizer`` (a sentence to follow the key), or None:
    the embedding and output weights step in optimizer groups of their own; the 1-bit optimizers step all at one
    rate."""
    if optimizer.decoupled_lr is None:
        return "is unset, but optimizer.decoupled_min_lr needs it" if optimizer.decoupled_min_lr is not None \
            else None
    if optimizer.type in (ONEBIT_ADAM, ZERO_ONE_ADAM):
        return (f"is not supported with {optimizer.type}: it steps every parameter at one rate; use adamw, adam, sgd "
                f"or lamb")
    return None


def lamb_problem(stage: int, offload: str) -> Optional[str]:
    """Why LAMB cannot run at ZeRO ``stage`` with ``offload`` (zero.offload_optimizer), or None: its trust ratio
    needs each parameter's norms, which the flat partitions of stages 0-2 give (a sum per parameter, all-reduced
    over dp); stage 3's units and the host step are not built for it."""
    if stage == 3:
        return "LAMB runs at ZeRO stages 0-2 (its per-parameter norms over the flat partitions); use stage 2"
    if offload != "none":
        return "LAMB steps on the device; the host step (zero.offload_optimizer cpu) is Adam's"
    return None

__all__ = ["HybridConfig", "ZeroConfig", "OptimizerConfig", "SchedulerConfig", "LossScalingConfig",
           "TensorBoardConfig", "ModelConfig", "DataConfig", "CheckpointConfig", "RunConfig", "EvalConfig",
           "LoggingConfig", "DistributedConfig", "Alias", "OPTIMIZERS", "DECAY_STYLES", "DECAY_STYLES_WITH_END",
           "WSD_DECAY_STYLES", "WARMUP_STYLES", "WD_INCR_STYLES",
           "RECOMPUTE", "PIPELINE_SCHEDULES", "SCHEDULE_ON_LOAD", "PipelineConfig", "ZERO_STAGES",
           "OFFLOAD_DEVICES", "PRECISIONS"]


def scale_to_power(value: Any) -> int:
    """``--initial-loss-scale`` (a power of two, e.g. 65536) as ``loss_scaling.initial_scale_power`` (16)."""
    scale = float(value)
    if not (math.isfinite(scale) and scale >= 1 and math.log2(scale).is_integer()):
        raise ValueError(f"must be a power of two (2**k, k >= 0), got {value!r}")
    return int(math.log2(scale))


# ---- engine sections (the trainer's: hybrid.config.trainer_sections) ------------------------------------------------------------------------------

@dataclasses.dataclass
class LossScalingConfig:
    """fp16 loss scaling. Ignored unless ``precision`` is ``fp16`` (bf16 and fp32 never scale)."""

    loss_scale: float = _field(0.0, ge=0.0, flag="--loss-scale",
                               help="0 selects dynamic loss scaling; a positive value is a static scale")
    initial_scale_power: int = _field(16, ge=0, le=64, flag="--initial-scale-power",
                                      help="dynamic scaling starts at 2**initial_scale_power",
                                      aliases=(Alias("--initial-loss-scale", convert=scale_to_power,
                                                     help="initial dynamic loss scale as a value (a power of "
                                                          "two): sets loss_scaling.initial_scale_power to "
                                                          "its log2"),))
    loss_scale_window: int = _field(1000, ge=1, flag="--loss-scale-window",
                                    help="steps without overflow before the scale doubles")
    hysteresis: int = _field(2, ge=1, flag="--hysteresis", help="overflows tolerated before the scale is halved")
    min_loss_scale: float = _field(1.0, gt=0.0, flag="--min-loss-scale",
                                   help="the dynamic scale never drops below this")


@dataclasses.dataclass
class ZeroConfig:
    """The ZeRO optimizer over the data-parallel group."""

    stage: int = _field(0, choices=ZERO_STAGES, help="0: data parallel (all-reduce); 1: + partitioned fp32 master "
                                                     "and optimizer states; 2: + partitioned gradients; 3: + "
                                                     "partitioned parameters",
                        aliases=(Alias("--use-distributed-optimizer", const=1, weak=True, compat=True,
                                       help="Megatron-LM's distributed optimizer (fp32 masters and optimizer state "
                                            "partitioned over data parallelism): ZeRO stage 1, unless --zero-stage "
                                            "is given"),))
    bucket_size: int = _field(25_000_000, ge=1, help="elements per gradient bucket reduced as one collective; "
                                                     "stage 3: a bucket exceeds it only when one unit does, and "
                                                     "at most twice this many elements are on the wire")
    overlap_comm: bool = _field(True, help="launch each bucket's reduction during backward as soon as it fills",
                                aliases=(Alias("--overlap-grad-reduce", const=True, compat=True,
                                               help="Megatron-LM's spelling of zero.overlap_comm true"),))
    reduce_once: bool = _field(False, help="stage 2 under gradient accumulation: keep the whole gradient and "
                                           "reduce it once per step, as stages 0-1 do, not on every micro-step "
                                           "(the data-parallel bytes of stage 1, for a whole gradient buffer "
                                           "instead of a 1/dp partition)")
    overlap_param_gather: bool = _field(False, flag="--overlap-param-gather",
                                        help="stages 1-2: start the all-gather of the updated weights at the end "
                                             "of the step and wait for each bucket only when the next forward "
                                             "first reads one of its parameters")
    quantized_gradients: str = _field("off", choices=tuple(GRADIENT_FORMATS),
                                      help="send the data-parallel gradient reduction blockwise-quantized (an "
                                           "all-to-all, summed in fp32 by the receiver); int4 is what ZeRO++ "
                                           "sends")
    quantized_weights: str = _field("off", choices=tuple(WEIGHT_FORMATS),
                                    help="stages 1-3: all-gather the parameters blockwise-quantized; every rank "
                                         "computes with the same dequantized weights, the fp32 masters stay "
                                         "exact")
    two_level_reduce: bool = _field(False, help="reduce gradients inside each node first, then across nodes on "
                                                "the node's 1/l share (l: data-parallel ranks per node); only that "
                                                "share crosses nodes, and only it is quantized")
    quantization_block: int = _field(DEFAULT_BLOCK, ge=8, help="elements per quantization block (one fp32 scale "
                                                               "each); a multiple of 8")
    hpz_partition_size: int = _field(1, ge=1, help="stage 3: also keep the parameters sharded over this many "
                                                   "data-parallel ranks of one node (its ranks per node), so "
                                                   "backward re-gathers inside the node; 1: off")
    offload_optimizer: str = _field("none", choices=OFFLOAD_DEVICES, flag="--offload-optimizer",
                                    help="cpu: fp32 master weights and optimizer state in host memory, stepped "
                                         "by the CPU Adam (stages 1-3)")
    master_precision: str = _field("fp32", choices=MASTER_PRECISIONS, flag="--zero-master-precision",
                               help="the optimizer's master weights and its state (Adam's moments): fp32, or bf16 "
                                    "(opt-in, precision bf16 only: the bf16 parameters are their own masters and the "
                                    "moments are bf16, half the optimizer memory; each update is rounded to bf16, "
                                    "DeepSpeed's bf16_master_weights_and_grads with bf16_optimizer_states)")
    persistence_threshold: int = _field(100_000, ge=0, help="stage 3: parameters with at most this many elements "
                                                            "stay whole on every rank")
    max_live_parameters: int = _field(1_000_000_000, ge=1, help="stage 3: elements of gathered parameters held "
                                                                "at once")
    max_reuse_distance: int = _field(0, ge=0, help="stage 3: forward keeps a unit gathered, instead of releasing it, "
                                                   "when it is used again within this many gathered elements "
                                                   "(later in forward, or early in backward); below "
                                                   "prefetch_bucket_size the prefetch window decides instead")
    prefetch_bucket_size: int = _field(50_000_000, ge=0, help="stage 3: elements gathered ahead of the module "
                                                              "that needs them and not used yet (gathers in "
                                                              "flight and units forward kept included); forward "
                                                              "keeps a unit used again within them; 0 disables "
                                                              "prefetch and keeping")


@dataclasses.dataclass
class OptimizerConfig:
    """The inner optimizer that steps the fp32 master partitions."""

    type: str = _field("adamw", choices=OPTIMIZERS, flag="--optimizer",
                       help="adamw (decoupled weight decay), adam (L2 weight decay added to the gradient), sgd, "
                            "onebit_adam (AdamW, then 1-bit compressed momentum after optimizer.freeze_step) or "
                            "zero_one_adam (0/1 Adam: 1-bit exchanges, adaptive variance freezing, local steps) or "
                            "lamb (DeepSpeed's LAMB: Adam's direction scaled per parameter by ||w|| / ||update||, "
                            "clamped to [min_coeff, max_coeff]; ZeRO stages 0-2)")
    lr: float = _field(1e-3, gt=0.0, flag="--lr", help="peak learning rate (after warmup)")
    betas: Tuple[float, float] = _field(factory=lambda: (0.9, 0.999), flag="--adam-betas",
                                        help="Adam (beta1, beta2), each in [0, 1)",
                                        aliases=(Alias("--adam-beta1", index=0, help="Adam beta1 (optimizer.betas[0])"),
                                                 Alias("--adam-beta2", index=1,
                                                       help="Adam beta2 (optimizer.betas[1])")))
    eps: float = _field(1e-8, gt=0.0, flag="--adam-eps", help="Adam epsilon")
    bias_correction: bool = _field(True, help="adamw, adam, onebit_adam, lamb: divide the moments by 1 - beta^t (true), "
                                              "or step by lr * m / (sqrt(v) + eps) as they stand (false, DeepSpeed's "
                                              "optimizer.params.bias_correction: false)")
    weight_decay: float = _field(0.0, ge=0.0, flag="--weight-decay", help="weight decay coefficient")
    decoupled_lr: Optional[float] = _field(None, ge=0.0, flag="--decoupled-lr",
                                           help="Megatron-LM's: the input embedding and output layer weights' own "
                                                "peak learning rate, on the same schedule (warmup, decay) as lr; "
                                                "unset: they train at lr")
    decoupled_min_lr: Optional[float] = _field(None, ge=0.0, flag="--decoupled-min-lr",
                                               help="Megatron-LM's: their floor instead of scheduler.min_lr (with "
                                                    "decoupled_lr)")
    max_coeff: float = _field(10.0, gt=0.0, flag="--lamb-max-coeff",
                              help="lamb: the largest trust ratio ||w|| / ||update|| (DeepSpeed's max_coeff)")
    min_coeff: float = _field(0.01, ge=0.0, flag="--lamb-min-coeff",
                              help="lamb: the smallest trust ratio (DeepSpeed's min_coeff)")
    weight_decay_incr_style: str = _field("constant", choices=WD_INCR_STYLES, flag="--weight-decay-incr-style",
                                          help="constant, or how the weight decay grows from start_weight_decay "
                                               "to end_weight_decay over scheduler.weight_decay_incr_iters (or "
                                               "_samples): linear or cosine")
    start_weight_decay: Optional[float] = _field(None, ge=0.0, flag="--start-weight-decay",
                                                 help="weight decay of the first step (unset: weight_decay)")
    end_weight_decay: Optional[float] = _field(None, ge=0.0, flag="--end-weight-decay",
                                               help="weight decay from the end of the increment on (unset: "
                                                    "weight_decay)")
    momentum: float = _field(0.0, ge=0.0, lt=1.0, flag="--sgd-momentum", help="SGD momentum (sgd only)")
    freeze_step: int = _field(100_000, ge=1, help="onebit_adam: uncompressed AdamW steps before the variance "
                                                  "freezes and the momentum travels as 1-bit signs")
    var_freeze_step: int = _field(100_000, ge=1, help="zero_one_adam: the last step that may update the variance "
                                                      "(usually the end of the learning-rate warmup)")
    var_update_scaler: int = _field(16, ge=1, help="zero_one_adam: variance updates between doublings of their "
                                                   "interval")
    local_step_scaler: int = _field(32_678, ge=1, help="zero_one_adam: steps between doublings of the interval of "
                                                       "synchronizing local steps, after var_freeze_step")
    local_step_clipper: int = _field(16, ge=1, help="zero_one_adam: the longest interval of local steps")
    decay_1d_params: bool = _field(False, help="false: parameters with at most one dimension (biases, norm "
                                               "weights) get no weight decay; true: every parameter decays")

    @property
    def weight_decay_range(self) -> Tuple[float, float]:
        """(start, end) of the weight decay: start_weight_decay and end_weight_decay, each weight_decay when
        unset (a constant weight decay has start == end)."""
        start = self.weight_decay if self.start_weight_decay is None else self.start_weight_decay
        return start, self.weight_decay if self.end_weight_decay is None else self.end_weight_decay

    @property
    def decays(self) -> bool:
        """Whether any step applies weight decay."""
        return max(self.weight_decay_range) > 0


@dataclasses.dataclass
class SchedulerConfig:
    """The learning-rate schedule: optional warmup, then constant, linear, cosine, inverse-square-root or WSD
    (warmup-stable-decay) decay to ``min_lr``.

    It counts optimizer steps, or samples when any length is given in samples (:attr:`SAMPLE_KEYS`; each step
    then advances it by its global batch, so that a batch ramp-up warms up over the same data).
    """

    type: str = _field("constant", choices=DECAY_STYLES, flag="--lr-decay-style",
                       help="decay style after warmup (WSD: hold the peak, then anneal over the last "
                            "wsd_decay_iters or wsd_decay_samples before the decay length)")
    warmup_iters: int = _field(0, ge=0, flag="--lr-warmup-iters",
                               help="optimizer steps of warmup from warmup_start_lr to optimizer.lr")
    warmup_samples: Optional[int] = _field(None, ge=0, flag="--lr-warmup-samples",
                                           help="samples of warmup instead of warmup_iters (a schedule in samples)")
    warmup_fraction: Optional[float] = _field(None, gt=0.0, lt=1.0, flag="--lr-warmup-fraction",
                                              help="warm up over this fraction of the decay length (decay_iters "
                                                   "or decay_samples) instead, rounded to whole steps or samples")
    warmup_style: str = _field("linear", choices=WARMUP_STYLES, flag="--lr-warmup-style",
                               help="linear, or log (the warmup of DeepSpeed's default warmup_type)")
    warmup_start_lr: float = _field(0.0, ge=0.0, flag="--lr-warmup-init", help="learning rate at the first warmup "
                                                                               "step")
    decay_iters: Optional[int] = _field(None, ge=1, flag="--lr-decay-iters",
                                        help="optimizer step at which decay reaches min_lr, counted from the start "
                                             "(warmup included); needed by linear, cosine and wsd (the trainer "
                                             "derives it from run.train_iters when unset)")
    decay_samples: Optional[int] = _field(None, ge=1, flag="--lr-decay-samples",
                                          help="consumed samples at which decay reaches min_lr, instead of "
                                               "decay_iters (the trainer derives it from run.train_samples when "
                                               "unset)")
    warmup_tokens: Optional[int] = _field(None, ge=0, flag="--lr-warmup-tokens",
                                          help="Megatron-DeepSpeed's warmup in consumed tokens: the trainer reads it "
                                               "as warmup_samples, tokens / model.seq_length to the nearest sample")
    decay_tokens: Optional[int] = _field(None, ge=1, flag="--lr-decay-tokens",
                                         help="Megatron-DeepSpeed's decay length in consumed tokens: the trainer reads "
                                              "it as decay_samples, tokens / model.seq_length to the nearest sample")
    min_lr: float = _field(0.0, ge=0.0, flag="--min-lr", help="learning rate at and after decay_iters")
    wsd_decay_style: str = _field("exponential", choices=WSD_DECAY_STYLES, flag="--lr-wsd-decay-style",
                                  help="WSD: the shape of the final anneal from the peak to min_lr")
    wsd_decay_iters: Optional[int] = _field(None, ge=1, flag="--lr-wsd-decay-iters",
                                            help="WSD: optimizer steps of the final anneal, which ends at the decay "
                                                 "length (the peak holds from the warmup's end until it starts)")
    wsd_decay_samples: Optional[int] = _field(None, ge=1, flag="--lr-wsd-decay-samples",
                                              help="WSD: samples of the final anneal instead of wsd_decay_iters (a "
                                                   "schedule in samples)")
    weight_decay_incr_iters: Optional[int] = _field(None, ge=1, flag="--weight-decay-incr-iters",
                                                    help="optimizer steps over which a linear or cosine weight "
                                                         "decay increment reaches optimizer.end_weight_decay (the "
                                                         "trainer derives it from run.train_iters when unset)")
    weight_decay_incr_samples: Optional[int] = _field(None, ge=1, flag="--weight-decay-incr-samples",
                                                      help="samples of the increment instead (a schedule in "
                                                           "samples; the trainer derives it from run.train_samples)")

    # the schedule's lengths, each a key {name}_iters and a key {name}_samples (warmup first: warmup_iters is the
    # one length whose unset value is 0, not None)
    LENGTHS: ClassVar[Tuple[str, ...]] = ("warmup", "decay", "wsd_decay", "weight_decay_incr")
    STEP_KEYS: ClassVar[Tuple[str, ...]] = tuple(f"{name}_iters" for name in LENGTHS)
    SAMPLE_KEYS: ClassVar[Tuple[str, ...]] = tuple(f"{name}_samples" for name in LENGTHS)

    @property
    def decays(self) -> bool:
        """Whether the rate decays after warmup."""
        return self.type != "constant"

    @property
    def given_in_steps(self) -> bool:
        """Whether a length in optimizer steps is set (one of :attr:`STEP_KEYS`)."""
        return self.warmup_iters != 0 or any(getattr(self, k) is not None for k in self.STEP_KEYS[1:])

    @property
    def in_samples(self) -> bool:
        """Whether the schedule counts samples rather than optimizer steps."""
        return any(getattr(self, k) is not None for k in self.SAMPLE_KEYS)

    @property
    def unit(self) -> str:
        """What the schedule counts: ``"samples"`` or ``"steps"``."""
        return "samples" if self.in_samples else "steps"

    @property
    def decay_ends(self) -> bool:
        """Whether the decay reaches ``min_lr`` at the decay length (:data:`DECAY_STYLES_WITH_END`)."""
        return self.type in DECAY_STYLES_WITH_END

    @property
    def needs_decay_length(self) -> bool:
        """Whether the decay length must be known: a decay that ends there, or a warmup given as its fraction."""
        return self.decay_ends or self.warmup_fraction is not None

    @property
    def decay_length(self) -> Optional[int]:
        """Where decay reaches ``min_lr``, in :attr:`unit`: ``decay_samples`` or ``decay_iters``."""
        return self._length("decay")

    @property
    def warmup_length(self) -> int:
        """The warmup's length in :attr:`unit`: ``warmup_samples`` or ``warmup_iters``, or ``warmup_fraction`` of
        :attr:`decay_length` rounded to the nearest whole one (validation makes sure that is set then)."""
        if self.warmup_fraction is not None:
            return round(self.warmup_fraction * self.decay_length)
        return (self.warmup_samples or 0) if self.in_samples else self.warmup_iters

    @property
    def weight_decay_incr_length(self) -> Optional[int]:
        """The weight decay increment's length in :attr:`unit`: ``weight_decay_incr_samples`` or ``_iters``."""
        return self._length("weight_decay_incr")

    @property
    def wsd_length(self) -> Optional[int]:
        """WSD's anneal length in :attr:`unit`: ``wsd_decay_samples`` or ``wsd_decay_iters``."""
        return self._length("wsd_decay")

    def length_key(self, name: str) -> str:
        """The key of length ``name`` (one of :attr:`LENGTHS`) in :attr:`unit`: ``{name}_samples`` or
        ``{name}_iters``."""
        return f"{name}_{'samples' if self.in_samples else 'iters'}"

    def _length(self, name: str) -> Optional[int]:
        return getattr(self, self.length_key(name))


@dataclasses.dataclass
class PipelineConfig:
    """Pipeline parallelism (``hybrid.pipeline``): stages, their layers and the schedule."""

    size: Optional[int] = _field(None, ge=1, flag="--pipeline-model-parallel-size",
                                 help="pipeline stages per model replica (outermost in the rank order, so "
                                      "neighbouring stages sit on different nodes); unset: the topology's, 1 when "
                                      "hybrid builds it")
    schedule: str = _field("1f1b", choices=PIPELINE_SCHEDULES, flag="--pipeline-schedule",
                           help="1f1b (memory-bounded), gpipe (all forwards, then all backwards) or interleaved "
                                "(virtual stages; set layers_per_virtual_stage)")
    layers_per_virtual_stage: Optional[int] = _field(None, ge=1, flag="--num-layers-per-virtual-pipeline-stage",
                                                     help="interleaved schedule: layers per model chunk; each "
                                                          "stage then holds num_layers / (size x this) chunks")
    layers_per_stage: Optional[List[int]] = _field(None, help="explicit layers of every pipeline part (stage, or "
                                                              "model chunk when interleaved), in order; default: "
                                                              "the balanced split (docs/pipeline.md)")


@dataclasses.dataclass
class TensorBoardConfig:
    """The engine's own TensorBoard scalars per optimizer step, written by global rank 0 only.

    The trainer's monitor writes its richer set to ``logging.tensorboard_dir`` instead.
    """

    enabled: bool = _field(False, help="write the engine's per-step TensorBoard scalars")
    output_path: str = _field("runs", help="directory that holds the job directories")
    job_name: str = _field("hybrid", help="events go to output_path/job_name")


# ---- the root -------------------------------------------------------------------------------------

@dataclasses.dataclass
class HybridConfig:
    """Every setting of a run: what :func:`hybrid.initialize` reads, and the trainer's own sections."""

    precision: str = _field("fp32", choices=PRECISIONS,
                            help="training precision of the model's parameters and activations; master weights "
                                 "are always fp32",
                            aliases=(Alias("--bf16", const="bf16", help="precision bf16: bf16 parameters and "
                                                                        "activations, fp32 master weights"),
                                     Alias("--fp16", const="fp16", help="precision fp16: fp16 parameters and "
                                                                        "activations with loss scaling, fp32 "
                                                                        "master weights")))
    autocast: bool = _field(False, help="false: the engine casts an fp32 model to the low precision (the ZeRO "
                                        "mixed-precision path); true: parameters stay fp32 and forward runs "
                                        "under torch.autocast")
    loss_scaling: LossScalingConfig = _section(LossScalingConfig, "fp16 loss scaling")
    zero: ZeroConfig = _section(ZeroConfig, "ZeRO optimizer")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "inner optimizer")
    scheduler: SchedulerConfig = _section(SchedulerConfig, "learning-rate schedule")
    clip_grad: float = _field(0.0, ge=0.0, help="clip the global gradient L2 norm to this value; 0 disables")
    calculate_per_token_loss: bool = _field(False, help="the loss is the global batch's summed token losses "
                                                        "over its count of unmasked tokens (Megatron-LM's), not "
                                                        "the mean of each micro-batch's per-token mean: micro-"
                                                        "batches with more unmasked tokens (--eod-mask-loss) "
                                                        "weigh more")
    micro_batch_size: Optional[int] = _field(None, ge=1, help="samples per data-parallel rank per micro-step")
    gradient_accumulation_steps: Optional[int] = _field(None, ge=1, help="micro-steps per optimizer step")
    global_batch_size: Optional[int] = _field(None, ge=1, help="samples per optimizer step over all "
                                                              "data-parallel ranks")
    rampup_batch_size: Optional[Tuple[int, int, int]] = _field(
        None, ge=1, help="START INCREMENT SAMPLES: ramp the global batch up from START by INCREMENT to "
                         "global_batch_size, in equal steps over the first SAMPLES samples (the micro batch stays; "
                         "the accumulation count follows)")
    step_batch_size_schedule: List[str] = _field(
        factory=list, help="THRESHOLD:SIZE ... (Megatron-LM's): the global batch is SIZE from THRESHOLD consumed "
                           "tokens on (samples x model.seq_length; suffixes K, M, B, T), the first THRESHOLD 0; "
                           "global_batch_size is the last SIZE (the micro batch stays; the accumulation count "
                           "follows)")
    tensor_parallel_size: Optional[int] = _field(None, ge=1, flag="--tensor-model-parallel-size",
                                                 help="TP ranks per model replica (adjacent ranks); unset: the "
                                                      "topology's, 1 when hybrid builds it")
    expert_parallel_size: Optional[int] = _field(None, ge=1, flag="--expert-model-parallel-size",
                                                 help="expert-parallel ranks: the consecutive data-parallel ranks "
                                                      "that share out the experts of every MoE layer (it must "
                                                      "divide the data-parallel size, and --num-experts by it); "
                                                      "unset: the topology's, 1 when hybrid builds it")
    context_parallel_size: Optional[int] = _field(None, ge=1, flag="--context-parallel-size",
                                                  help="context-parallel ranks: each sequence is split over them "
                                                       "(two chunks per rank, load-balanced for causal attention; "
                                                       "--cp-comm-type chooses the attention); unset: the "
                                                       "topology's, 1 when hybrid builds it")
    pipeline: PipelineConfig = _section(PipelineConfig, "pipeline parallelism")
    recompute: str = _field("none", choices=RECOMPUTE, flag="--recompute-granularity",
                            help="activation recomputation of the model (model_zoo models): none, full (every "
                                 "layer) or selective (attention core)",
                            aliases=(Alias("--recompute-activations", const="selective", weak=True,
                                           help="recompute activations: selective unless --recompute-granularity "
                                                "is given"),))
    tensorboard: TensorBoardConfig = _section(TensorBoardConfig, "the engine's TensorBoard scalars")
    seed: int = _field(1234, ge=0, le=2**32 - 1,
                       help="random seed (model init, data order, dropout); the trainer seeds Python's random, NumPy's "
                            "global generator and torch with it before building the model")
    steps_per_print: int = _field(10, ge=0, help="the engine logs a progress line (logger 'hybrid.engine', rank 0) "
                                                "every this many optimizer steps; 0 disables")
    use_fused_kernels: bool = _field(True, flag="--fused-kernels",
                                     help="use hybrid's fused optimizer (Adam) kernels when they are built; the other compiled ops "
                                          "follow HYBRID_KERNELS (off: none)")
    # trainer sections
    model: ModelConfig = _section(ModelConfig, "model (trainer)")
    data: DataConfig = _section(DataConfig, "data (trainer)")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "checkpoints (trainer)")
    run: RunConfig = _section(RunConfig, "run length and early exit (trainer)")
    eval: EvalConfig = _section(EvalConfig, "evaluation (trainer)")
    logging: LoggingConfig = _section(LoggingConfig, "logging (trainer)")
    distributed: DistributedConfig = _section(DistributedConfig, "process group (trainer)")

    # ---- conveniences: only those this module's layer can serve. Parsing, overrides and the plain dict live in
    # hybrid.config.parse (config_from_dict, apply_overrides, to_plain): they validate, and validation reads
    # this schema, so a method here calling them would close an import cycle.
    def model_seq_length(self) -> Optional[int]:
        """The model's training sequence length: ``model.seq_length``, else its preset's; None when neither is
        known (an unknown preset has its own error)."""
        if self.model.seq_length is not None or self.model.preset is None:
            return self.model.seq_length
        from model_zoo.presets import get_preset

        try:
            return get_preset(self.model.preset).seq_length
        except ValueError:
            return None

    def batch_steps(self):
        """``step_batch_size_schedule`` as ``(from samples, size)`` pairs (its thresholds are tokens: read with the
        model's sequence length, ``model.seq_length`` or its preset's), or None when unset."""
        from hybrid.config.batch import parse_step_schedule
        from hybrid.config.errors import ConfigError
        from hybrid.config.flags import key_error

        if not self.step_batch_size_schedule:
            return None
        try:
            return parse_step_schedule(self.step_batch_size_schedule, self.model_seq_length())
        except ConfigError as err:
            raise key_error(type(self), err.message, *err.keys) from None

    def resolve_batch(self, dp_size: int):
        """Micro batch, accumulation steps and global batch for ``dp_size`` data-parallel ranks.

        See :func:`hybrid.config.batch.resolve_batch`.
        """
        from hybrid.config.batch import resolve_batch
        from hybrid.config.errors import ConfigError
        from hybrid.config.flags import key_error

        try:
            return resolve_batch(self.micro_batch_size, self.gradient_accumulation_steps,
                                 self.global_batch_size, dp_size, self.rampup_batch_size, self.batch_steps())
        except ConfigError as err:
            raise key_error(type(self), err.message, *err.keys) from None
