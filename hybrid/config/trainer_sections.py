"""The sections of the config tree only the trainer (``hybrid-train``) reads: ``model``, ``data``,
``checkpoint``, ``run``, ``eval``, ``logging`` and ``distributed`` (see :mod:`hybrid.config.schema`, whose
:class:`~hybrid.config.schema.HybridConfig` holds them beside the engine's sections).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, List, Optional, Tuple

from hybrid.config.fields import Alias
from hybrid.config.fields import field as _field
from hybrid.config.flags import flat_name, own_flag
from hybrid.tokenizer_files import TIKTOKEN_PATTERNS, TOKENIZER_TYPES, TokenizerSpec
from model_zoo.config import TRAINING, GPTConfig

# What a resumed run does with the checkpoint's learning-rate and weight-decay schedule settings: refuse ones that
# differ from the configured ones, keep the configured ones at the saved position, or take the saved ones.
SCHEDULE_ON_LOAD = ("check", "configured", "saved")


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


# The engine ignores these (but checkpoint.async_save*); hybrid-train reads them. Choices of model settings
# (position embedding types, norms) are model_zoo's and checked by its GPTConfig.

# ---- the model section: derived from model_zoo's GPTConfig -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelKey:
    """One key of the model section and the :class:`~model_zoo.config.GPTConfig` field it sets.

    ``key`` is the flag's name with underscores (the flag is Megatron-LM's: ``--num-attention-heads`` sets
    ``num_heads``). A switch (``--swiglu``) sets the field to ``switch`` when on; another key, unset by default,
    gives the field's value.
    """

    key: str
    field: str
    switch: Any = dataclasses.MISSING

    @property
    def is_switch(self) -> bool:
        return self.switch is not dataclasses.MISSING


# GPTConfig metadata that is not a rule of the trainer key's value (see model_zoo.config.setting)
_DESCRIPTION = ("kind", "help", "trainer", "flag", "switch")
# The model section's one key that is no GPTConfig field, and the further spellings of keys that are.
_PRESET = _field(None, flag="--model", help="a model_zoo preset (e.g. tiny, gpt2-small, turing-nlg-17b); the shape "
                                            "settings override it")
# How the model runs, not what it is (model_zoo.compile): no GPTConfig field, not taken from a checkpoint.
_COMPILE_KEYS = (
    ("compile", bool, _field(False, flag="--torch-compile",
                             help="compile each transformer block with torch.compile (one compiled block reused by "
                                  "every layer; docs/compile.md)")),
    ("compile_cache_dir", Optional[str], _field(None, flag="--torch-compile-cache-dir",
                                                help="with model.compile: inductor's cache folder, so that a "
                                                     "restarted run compiles from its cache (unset: "
                                                     "checkpoint.save/compile-cache, else inductor's default)")))
COMPILE_MODEL_KEYS: Tuple[str, ...] = tuple(key for key, _, _ in _COMPILE_KEYS)
_ALIASES = {"position_embedding_type": (Alias("--use-rotary-position-embeddings", const="rope", compat=True,
                                              help="Megatron-LM's older spelling of --position-embedding-type "
                                                   "rope"),),
            # Megatron-LM's YaRN spellings of the scaling's factor and original context
            "rope_scaling_factor": (Alias("--rotary-scaling-factor", convert=float, compat=True,
                                          help="Megatron-LM's spelling of --rope-scaling-factor (YaRN's factor)"),),
            "rope_original_max_positions": (Alias("--yarn-original-max-position-embeddings", convert=int, compat=True,
                                                  help="Megatron-LM's spelling of --rope-original-max-positions "
                                                       "(YaRN's original context)"),)}

MODEL_KEYS: Tuple[ModelKey, ...] = tuple(
    ModelKey(flat_name(own_flag(f.name, f.metadata)), f.name, f.metadata.get("switch", dataclasses.MISSING))
    for f in dataclasses.fields(GPTConfig) if f.metadata["trainer"])

# The MoE keys (Megatron-Core's names: moe_*, expert_*) but model.num_experts, the one that makes a model MoE: on a
# dense model they change nothing (hybrid.config.cli notes and drops them).
MOE_MODEL_KEYS: Tuple[str, ...] = tuple(f"model.{mk.key}" for mk in MODEL_KEYS
                                        if mk.field.startswith(("moe_", "expert_")))


def _model_section() -> type:
    """The ``model`` section: ``preset``, then one key per :data:`MODEL_KEYS` entry, in GPTConfig's field order,
    with the field's flag, help and rules."""
    hints = typing.get_type_hints(GPTConfig)
    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    keys: List[Tuple[str, Any, Any]] = [("preset", Optional[str], _PRESET), *_COMPILE_KEYS]
    for mk in MODEL_KEYS:
        meta = fields[mk.field].metadata
        spelling = dict(flag=own_flag(mk.field, meta), help=meta["help"], aliases=_ALIASES.get(mk.key, ()))
        if mk.is_switch:
            keys.append((mk.key, bool, _field(False, **spelling)))
        else:
            rules = {k: v for k, v in meta.items() if k not in _DESCRIPTION}
            keys.append((mk.key, Optional[hints[mk.field]], _field(None, **spelling, **rules)))
    training = tuple(mk.key for mk in MODEL_KEYS if fields[mk.field].metadata["kind"] == TRAINING) + COMPILE_MODEL_KEYS
    return dataclasses.make_dataclass("ModelConfig", keys, namespace={
        "__module__": __name__,
        "__doc__": "The model_zoo GPT the trainer builds: a preset, and/or shape settings that override it (one "
                   "key per GPTConfig field that has a trainer flag: model_zoo.config.setting).",
        # How the model is trained and computed, not what it is: checkpoint.use_checkpoint_args leaves them alone.
        "TRAINING_KEYS": training})


ModelConfig = _model_section()


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
                                                "(reads vocab_file and merge_file), HuggingFaceTokenizer (reads "
                                                "tokenizer_model: a model folder's tokenizer.json) or TikTokenizer "
                                                "(tokenizer_model: Megatron's tiktoken .json; tiktoken_pattern); "
                                                "unset: "
                                                "GPT2BPETokenizer when vocab_file or merge_file is given, else "
                                                "SentencePieceTokenizer")
    tokenizer_model: Optional[str] = _field(None, flag="--tokenizer-model",
                                            help="SentencePiece model, or the model folder of a "
                                                 "HuggingFaceTokenizer (for the vocabulary size and the EOD id)")
    vocab_file: Optional[str] = _field(None, flag="--vocab-file", help="GPT2BPETokenizer: GPT-2's vocab.json")
    merge_file: Optional[str] = _field(None, flag="--merge-file", help="GPT2BPETokenizer: GPT-2's merges.txt")
    tiktoken_pattern: Optional[str] = _field(None, choices=TIKTOKEN_PATTERNS, flag="--tiktoken-pattern",
                                             help="TikTokenizer (tokenizer_model: Megatron's tiktoken vocabulary "
                                                  ".json): Megatron's pre-tokenizer pattern, v1 or v2; no effect "
                                                  "with another tokenizer")
    tiktoken_num_special_tokens: int = _field(1000, ge=3, flag="--tiktoken-num-special-tokens",
                                              help="TikTokenizer: the special ids before the vocabulary's (<unk>, "
                                                   "<s>, </s>, then <SPECIAL_3>...)")
    eod_mask_loss: bool = _field(False, flag="--eod-mask-loss",
                                 help="do not train on predicting the token after an end-of-document")
    reset_position_ids: bool = _field(False, flag="--reset-position-ids",
                                      help="restart the position ids after each end-of-document token of a sample "
                                           "(attention still spans the documents packed into it unless "
                                           "data.reset_attention_mask)")
    reset_attention_mask: bool = _field(False, flag="--reset-attention-mask",
                                        help="attention stays inside each document packed into a sample: a token "
                                             "after an end-of-document token starts the next document, the "
                                             "end-of-document token belongs to the one it ends (docs/data.md, "
                                             "'Packed documents')")
    mock: bool = _field(False, flag="--mock-data", help="random tokens instead of data.path (benchmarks, smoke "
                                                        "tests)")
    cache_path: Optional[str] = _field(None, flag="--data-cache-path",
                                       help="directory for the sample-index cache (unset: index-cache/ beside the "
                                            "data, or, when that is not writable, hybrid/index-cache/ under the "
                                            "user's cache directory, else the temporary directory, with a "
                                            "notice); every rank must see the same directory")

    PATH_KEYS: ClassVar[Tuple[str, ...]] = ("path", "train_path", "valid_path", "test_path")  # name data files
    # the settings that read the end-of-document id
    EOD_KEYS: ClassVar[Tuple[str, ...]] = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")

    @property
    def tokenizer(self) -> TokenizerSpec:
        """The tokenizer these settings name (:class:`~hybrid.tokenizer_files.TokenizerSpec`)."""
        return TokenizerSpec(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file,
                             self.tiktoken_pattern, self.tiktoken_num_special_tokens)


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
    no_load_optim: bool = _field(False, flag="--no-load-optim",
                                 help="resume the weights, the iteration, the data position and the schedules but "
                                      "not the optimizer state (Adam's moments, the loss scale): a fresh optimizer")
    no_load_rng: bool = _field(False, flag="--no-load-rng",
                               help="resume without the checkpoint's random-number generators (dropout draws "
                                    "from the freshly seeded ones)")
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
    save_16bit_model: bool = _field(False, flag="--save-16bit-model",
                                    help="with each save, also write the whole model consolidated (TP-merged, "
                                         "unpadded, under the model's names) in the training precision (bf16, fp16; "
                                         "fp32 runs: fp32) to iter_N/model_16bit.safetensors, from rank 0: "
                                         "DeepSpeed's stage3_gather_16bit_weights_on_model_save. Also read by the "
                                         "engine's save_checkpoint; not with async_save")
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
    train_tokens: Optional[int] = _field(None, ge=1, flag="--train-tokens",
                                         help="Megatron-DeepSpeed's run length in tokens: the run ends after the step "
                                              "whose samples (x model.seq_length) reach it, or earlier at train_iters "
                                              "or train_samples (the trainer reads it as one of them)")
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
    check_for_nan_in_loss_and_grad: bool = _field(
        True, flag="--check-for-nan-in-loss-and-grad",
        help="in fp32 and bf16, stop with an error (exit status 3) at the first iteration whose loss or gradient "
             "norm is not finite, naming the ranks that saw it, and save nothing at that iteration; fp16 always "
             "skips such steps instead (its loss scaler), within run.max_consecutive_skipped_steps. Off: fp32 "
             "and bf16 skip them too")
    loss_spike_factor: Optional[float] = _field(
        None, gt=1.0, flag="--loss-spike-factor",
        help="stop with an error (exit status 3) when an iteration's loss exceeds this many times the mean loss "
             "of the run.loss_spike_window iterations before it (unset: no spike guard)")
    loss_spike_window: int = _field(100, ge=1, flag="--loss-spike-window",
                                    help="with run.loss_spike_factor: how many of the preceding iterations' "
                                         "losses the running mean covers; the guard starts once it is full")


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
    moe_per_layer_logging: bool = _field(False, flag="--moe-per-layer-logging",
                                         help="an MoE model: after each log line, one line per MoE layer (its load "
                                              "over experts, dropped share, balancing and z-loss values); the log "
                                              "line itself shows the worst layer")
    wandb_project: Optional[str] = _field(None, flag="--wandb-project",
                                          help="also log to Weights & Biases, this project: the same tags at the same "
                                               "steps as TensorBoard, from rank 0 (needs pip install 'hybrid[wandb]'; "
                                               "offline without an API key: docs/monitoring.md)")
    wandb_exp_name: Optional[str] = _field(None, flag="--wandb-exp-name", help="the W&B run's name")
    wandb_save_dir: Optional[str] = _field(None, flag="--wandb-save-dir",
                                           help="the folder whose wandb/ holds the W&B run folder (unset: "
                                                "checkpoint.save/wandb, else the working directory)")
    profile: bool = _field(False, flag="--profile",
                           help="write a torch.profiler trace (Chrome trace JSON, for TensorBoard's profiler plugin "
                                "and Perfetto) of iterations [profile_step_start, profile_step_end) on the ranks "
                                "profile_ranks, into logging.tensorboard_dir")
    profile_step_start: int = _field(10, ge=1, flag="--profile-step-start",
                                     help="with logging.profile: the first iteration traced (as the log line counts)")
    profile_step_end: int = _field(12, ge=2, flag="--profile-step-end",
                                   help="with logging.profile: the iteration the trace stops before")
    profile_ranks: List[int] = _field(factory=lambda: [0], flag="--profile-ranks",
                                      help="with logging.profile: the global ranks that write a trace")


@dataclasses.dataclass
class DistributedConfig:
    """The process group."""

    timeout_minutes: float = _field(10.0, gt=0.0, help="a collective that waits longer than this fails")
    allow_tp_across_nodes: bool = _field(False, flag="--allow-tp-across-nodes", help="accept tensor-parallel groups that span nodes (ranks per "
                                                     "node from torchrun's LOCAL_WORLD_SIZE); refused otherwise, "
                                                     "since every layer's collectives would cross the "
                                                     "inter-node link")
