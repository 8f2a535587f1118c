"""The trainer's settings: one flat dataclass, its command-line flags, and their validation.

Flag names follow the widely used GPT pretraining conventions
(``--tensor-model-parallel-size``, ``--micro-batch-size``, ``--lr-decay-style``,
...), so existing launch scripts port with few edits. ``--config FILE`` reads
the same keys (underscores or dashes) from YAML or JSON; flags given on the
command line override the file. :func:`validate` checks every setting in one
place, before any process group exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import typing
from typing import Any, Dict, List, Optional, Sequence


class ArgumentError(ValueError):
    """A trainer setting that cannot work, with the flag to change."""


def _arg(default=None, help: str = "", **extra):
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def _list_arg(help: str):
    return dataclasses.field(default_factory=list, metadata={"help": help})


@dataclasses.dataclass
class TrainingArguments:
    # ---- parallelism ------------------------------------------------------------------
    tensor_model_parallel_size: int = _arg(1, "tensor-parallel ranks per model replica (adjacent ranks)")
    sequence_parallel: bool = _arg(False, "shard norm and dropout activations along the sequence over TP")
    zero_stage: int = _arg(1, "ZeRO stage over the data-parallel group: 0, 1, 2 or 3", choices=(0, 1, 2, 3))
    offload_optimizer: str = _arg("none", "keep fp32 master weights and optimizer state on the CPU (stages 1-3)",
                                  choices=("none", "cpu"))
    zero_bucket_size: int = _arg(25_000_000, "elements per gradient bucket")
    distributed_timeout_minutes: float = _arg(10.0, "a collective that waits longer than this fails")
    # ---- model --------------------------------------------------------------------------
    model: Optional[str] = _arg(None, "a model_zoo preset (e.g. tiny, gpt2-small, turing-nlg-17b); the "
                                      "shape flags below override it")
    num_layers: Optional[int] = _arg(None, "transformer layers")
    hidden_size: Optional[int] = _arg(None, "hidden size")
    num_attention_heads: Optional[int] = _arg(None, "attention heads")
    ffn_hidden_size: Optional[int] = _arg(None, "MLP hidden size (default 4h, or the SwiGLU rule)")
    seq_length: Optional[int] = _arg(None, "training sequence length")
    max_position_embeddings: Optional[int] = _arg(None, "learned position table size")
    vocab_size: Optional[int] = _arg(None, "vocabulary size (default: the tokenizer's)")
    position_embedding_type: Optional[str] = _arg(None, "learned or rope", choices=("learned", "rope"))
    normalization: Optional[str] = _arg(None, "layernorm or rmsnorm", choices=("layernorm", "rmsnorm"))
    norm_epsilon: Optional[float] = _arg(None, "epsilon of LayerNorm/RMSNorm")
    rotary_base: Optional[float] = _arg(None, "base (theta) of rotary position embeddings")
    swiglu: bool = _arg(False, "SwiGLU MLP instead of GELU")
    disable_bias_linear: bool = _arg(False, "no biases in linear layers")
    untie_embeddings_and_output_weights: bool = _arg(False, "separate output layer weights")
    hidden_dropout: Optional[float] = _arg(None, "dropout on embeddings and residual branches")
    attention_dropout: Optional[float] = _arg(None, "dropout on attention probabilities")
    init_method_std: Optional[float] = _arg(None, "standard deviation of the weight initialisation")
    # ---- batch and run length -------------------------------------------------------------
    micro_batch_size: int = _arg(1, "samples per data-parallel rank per micro-step")
    global_batch_size: Optional[int] = _arg(None, "samples per optimizer step over all data-parallel ranks "
                                                  "(default: micro batch x DP)")
    train_iters: Optional[int] = _arg(None, "optimizer steps to train for")
    # ---- optimisation -----------------------------------------------------------------------
    optimizer: str = _arg("adamw", "adamw, adam or sgd", choices=("adamw", "adam", "sgd"))
    lr: float = _arg(1e-4, "peak learning rate")
    min_lr: float = _arg(0.0, "learning rate at the end of decay")
    lr_decay_style: str = _arg("cosine", "constant, linear or cosine", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = _arg(0, "linear warmup steps")
    lr_decay_iters: Optional[int] = _arg(None, "step at which decay reaches min-lr (default: train-iters)")
    weight_decay: float = _arg(0.01, "weight decay (not applied to biases and norm weights)")
    adam_beta1: float = _arg(0.9, "Adam beta1")
    adam_beta2: float = _arg(0.999, "Adam beta2")
    adam_eps: float = _arg(1e-8, "Adam epsilon")
    sgd_momentum: float = _arg(0.9, "SGD momentum")
    clip_grad: float = _arg(1.0, "clip the global gradient norm to this (0 disables)")
    # ---- precision ----------------------------------------------------------------------------
    bf16: bool = _arg(False, "bf16 parameters and activations, fp32 master weights")
    fp16: bool = _arg(False, "fp16 parameters and activations with loss scaling, fp32 master weights")
    loss_scale: Optional[float] = _arg(None, "static loss scale (fp16); unset: dynamic")
    initial_loss_scale: float = _arg(2.0 ** 16, "initial dynamic loss scale (a power of two)")
    min_loss_scale: float = _arg(1.0, "the dynamic loss scale never goes below this")
    loss_scale_window: int = _arg(1000, "steps without overflow before the scale doubles")
    hysteresis: int = _arg(2, "overflows tolerated before the scale is halved")
    # ---- recomputation --------------------------------------------------------------------------
    recompute_activations: bool = _arg(False, "recompute activations (selective unless a granularity is given)")
    recompute_granularity: Optional[str] = _arg(None, "full (every layer) or selective (attention core)",
                                                choices=("full", "selective"))
    # ---- data -----------------------------------------------------------------------------------
    data_path: List[str] = _list_arg("data prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'")
    split: str = _arg("969,30,1", "train,valid,test proportions")
    tokenizer_model: Optional[str] = _arg(None, "SentencePiece model (for the vocabulary size and the EOD id)")
    eod_mask_loss: bool = _arg(False, "do not train on predicting the token after an end-of-document")
    mock_data: bool = _arg(False, "random tokens instead of --data-path (benchmarks, smoke tests)")
    # ---- checkpoints -------------------------------------------------------------------------------
    save: Optional[str] = _arg(None, "directory to save checkpoints in")
    load: Optional[str] = _arg(None, "directory (its 'latest') or DIR/iter_N to resume from")
    save_interval: Optional[int] = _arg(None, "save every this many steps")
    keep_last: Optional[int] = _arg(None, "keep only the newest K checkpoints")
    finetune: bool = _arg(False, "load weights only: new optimizer, schedule and data position")
    override_opt_param_scheduler: bool = _arg(False, "on --load, keep the configured LR schedule settings "
                                                     "(e.g. a longer --train-iters) at the saved position")
    # ---- evaluation, logging, exit --------------------------------------------------------------------
    eval_interval: int = _arg(1000, "evaluate on the validation split every this many steps (0 disables)")
    eval_iters: int = _arg(10, "validation batches per evaluation")
    log_interval: int = _arg(100, "print and log metrics every this many steps")
    tensorboard_dir: Optional[str] = _arg(None, "write TensorBoard event files here")
    seed: int = _arg(1234, "random seed (model init, data order, dropout)")
    peak_tflops: Optional[float] = _arg(None, "per-device peak TFLOP/s for MFU (default: known GPU table, or "
                                              "a matmul probe on CPU)")
    exit_interval: Optional[int] = _arg(None, "save and exit once the step count is a multiple of this")
    exit_duration_in_mins: Optional[float] = _arg(None, "save and exit after this many minutes")
    no_fused_kernels: bool = _arg(False, "use the pure-torch implementations instead of the fused kernels")
    config: Optional[str] = _arg(None, "YAML or JSON file with any of these settings; flags override it")

    # ---- derived -----------------------------------------------------------------------------------
    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def recompute(self) -> str:
        if self.recompute_granularity:
            return self.recompute_granularity
        return "selective" if self.recompute_activations else "none"


_FIELDS = {f.name: f for f in dataclasses.fields(TrainingArguments)}
_HINTS = typing.get_type_hints(TrainingArguments)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(name: str):
    hint = _HINTS[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union else hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-train", description="Pretrain a GPT with TP x DP x ZeRO.",
                                     argument_default=argparse.SUPPRESS)
    for name, f in _FIELDS.items():
        kind = _base_type(name)
        kw: Dict[str, Any] = {"help": f.metadata["help"], "dest": name}
        if kind is bool:
            parser.add_argument(_flag(name), action="store_true", **kw)
            continue
        if typing.get_origin(kind) in (list, List):
            kw["nargs"] = "+"
            kind = str
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        parser.add_argument(_flag(name), type=kind, **kw)
    return parser


def _read_config_file(path: str) -> Dict[str, Any]:
    import json

    import yaml

    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: no such file")
    with open(path, "r", encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ArgumentError(f"--config {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of settings at the top level")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS or name == "config":
            close = difflib.get_close_matches(name, list(_FIELDS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ArgumentError(f"--config {path}: unknown setting '{key}'{hint}")
        if _base_type(name) in (list, List) or typing.get_origin(_base_type(name)) in (list, List):
            value = value.split() if isinstance(value, str) else [str(v) for v in value]
        out[name] = value
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainingArguments:
    """Flags over ``--config`` over defaults. Types are checked; cross-setting rules are in :func:`validate`."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    values: Dict[str, Any] = {}
    if given.get("config"):
        values.update(_read_config_file(given["config"]))
    values.update(given)
    args = TrainingArguments(**values)
    _check_types(args)
    return args


def _check_types(args: TrainingArguments) -> None:
    for name in _FIELDS:
        value, kind = getattr(args, name), _base_type(name)
        if value is None or typing.get_origin(kind) in (list, List):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(args, name, float(value))
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ArgumentError(f"{_flag(name)} expects {kind.__name__}, got {value!r}")
        if "choices" in _FIELDS[name].metadata and value not in _FIELDS[name].metadata["choices"]:
            raise ArgumentError(f"{_flag(name)}={value!r} is not one of {_FIELDS[name].metadata['choices']}")


def _positive(args: TrainingArguments, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"{_flag(name)} must be > 0, got {value}")


def validate(args: TrainingArguments, world_size: int) -> None:
    """Every cross-setting rule, checked before any process group work. Raises :class:`ArgumentError`."""
    _positive(args, "tensor_model_parallel_size", "micro_batch_size", "global_batch_size", "train_iters",
              "lr", "save_interval", "keep_last", "log_interval", "eval_iters", "exit_interval",
              "exit_duration_in_mins", "peak_tflops", "distributed_timeout_minutes", "zero_bucket_size",
              "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
    if args.train_iters is None:
        raise ArgumentError("--train-iters is required: the number of optimizer steps to train for")
    tp = args.tensor_model_parallel_size
    if world_size % tp != 0:
        raise ArgumentError(f"the world size {world_size} is not divisible by --tensor-model-parallel-size {tp}; "
                            f"start a multiple of {tp} processes or change the TP size")
    dp = world_size // tp
    micro = args.micro_batch_size
    global_batch = args.global_batch_size if args.global_batch_size is not None else micro * dp
    if global_batch % (micro * dp) != 0:
        raise ArgumentError(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size {micro} "
                            f"x data-parallel size {dp} = {micro * dp}; the global batch must be a whole number "
                            f"of micro-batches on every data-parallel rank")
    if not math.log2(args.initial_loss_scale).is_integer():
        raise ArgumentError(f"--initial-loss-scale {args.initial_loss_scale} must be a power of two (2**k)")
    if args.bf16 and args.fp16:
        raise ArgumentError("--bf16 and --fp16 are mutually exclusive; choose one")
    if args.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if args.lr_warmup_iters > decay:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds the decay length {decay} "
                            f"(--lr-decay-iters, default --train-iters)")
    if args.model is None and None in (args.num_layers, args.hidden_size, args.num_attention_heads,
                                       args.seq_length):
        raise ArgumentError("give --model PRESET, or all of --num-layers, --hidden-size, "
                            "--num-attention-heads and --seq-length")
    if args.model is not None:
        from model_zoo.presets import list_presets

        if args.model not in list_presets():
            close = difflib.get_close_matches(args.model, list_presets(), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ArgumentError(f"--model {args.model!r} is not a model_zoo preset{hint}; "
                                f"choose one of {', '.join(list_presets())}")
    if not args.mock_data:
        if not args.data_path:
            raise ArgumentError("--data-path is required (a preprocessed prefix from tools/preprocess_data.py), "
                                "or pass --mock-data for random tokens")
        for prefix in data_prefixes(args.data_path):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ArgumentError(f"--data-path: {prefix + ext} does not exist; run "
                                        f"tools/preprocess_data.py to create it")
    if args.tokenizer_model is not None and not os.path.isfile(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model}: no such file")
    if args.vocab_size is None and args.tokenizer_model is None and args.model is None:
        raise ArgumentError("the vocabulary size is unknown: give --tokenizer-model, --vocab-size or --model")
    if args.offload_optimizer == "cpu" and args.zero_stage == 0:
        raise ArgumentError("--offload-optimizer cpu needs --zero-stage 1, 2 or 3")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save DIR")
    if args.keep_last is not None and args.save is None:
        raise ArgumentError("--keep-last needs --save DIR")
    if args.load is not None and not os.path.exists(args.load):
        raise ArgumentError(f"--load {args.load}: no such directory")
    try:
        model_config(args, vocab_size=args.vocab_size or 1).validate(tp)
    except ValueError as e:
        raise ArgumentError(f"model settings: {e}") from None


def data_prefixes(data_path: Sequence[str]) -> List[str]:
    """The prefixes of ``--data-path``, dropping blend weights ('0.3 A 0.7 B' -> [A, B])."""
    items = list(data_path)
    if len(items) > 1 and _is_number(items[0]):
        if len(items) % 2:
            raise ArgumentError("--data-path with weights needs weight/prefix pairs: '0.3 A 0.7 B'")
        for w in items[0::2]:
            if not _is_number(w):
                raise ArgumentError(f"--data-path: expected a weight, got {w!r}")
        return items[1::2]
    return items


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def model_config(args: TrainingArguments, vocab_size: int):
    """The :class:`model_zoo.GPTConfig` these settings describe, for a tokenizer of ``vocab_size``."""
    from model_zoo.config import GPTConfig
    from model_zoo.presets import get_preset

    changes: Dict[str, Any] = {}
    if args.model is not None:
        cfg = get_preset(args.model)
    else:
        cfg = GPTConfig(vocab_size=vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                        num_heads=args.num_attention_heads, seq_length=args.seq_length)
    if args.vocab_size is not None or args.tokenizer_model is not None or args.model is None:
        changes["vocab_size"] = vocab_size
    for flag, key in (("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
                      ("num_attention_heads", "num_heads"), ("ffn_hidden_size", "ffn_hidden_size"),
                      ("seq_length", "seq_length"), ("max_position_embeddings", "max_position_embeddings"),
                      ("position_embedding_type", "position"), ("normalization", "norm"),
                      ("hidden_dropout", "hidden_dropout"), ("attention_dropout", "attention_dropout"),
                      ("init_method_std", "init_std"), ("norm_epsilon", "norm_eps"),
                      ("rotary_base", "rope_theta")):
        if getattr(args, flag) is not None:
            changes[key] = getattr(args, flag)
    if args.swiglu:
        changes["mlp"] = "swiglu"
    if args.disable_bias_linear:
        changes["bias"] = False
    if args.untie_embeddings_and_output_weights:
        changes["tie_embeddings"] = False
    changes["sequence_parallel"] = args.sequence_parallel
    changes["recompute"] = args.recompute
    return cfg.replace(**changes)


def engine_config(args: TrainingArguments, dp_size: int):
    """The :class:`hybrid.config.HybridConfig` for the engine."""
    from hybrid.config import HybridConfig

    global_batch = args.global_batch_size or args.micro_batch_size * dp_size
    return HybridConfig.from_dict({
        "precision": args.precision,
        "loss_scaling": {
            "loss_scale": args.loss_scale or 0.0,
            "initial_scale_power": int(math.log2(args.initial_loss_scale)),
            "loss_scale_window": args.loss_scale_window,
            "hysteresis": args.hysteresis,
            "min_loss_scale": args.min_loss_scale,
        },
        "zero": {"stage": args.zero_stage, "bucket_size": args.zero_bucket_size,
                 "offload_optimizer": args.offload_optimizer},
        "optimizer": {"type": args.optimizer, "lr": args.lr, "betas": [args.adam_beta1, args.adam_beta2],
                      "eps": args.adam_eps, "weight_decay": args.weight_decay,
                      "momentum": args.sgd_momentum if args.optimizer == "sgd" else 0.0},
        "scheduler": {"type": args.lr_decay_style, "warmup_iters": args.lr_warmup_iters,
                      "decay_iters": args.lr_decay_iters or args.train_iters, "min_lr": args.min_lr},
        "clip_grad": args.clip_grad,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": global_batch,
        "tensor_parallel_size": args.tensor_model_parallel_size,
        "recompute": args.recompute,
        "seed": args.seed,
        "steps_per_print": 0,
        "use_fused_kernels": not args.no_fused_kernels,
    })


def to_dict(args: TrainingArguments) -> Dict[str, Any]:
    return dataclasses.asdict(args)
