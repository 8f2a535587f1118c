"""The typed configuration of a hybrid training run: one tree, :class:`HybridConfig`.

Every key, its type and its one default live here. Each field's ``metadata``
holds what the rest of the package derives from it:

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
from typing import Any, Callable, ClassVar, List, Optional, Tuple

from hybrid.compression import DEFAULT_BLOCK, GRADIENT_FORMATS, ONEBIT_ADAM, WEIGHT_FORMATS, ZERO_ONE_ADAM
from hybrid.layout import OFFLOAD_DEVICES, PRECISIONS, ZERO_STAGES
from hybrid.tokenizer_files import TOKENIZER_TYPES, TokenizerSpec

# Choice lists owned by the configuration (the ZeRO stages, offload devices and
# precisions are hybrid.layout's). hybrid.optim.lr_schedule imports the styles.
OPTIMIZERS = ("adamw", "adam", "sgd", ONEBIT_ADAM, ZERO_ONE_ADAM)
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "wsd")
# The styles that reach min_lr at a set length (the decay length); inverse-square-root decays without end.
DECAY_STYLES_WITH_END = ("linear", "cosine", "wsd")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")  # the shape of WSD's final anneal
WARMUP_STYLES = ("linear", "log")
WD_INCR_STYLES = ("constant", "linear", "cosine")  # how the weight decay grows from its start to its end
RECOMPUTE = ("none", "full", "selective")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved")  # hybrid.pipeline.schedule maps each to its module
# What a resumed run does with the checkpoint's learning-rate and weight-decay schedule settings: refuse ones that
# differ from the configured ones, keep the configured ones at the saved position, or take the saved ones.
SCHEDULE_ON_LOAD = ("check", "configured", "saved")

__all__ = ["HybridConfig", "ZeroConfig", "OptimizerConfig", "SchedulerConfig", "LossScalingConfig",
           "TensorBoardConfig", "ModelConfig", "DataConfig", "CheckpointConfig", "RunConfig", "EvalConfig",
           "LoggingConfig", "DistributedConfig", "Alias", "OPTIMIZERS", "DECAY_STYLES", "DECAY_STYLES_WITH_END",
           "WSD_DECAY_STYLES", "WARMUP_STYLES", "WD_INCR_STYLES",
           "RECOMPUTE", "PIPELINE_SCHEDULES", "SCHEDULE_ON_LOAD", "PipelineConfig", "ZERO_STAGES", "OFFLOAD_DEVICES", "PRECISIONS"]


@dataclasses.dataclass(frozen=True)
class Alias:
    """Another command-line spelling of one key (see :mod:`hybrid.config.flags`).

    Exactly one of these shapes:

    * ``const``: a switch without a value that sets the key to ``const``
      (``--bf16`` sets ``precision`` to ``bf16``). A ``weak`` switch applies only
      when nothing else set the key (``--recompute-activations`` means
      selective unless ``--recompute-granularity`` is given);
    * ``index``: the flag sets one element of a tuple key (``--adam-beta2``);
    * ``convert``: the flag takes a value in its own unit, which ``convert``
      maps to the key's (``--initial-loss-scale 65536`` is power 16); it raises
      ``ValueError`` for a value it cannot map.

    ``compat``: a spelling kept so that Megatron-LM launch scripts run as they are
    (``--use-distributed-optimizer``); error notes and docs/config.md's flag
    column name the key's own flags instead (docs/training.md lists these).
    """

    flag: str
    help: str
    const: Any = None
    weak: bool = False
    index: Optional[int] = None
    convert: Optional[Callable[[Any], Any]] = None
    compat: bool = False

    @property
    def is_switch(self) -> bool:
        return self.index is None and self.convert is None


def _field(default=dataclasses.MISSING, *, help: str, factory=dataclasses.MISSING, flag: Optional[str] = None,
           aliases: Tuple[Alias, ...] = (), **constraints):
    meta = {"help": help, "aliases": tuple(aliases), **constraints}
    if flag is not None:
        meta["flag"] = flag
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _section(cls, help: str):
    """A nested section; ``help`` titles its group in ``--help``."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": True})


def scale_to_power(value: Any) -> int:
    """``--initial-loss-scale`` (a power of two, e.g. 65536) as ``loss_scaling.initial_scale_power`` (16)."""
    scale = float(value)
    if not (math.isfinite(scale) and scale >= 1 and math.log2(scale).is_integer()):
        raise ValueError(f"must be a power of two (2**k, k >= 0), got {value!r}")
    return int(math.log2(scale))


def read_data_args(path: Any) -> List[str]:
    """``--data-args-path FILE``: the words of FILE, ``data.path``'s value (a blend too long for a command line)."""
    try:
        with open(str(path), encoding="utf-8") as f:
            words = f.read().split()
    except OSError as e:
        raise ValueError(f"cannot read it: {e.strerror}") from None
    if not words:
        raise ValueError("the file is empty; it holds the data prefixes, optionally weighted ('0.3 A 0.7 B')")
    return words


# ---- engine sections ------------------------------------------------------------------------------

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
                            "zero_one_adam (0/1 Adam: 1-bit exchanges, adaptive variance freezing, local steps)")
    lr: float = _field(1e-3, gt=0.0, flag="--lr", help="peak learning rate (after warmup)")
    betas: Tuple[float, float] = _field(factory=lambda: (0.9, 0.999), flag="--adam-betas",
                                        help="Adam (beta1, beta2), each in [0, 1)",
                                        aliases=(Alias("--adam-beta1", index=0, help="Adam beta1 (optimizer.betas[0])"),
                                                 Alias("--adam-beta2", index=1,
                                                       help="Adam beta2 (optimizer.betas[1])")))
    eps: float = _field(1e-8, gt=0.0, flag="--adam-eps", help="Adam epsilon")
    weight_decay: float = _field(0.0, ge=0.0, flag="--weight-decay", help="weight decay coefficient")
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


# ---- trainer sections -----------------------------------------------------------------------------
# The engine ignores these (but checkpoint.async_save*); hybrid-train reads them. Choices of model settings
# (position embedding types, norms) are model_zoo's and checked by its GPTConfig.

@dataclasses.dataclass
class ModelConfig:
    """The model_zoo GPT the trainer builds: a preset, and/or shape settings that override it."""

    preset: Optional[str] = _field(None, flag="--model", help="a model_zoo preset (e.g. tiny, gpt2-small, "
                                                              "turing-nlg-17b); the shape settings override it")
    num_layers: Optional[int] = _field(None, ge=1, flag="--num-layers", help="transformer layers")
    hidden_size: Optional[int] = _field(None, ge=1, flag="--hidden-size", help="hidden size")
    num_attention_heads: Optional[int] = _field(None, ge=1, flag="--num-attention-heads", help="attention heads")
    num_query_groups: Optional[int] = _field(None, ge=1, flag="--num-query-groups",
                                             help="key/value heads shared by the query heads (grouped-query "
                                                  "attention; 1: multi-query; unset: one per attention head)")
    ffn_hidden_size: Optional[int] = _field(None, ge=1, flag="--ffn-hidden-size",
                                            help="MLP hidden size (unset: 4h, or the SwiGLU rule)")
    seq_length: Optional[int] = _field(None, ge=1, flag="--seq-length", help="training sequence length")
    max_position_embeddings: Optional[int] = _field(None, ge=1, flag="--max-position-embeddings",
                                                    help="learned position table size")
    vocab_size: Optional[int] = _field(None, ge=1, flag="--vocab-size",
                                       help="vocabulary size (unset: the tokenizer's)")
    position_embedding_type: Optional[str] = _field(None, flag="--position-embedding-type",
                                                    help="learned or rope (Megatron's learned_absolute: learned)",
                                                    aliases=(Alias("--use-rotary-position-embeddings", const="rope",
                                                                   compat=True, help="Megatron-LM's older spelling of "
                                                                                     "--position-embedding-type "
                                                                                     "rope"),))
    normalization: Optional[str] = _field(None, flag="--normalization", help="layernorm or rmsnorm (any case: "
                                                                             "Megatron's LayerNorm, RMSNorm)")
    norm_epsilon: Optional[float] = _field(None, gt=0.0, flag="--norm-epsilon", help="epsilon of LayerNorm/RMSNorm")
    rotary_base: Optional[float] = _field(None, gt=0.0, flag="--rotary-base",
                                          help="base (theta) of rotary position embeddings")
    rope_scaling: Optional[str] = _field(None, flag="--rope-scaling",
                                         help="RoPE frequency scaling: none, linear or llama3 (Llama 3.1's rule)")
    rope_scaling_factor: Optional[float] = _field(None, gt=0.0, flag="--rope-scaling-factor",
                                                  help="divisor of the scaled RoPE frequencies")
    rope_low_freq_factor: Optional[float] = _field(None, gt=0.0, flag="--rope-low-freq-factor",
                                                   help="llama3 scaling: wavelengths past original/this are scaled")
    rope_high_freq_factor: Optional[float] = _field(None, gt=0.0, flag="--rope-high-freq-factor",
                                                    help="llama3 scaling: wavelengths below original/this are kept")
    rope_original_max_positions: Optional[int] = _field(None, ge=1, flag="--rope-original-max-positions",
                                                        help="llama3 scaling: the original context length")
    swiglu: bool = _field(False, flag="--swiglu", help="SwiGLU MLP instead of GELU")
    add_qkv_bias: bool = _field(False, flag="--add-qkv-bias",
                                help="a bias on the q/k/v projection even with --disable-bias-linear (Qwen2)")
    disable_bias_linear: bool = _field(False, flag="--disable-bias-linear", help="no biases in linear layers")
    untie_embeddings_and_output_weights: bool = _field(False, flag="--untie-embeddings-and-output-weights",
                                                       help="separate output layer weights")
    hidden_dropout: Optional[float] = _field(None, ge=0.0, lt=1.0, flag="--hidden-dropout",
                                             help="dropout on embeddings and residual branches")
    attention_dropout: Optional[float] = _field(None, ge=0.0, lt=1.0, flag="--attention-dropout",
                                                help="dropout on attention probabilities")
    init_method_std: Optional[float] = _field(None, gt=0.0, flag="--init-method-std",
                                              help="standard deviation of the weight initialisation")
    sequence_parallel: bool = _field(False, flag="--sequence-parallel",
                                     help="shard norm and dropout activations along the sequence over TP")

    # How the model is trained and computed, not what it is: checkpoint.use_checkpoint_args leaves them alone.
    TRAINING_KEYS: ClassVar[Tuple[str, ...]] = ("hidden_dropout", "attention_dropout", "sequence_parallel")


@dataclasses.dataclass
class DataConfig:
    """The training data."""

    path: List[str] = _field(factory=list, help="data prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'",
                             aliases=(Alias("--data-args-path", convert=read_data_args,
                                            help="a file holding data.path's prefixes and weights, separated by "
                                                 "whitespace (Megatron-LM's flag, for a blend too long for a "
                                                 "command line)", compat=True),))
    train_path: List[str] = _field(factory=list, flag="--train-data-path",
                                   help="training data of its own (prefixes, optionally weighted), instead of "
                                        "data.path divided by data.split")
    valid_path: List[str] = _field(factory=list, flag="--valid-data-path",
                                   help="validation data of its own, with data.train_path")
    test_path: List[str] = _field(factory=list, flag="--test-data-path",
                                  help="test data of its own, with data.train_path: evaluated once, at the end "
                                       "of training (and by run.skip_train)")
    split: str = _field("969,30,1", flag="--split",
                        help="train,valid,test proportions of data.path (a test share holding too few tokens for "
                             "one sample is skipped, with a note)")
    tokenizer_type: Optional[str] = _field(None, choices=TOKENIZER_TYPES, flag="--tokenizer-type",
                                           help="SentencePieceTokenizer (reads tokenizer_model), GPT2BPETokenizer "
                                                "(reads vocab_file and merge_file) or HuggingFaceTokenizer (reads "
                                                "tokenizer_model: a model folder's tokenizer.json); unset: "
                                                "GPT2BPETokenizer when vocab_file or merge_file is given, else "
                                                "SentencePieceTokenizer")
    tokenizer_model: Optional[str] = _field(None, flag="--tokenizer-model",
                                            help="SentencePiece model, or the model folder of a "
                                                 "HuggingFaceTokenizer (for the vocabulary size and the EOD id)")
    vocab_file: Optional[str] = _field(None, flag="--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: Optional[str] = _field(None, flag="--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    eod_mask_loss: bool = _field(False, flag="--eod-mask-loss",
                                 help="do not train on predicting the token after an end-of-document")
    reset_position_ids: bool = _field(False, flag="--reset-position-ids",
                                      help="restart the position ids after each end-of-document token of a sample "
                                           "(attention still spans the documents packed into it)")
    mock: bool = _field(False, flag="--mock-data", help="random tokens instead of data.path (benchmarks, smoke "
                                                        "tests)")
    cache_path: Optional[str] = _field(None, flag="--data-cache-path",
                                       help="directory for the sample-index cache (unset: index-cache/ beside the "
                                            "data, or, when that is not writable, hybrid/index-cache/ under the "
                                            "user's cache directory, else the temporary directory, with a "
                                            "notice); every rank must see the same directory")

    PATH_KEYS: ClassVar[Tuple[str, ...]] = ("path", "train_path", "valid_path", "test_path")  # name data files
    EOD_KEYS: ClassVar[Tuple[str, ...]] = ("eod_mask_loss", "reset_position_ids")  # read the end-of-document id

    @property
    def tokenizer(self) -> TokenizerSpec:
        """The tokenizer these settings name (:class:`~hybrid.tokenizer_files.TokenizerSpec`)."""
        return TokenizerSpec(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file)


@dataclasses.dataclass
class CheckpointConfig:
    """Where checkpoints go and come from, and how they are written.

    The engine reads ``async_save`` and ``async_save_chunk_mb`` (for
    :meth:`hybrid.engine.Engine.save_checkpoint`); the rest is the trainer's.
    """

    save: Optional[str] = _field(None, flag="--save", help="directory to save checkpoints in")
    load: Optional[str] = _field(None, flag="--load", help="directory (its 'latest') or DIR/iter_N to resume from")
    exit_on_missing_checkpoint: bool = _field(False, flag="--exit-on-missing-checkpoint",
                                              help="stop with an error when checkpoint.load holds no checkpoint, "
                                                   "instead of starting from scratch")
    save_interval: Optional[int] = _field(None, ge=1, flag="--save-interval", help="save every this many steps")
    keep_last: Optional[int] = _field(None, ge=1, flag="--keep-last", help="keep only the newest K checkpoints")
    finetune: bool = _field(False, flag="--finetune",
                            help="load weights only: new optimizer, schedule and data position")
    use_checkpoint_args: bool = _field(False, flag="--use-checkpoint-args",
                                       help="take the model settings (the model section) that neither a flag nor "
                                            "--config gives from the checkpoint checkpoint.load names, as it was "
                                            "trained")
    override_opt_param_scheduler: bool = _field(
        False, flag="--override-opt-param-scheduler",
        help="on load, keep the configured LR and weight-decay schedule settings (e.g. a longer run.train_iters) at "
             "the saved position",
        aliases=(Alias("--override-opt_param-scheduler", const=True, compat=True,
                       help="Megatron-LM's spelling of checkpoint.override_opt_param_scheduler true"),))
    use_checkpoint_opt_param_scheduler: bool = _field(
        False, flag="--use-checkpoint-opt-param-scheduler",
        help="on load, take the checkpoint's LR and weight-decay schedule settings instead of the configured ones",
        aliases=(Alias("--use-checkpoint-opt_param-scheduler", const=True, compat=True,
                       help="Megatron-LM's spelling of checkpoint.use_checkpoint_opt_param_scheduler true"),))
    async_save: bool = _field(False, flag="--async-save",
                              help="save in the background: training waits only while each rank's state is copied "
                                   "to host memory (one copy of it); a thread writes, fsyncs and checksums it, and "
                                   "latest moves at the first step after every rank has written; at most one save "
                                   "in flight. Also read by the engine's save_checkpoint")
    async_save_chunk_mb: Optional[int] = _field(None, ge=1, flag="--async-save-chunk-mb",
                                                help="with async_save: copy at most this many MiB per rank; the "
                                                     "files (model shard, optimizer partition) that do not fit are "
                                                     "written from the live state while training waits (unset: "
                                                     "copy everything)")

    @property
    def schedule_on_load(self) -> str:
        """What a resumed run does with the checkpoint's schedule settings (one of :data:`SCHEDULE_ON_LOAD`)."""
        if self.override_opt_param_scheduler:
            return "configured"
        return "saved" if self.use_checkpoint_opt_param_scheduler else "check"


@dataclasses.dataclass
class RunConfig:
    """How long the trainer runs, and when it stops early."""

    train_iters: Optional[int] = _field(None, ge=1, flag="--train-iters",
                                        help="optimizer steps to train for (the trainer needs it or train_samples)")
    train_samples: Optional[int] = _field(None, ge=1, flag="--train-samples",
                                          help="samples to train on instead of train_iters: every whole global "
                                               "batch that fits (a batch ramp-up included); the learning-rate "
                                               "schedule then counts samples too")
    exit_interval: Optional[int] = _field(None, ge=1, flag="--exit-interval",
                                          help="save and exit once the step count is a multiple of this")
    exit_duration_in_mins: Optional[float] = _field(None, gt=0.0, flag="--exit-duration-in-mins",
                                                    help="save and exit after this many minutes")
    skip_train: bool = _field(False, flag="--skip-train",
                              help="train no step: evaluate the model (checkpoint.load's weights, at their "
                                   "iteration) on the validation and test data, save nothing and exit")
    max_consecutive_skipped_steps: int = _field(
        100, ge=0, flag="--max-consecutive-skipped-steps",
        help="stop with an error after this many consecutive iterations whose optimizer step was skipped "
             "(non-finite gradients) or whose loss was not finite; 0 never stops. The default stays above what "
             "dynamic fp16 loss scaling skips while its scale falls at start-up (one step per halving, plus "
             "hysteresis - 1: at most 17 from the default 2**16, 65 from the largest, 2**64)")


@dataclasses.dataclass
class EvalConfig:
    """Validation during training, and the test evaluation at its end.

    Each evaluation reads the same ``iters`` global batches of its split.
    """

    interval: int = _field(1000, ge=0, help="evaluate on the validation split every this many steps, and at the "
                                            "end of training (0 disables validation)")
    iters: int = _field(10, ge=0, help="global batches per evaluation, validation or test (0: no evaluation)")

    @property
    def validates(self) -> bool:
        """Whether the run evaluates on validation data (and so needs some)."""
        return self.interval > 0 and self.iters > 0


@dataclasses.dataclass
class LoggingConfig:
    """The trainer's monitor: console lines and TensorBoard events."""

    log_interval: int = _field(100, ge=1, flag="--log-interval", help="print and log metrics every this many steps")
    tensorboard_dir: Optional[str] = _field(None, flag="--tensorboard-dir",
                                            help="the trainer's monitor writes TensorBoard event files here")
    peak_tflops: Optional[float] = _field(None, gt=0.0, flag="--peak-tflops",
                                          help="per-device peak TFLOP/s for MFU (unset: known GPU table, or a "
                                               "matmul probe on CPU)")
    log_params_norm: bool = _field(False, flag="--log-params-norm",
                                   help="report the L2 norm of the whole model's weights every iteration (one more "
                                        "pass over the master weights and a scalar all-reduce per step)")
    log_num_zeros_in_grad: bool = _field(False, flag="--log-num-zeros-in-grad",
                                         help="report how many elements of each step's gradient are exactly zero "
                                              "(one more pass over the gradient per step)")


@dataclasses.dataclass
class DistributedConfig:
    """The process group."""

    timeout_minutes: float = _field(10.0, gt=0.0, help="a collective that waits longer than this fails")
    allow_tp_across_nodes: bool = _field(False, flag="--allow-tp-across-nodes", help="accept tensor-parallel groups that span nodes (ranks per "
                                                     "node from torchrun's LOCAL_WORLD_SIZE); refused otherwise, "
                                                     "since every layer's collectives would cross the "
                                                     "inter-node link")


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
    micro_batch_size: Optional[int] = _field(None, ge=1, help="samples per data-parallel rank per micro-step")
    gradient_accumulation_steps: Optional[int] = _field(None, ge=1, help="micro-steps per optimizer step")
    global_batch_size: Optional[int] = _field(None, ge=1, help="samples per optimizer step over all "
                                                              "data-parallel ranks")
    rampup_batch_size: Optional[Tuple[int, int, int]] = _field(
        None, ge=1, help="START INCREMENT SAMPLES: ramp the global batch up from START by INCREMENT to "
                         "global_batch_size, in equal steps over the first SAMPLES samples (the micro batch stays; "
                         "the accumulation count follows)")
    tensor_parallel_size: Optional[int] = _field(None, ge=1, flag="--tensor-model-parallel-size",
                                                 help="TP ranks per model replica (adjacent ranks); unset: the "
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

    # ---- conveniences (defined in sibling modules; bound here so users need one import) ----
    @classmethod
    def from_dict(cls, data) -> "HybridConfig":
        """Build and validate from a native (non-DeepSpeed) nested mapping."""
        from hybrid.config.parse import parse_native

        return parse_native(data, cls)

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
        from hybrid.config.errors import ConfigError
        from hybrid.config.flags import key_error

        try:
            return resolve_batch(self.micro_batch_size, self.gradient_accumulation_steps,
                                 self.global_batch_size, dp_size, self.rampup_batch_size)
        except ConfigError as err:
            raise key_error(type(self), err.message, *err.keys) from None
