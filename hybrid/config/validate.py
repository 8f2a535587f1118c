"""Every rule a :class:`~hybrid.config.schema.HybridConfig` must satisfy, in one place.

Three kinds, three functions:

* :func:`validate`: the per-key rules, read from the schema's field metadata
  (``choices``, bounds), and the rules that tie keys together
  (:func:`_cross_key_rules`). Every load, override and command line runs it.
* :func:`validate_world`: the rules that need the world size (the world
  divides by the tensor-parallel size; the expert-parallel size divides the
  data-parallel size, :func:`hybrid.grid.expert_parallel_problem`; the batch
  sizes fit the data-parallel size, through
  :func:`hybrid.config.batch.resolve_batch`).
* :func:`validate_for_training`: what the trainer needs besides (a run length,
  a model, data, a batch size), then :func:`validate_world`.

Errors name the key and end with the flags that set it (``(set by --zero-stage)``).
:func:`validate` and :func:`validate_for_training` raise one error listing every
rule broken (:func:`hybrid.config.errors.one_error_for_all`), so a config is
fixed in one edit.
What only the filesystem or model_zoo can answer (do the data files exist, is
the model shape valid at this TP size) is checked by
:func:`hybrid.training.validate`, by asking them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Mapping, Optional

from hybrid.config.batch import BatchSizes, rampup_problem, step_schedule_problem
from hybrid.config.derive import TOKEN_KEYS, config_value, token_problem
from hybrid.config.errors import ConfigError, one_error_for_all, value_suggestion
from hybrid.config.flags import key_error, meta_error
from hybrid.compression import ONE_BIT_OPTIMIZERS, compression_problem, hpz_problem, onebit_problem
from hybrid.config.schema import HybridConfig, decoupled_lr_problem, lamb_problem
from hybrid.grid import WorldSizeError, data_parallel_size, expert_parallel_problem
from hybrid.layout import offload_problem, overlap_param_gather_problem, pipeline_problem, reduce_once_problem


def validate(cfg: "HybridConfig") -> None:
    """Raise one :class:`~hybrid.config.ConfigError` naming every rule ``cfg`` breaks (see :func:`_problems`)."""
    _raise_all(_problems(cfg))


def _problems(cfg: "HybridConfig") -> List[ConfigError]:
    """An error for every key outside its own rule (a choice, a bound), else for every rule that ties keys
    together: those read the values, so they run on sound ones only."""
    problems: List[ConfigError] = []
    _check_fields(cfg, "", problems)
    if not problems:
        _cross_key_rules(cfg, problems)
    return problems


def _raise_all(problems: List[ConfigError]) -> None:
    if problems:
        raise one_error_for_all(problems, "config keys")


def validate_world(cfg: "HybridConfig", world_size: int) -> BatchSizes:
    """The world-dependent rules for ``world_size`` processes; returns the resolved batch sizes."""
    error = _errors(cfg)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise error(f"the world size must be an integer >= 1, got {world_size!r}")
    tp, pp, cp = cfg.tensor_parallel_size or 1, cfg.pipeline.size or 1, cfg.context_parallel_size or 1
    try:
        dp = data_parallel_size(world_size, tp=tp, pp=pp, cp=cp)
    except WorldSizeError as e:
        sizes = ("tensor_parallel_size x pipeline.size", f"{tp} x {pp}") if cp == 1 else \
            ("tensor_parallel_size x context_parallel_size x pipeline.size", f"{tp} x {cp} x {pp}")
        raise error(f"world size {world_size} is not divisible by {sizes[0]} = {sizes[1]}; start a multiple of "
                    f"{e.replica} processes or change the TP, context-parallel or pipeline size",
                    "tensor_parallel_size", "pipeline.size", *(("context_parallel_size",) if cp > 1 else ())) from None
    ep = cfg.expert_parallel_size or 1
    problem = expert_parallel_problem(dp, cp, ep)
    if problem:
        replica = f"tp {tp} x pp {pp} x dp {dp}" + (f" x cp {cp}" if cp > 1 else "")
        raise error(f"{problem} (world size {world_size} = {replica})", "expert_parallel_size")
    return cfg.resolve_batch(dp)


def validate_for_training(cfg: "HybridConfig", world_size: int) -> BatchSizes:
    """Every config rule for a trainer run on ``world_size`` processes; returns the resolved batch sizes."""
    problems = _problems(cfg)
    _training_requirements(cfg, problems)
    if problems:
        fields: List[ConfigError] = []
        _check_fields(cfg, "", fields)
        if not fields:  # the world's rules read sound values: with those, their error joins the others
            try:
                validate_world(cfg, world_size)
            except ConfigError as err:
                problems.append(err)
    _raise_all(problems)
    batch = validate_world(cfg, world_size)
    samples = cfg.run.train_samples
    if samples is not None and batch.schedule.steps_within(samples) == 0:
        raise _errors(cfg)(f"config key 'run.train_samples' ({samples}) is less than the first global batch "
                           f"({batch.schedule.size_at(0)} samples): the run would not take a step; raise it",
                           "run.train_samples")
    return batch


def _errors(cfg):
    """``key_error`` for the tree of ``cfg``: errors name the keys and end with their flags."""
    return functools.partial(key_error, type(cfg))


def _adder(cfg, problems: List[ConfigError]):
    """``error(message, *keys)`` adding to ``problems`` a ConfigError about ``keys`` of the tree of ``cfg``,
    its text ending with the flags that set them."""
    def error(message: str, *keys: str) -> None:
        problems.append(key_error(type(cfg), message, *keys))
    return error


def _check_fields(section, path: str, problems: List[ConfigError]) -> None:
    """Add to ``problems`` an error for each key of ``section`` (and its sub-sections) outside its choices or
    bounds."""
    for f in dataclasses.fields(section):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, key, problems)
            continue
        problem = field_problem(key, value, f.metadata)
        if problem is not None:
            problems.append(problem)


def field_problem(key: str, value, meta: Mapping) -> Optional[ConfigError]:
    """The error for a typed leaf ``value`` of config key ``key`` outside the choices or bounds in its field
    metadata ``meta``, or None. Parsing asks it for each key as it reads it, so that one error lists them all."""
    if value is None or isinstance(value, list):
        return None
    try:
        if "choices" in meta and value not in meta["choices"]:
            choices = [str(c) for c in meta["choices"]]
            hint = value_suggestion(str(value), choices)
            raise meta_error(f"config key '{key}' must be one of {', '.join(choices)}, got {value!r}"
                             f"{'.' + hint if hint else ''}", key, meta)
        for number in (value if isinstance(value, tuple) else (value,)):
            _check_bounds(key, number, meta)
    except ConfigError as err:
        return err
    return None


def _check_bounds(key: str, value, meta) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise meta_error(f"config key '{key}' must be a finite number, got {value!r}", key, meta)
    for bound, holds, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                               ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
        if bound in meta and not holds(value, meta[bound]):
            raise meta_error(f"config key '{key}' must be {word} {meta[bound]}, got {value!r}", key, meta)


def _cross_key_rules(cfg: "HybridConfig", problems: List[ConfigError]) -> None:
    """Add to ``problems`` an error for each rule that ties keys together and ``cfg`` breaks."""
    error = _adder(cfg, problems)
    pipe = cfg.pipeline
    if (pipe.schedule == "interleaved") != (pipe.layers_per_virtual_stage is not None):
        error("the interleaved pipeline schedule and 'pipeline.layers_per_virtual_stage' go together: set "
              "both (virtual stages) or neither", "pipeline.schedule", "pipeline.layers_per_virtual_stage")
    problem = pipeline_problem(cfg.zero.stage, pipe.size or 1)
    if problem:
        error(f"'zero.stage' {cfg.zero.stage} with 'pipeline.size' {pipe.size}: {problem}", "zero.stage",
              "pipeline.size")
    problem = offload_problem(cfg.zero.stage, cfg.zero.offload_optimizer)
    if problem:
        error(f"config key 'zero.offload_optimizer' is {cfg.zero.offload_optimizer!r} but 'zero.stage' "
              f"is {cfg.zero.stage}: {problem}", "zero.offload_optimizer", "zero.stage")
    problem = reduce_once_problem(cfg.zero.stage, cfg.zero.reduce_once)
    if problem:
        error(f"config key 'zero.reduce_once' is true but 'zero.stage' is {cfg.zero.stage}: {problem}",
              "zero.reduce_once", "zero.stage")
    problem = overlap_param_gather_problem(cfg.zero.stage, cfg.zero.overlap_param_gather)
    if problem:
        error(f"config key 'zero.overlap_param_gather' is true but 'zero.stage' is {cfg.zero.stage}: {problem}",
              "zero.overlap_param_gather", "zero.stage")
    z = cfg.zero
    problem = compression_problem(z.stage, z.quantized_gradients, z.quantized_weights, z.quantization_block)
    if problem:
        key, why = problem
        value = getattr(z, key.split(".")[1])
        error(f"config key '{key}' is {value!r} but 'zero.stage' is {z.stage}: {why}", key, "zero.stage")
    problem = hpz_problem(z.stage, z.hpz_partition_size)
    if problem:
        error(f"config key 'zero.hpz_partition_size' is {z.hpz_partition_size!r} but 'zero.stage' is "
              f"{z.stage}: {problem}", "zero.hpz_partition_size", "zero.stage")
    if cfg.optimizer.type in ONE_BIT_OPTIMIZERS:
        problem = onebit_problem(z.stage, z.offload_optimizer, z.two_level_reduce, cfg.optimizer.type)
        if problem:
            key, why = problem
            error(f"config key 'optimizer.type' is {cfg.optimizer.type!r} but '{key}' is "
                  f"{getattr(z, key.split('.')[1])!r}: {why}", "optimizer.type", key)
    if cfg.autocast and cfg.precision == "fp32":
        error("config key 'autocast' is true but 'precision' is fp32; autocast runs the forward in bf16 "
              "or fp16: set precision to bf16 or fp16, or autocast to false", "autocast", "precision")

    opt = cfg.optimizer
    for i, beta in enumerate(opt.betas):
        if not 0.0 <= beta < 1.0:
            error(f"config key 'optimizer.betas[{i}]' must be in [0, 1), got {beta!r}",
                  f"optimizer.betas[{i}]")
    if decoupled_lr_problem(opt):
        error(f"config key 'optimizer.decoupled_lr' {decoupled_lr_problem(opt)}", "optimizer.decoupled_lr",
              "optimizer.decoupled_min_lr", "optimizer.type")
    if opt.type == "lamb" and lamb_problem(z.stage, z.offload_optimizer):
        error(f"config key 'optimizer.type' lamb: {lamb_problem(z.stage, z.offload_optimizer)}", "optimizer.type",
              "zero.stage", "zero.offload_optimizer")
    if opt.momentum != 0.0 and opt.type != "sgd":
        error(f"config key 'optimizer.momentum' applies to sgd only, but optimizer.type is "
              f"{opt.type!r}; remove it or set optimizer.type to sgd", "optimizer.momentum", "optimizer.type")

    sched = cfg.scheduler
    decay_key = f"scheduler.{sched.length_key('decay')}"
    mixed_units = sched.in_samples and sched.given_in_steps
    if mixed_units:
        steps, samples = ([f"scheduler.{k}" for k in keys] for keys in (sched.STEP_KEYS, sched.SAMPLE_KEYS))
        error(f"give the learning-rate schedule in optimizer steps ({', '.join(repr(k) for k in steps)}) or in "
              f"samples ({', '.join(repr(k) for k in samples)}), not both", *steps, *samples)
    elif sched.warmup_fraction is not None and (sched.warmup_iters != 0 or sched.warmup_samples is not None):
        given = "warmup_samples" if sched.in_samples else "warmup_iters"
        error(f"give the warmup as 'scheduler.{given}' ({getattr(sched, given)}) or as "
              f"'scheduler.warmup_fraction' ({sched.warmup_fraction}), not both", f"scheduler.{given}",
              "scheduler.warmup_fraction")
    elif sched.needs_decay_length and sched.decay_length is None:
        needs = f"scheduler.type {sched.type!r}" if sched.decay_ends else "'scheduler.warmup_fraction'"
        run = "run.train_samples" if sched.in_samples else "run.train_iters"
        error(f"{needs} needs '{decay_key}' (where the learning rate reaches scheduler.min_lr, warmup "
              f"included; the trainer derives it from {run})", decay_key)
    elif sched.warmup_fraction is not None and sched.warmup_length == 0:
        error(f"'scheduler.warmup_fraction' {sched.warmup_fraction} of '{decay_key}' {sched.decay_length} "
              f"rounds to no warmup {sched.unit}; raise it, or give the warmup itself", "scheduler.warmup_fraction",
              decay_key)
    elif sched.decays and sched.decay_length is not None and sched.decay_length <= sched.warmup_length:
        error(f"config key '{decay_key}' ({sched.decay_length}) must be greater than {_warmup(sched)}: "
              f"decay starts after warmup", decay_key, _warmup_key(sched))
    elif not mixed_units:
        _wsd_rules(sched, decay_key, error)
    warmup_known = sched.warmup_fraction is None or sched.decay_length is not None
    if sched.warmup_style == "log" and warmup_known and 0 < sched.warmup_length < 2:
        error(f"scheduler.warmup_style 'log' needs at least 2 warmup {sched.unit}, got {_warmup(sched)} "
              f"(log(1) = 0 leaves nothing to warm up over)", _warmup_key(sched))
    _weight_decay_rules(cfg, error, mixed_units)
    if sched.min_lr > opt.lr:
        error(f"config key 'scheduler.min_lr' ({sched.min_lr}) exceeds the peak 'optimizer.lr' "
              f"({opt.lr})", "scheduler.min_lr", "optimizer.lr")
    if sched.warmup_start_lr > opt.lr:
        error(f"config key 'scheduler.warmup_start_lr' ({sched.warmup_start_lr}) exceeds the peak "
              f"'optimizer.lr' ({opt.lr})", "scheduler.warmup_start_lr", "optimizer.lr")

    tokenizer_problem = cfg.data.tokenizer.problem(name_of=lambda setting: f"'data.{setting}'")
    if tokenizer_problem is not None:
        message, settings = tokenizer_problem
        error(message, *(f"data.{s}" for s in settings))

    if cfg.tensorboard.enabled and not cfg.tensorboard.output_path:
        error("tensorboard.enabled is true but 'tensorboard.output_path' is empty; give a directory",
              "tensorboard.output_path")

    if cfg.run.train_iters is not None and cfg.run.train_samples is not None:
        error(f"give the run's length as 'run.train_iters' ({cfg.run.train_iters}) or as 'run.train_samples' "
              f"({cfg.run.train_samples}), not both", "run.train_iters", "run.train_samples")
    micro, accum, glob = cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.global_batch_size
    if cfg.rampup_batch_size is not None:
        problem = rampup_problem(tuple(cfg.rampup_batch_size), glob)
        if problem:
            error(problem, "rampup_batch_size", "global_batch_size")
    for key in TOKEN_KEYS:  # a token count derive_for_training could not read as samples
        problem = token_problem(cfg, key) if config_value(cfg, key) is not None else None
        if problem:
            error(problem, key, *(("model.seq_length",) if "seq_length" in problem else ()))
    if cfg.step_batch_size_schedule:
        try:
            problem = step_schedule_problem(cfg.batch_steps(), glob, cfg.rampup_batch_size)
            if problem:
                error(problem[0], *problem[1])
        except ConfigError as err:  # the schedule's own text
            problems.append(err)
    if micro is not None and accum is not None and glob is not None and glob % (micro * accum) != 0:
        error(f"global_batch_size {glob} is not divisible by micro_batch_size {micro} x "
              f"gradient_accumulation_steps {accum} = {micro * accum}; global batch = micro batch x "
              f"accumulation x data-parallel size", "global_batch_size", "micro_batch_size",
              "gradient_accumulation_steps")

    ckpt = cfg.checkpoint
    for key, value in (("save_interval", ckpt.save_interval), ("keep_last", ckpt.keep_last)):
        if value is not None and ckpt.save is None:
            error(f"config key 'checkpoint.{key}' needs 'checkpoint.save' (a directory to save in)",
                  f"checkpoint.{key}", "checkpoint.save")
    master = cfg.zero.master_precision
    if master != "fp32" and (cfg.precision != master or cfg.autocast or cfg.zero.offload_optimizer != "none"):
        error(f"config key 'zero.master_precision' {master} keeps the {master} parameters as their own masters: it "
              f"needs 'precision' {master} without 'autocast' and without 'zero.offload_optimizer' (got precision "
              f"{cfg.precision}, autocast {str(cfg.autocast).lower()}, offload {cfg.zero.offload_optimizer})",
              "zero.master_precision", "precision")
    if ckpt.save_16bit_model and ckpt.async_save:
        error("config key 'checkpoint.save_16bit_model' writes the consolidated model from the finished checkpoint "
              "as the save returns; a background save ('checkpoint.async_save') finishes later: give one of them, "
              "or convert a finished checkpoint with tools/convert_checkpoint.py", "checkpoint.save_16bit_model",
              "checkpoint.async_save")
    if ckpt.async_save_chunk_mb is not None and not ckpt.async_save:
        error("config key 'checkpoint.async_save_chunk_mb' bounds the host copy of a background save; it "
              "needs 'checkpoint.async_save'", "checkpoint.async_save_chunk_mb", "checkpoint.async_save")


def _weight_decay_rules(cfg: "HybridConfig", error, mixed_units: bool) -> None:
    """A growing weight decay: from start to end (end not below start), over a length in the schedule's unit."""
    opt, sched = cfg.optimizer, cfg.scheduler
    start, end = opt.weight_decay_range
    style_key = "optimizer.weight_decay_incr_style"
    keys = ("optimizer.start_weight_decay", "optimizer.end_weight_decay")
    length_key = f"scheduler.{sched.length_key('weight_decay_incr')}"
    if end < start:
        error(f"the weight decay grows from start to end: 'optimizer.end_weight_decay' ({end}) is below "
              f"'optimizer.start_weight_decay' ({start})", *keys)
    elif opt.weight_decay_incr_style == "constant":
        if start != end:
            error(f"a weight decay from {start} to {end} needs '{style_key}' linear or cosine (it is constant)",
                  style_key, *keys)
        for key in _lengths_given(sched, "weight_decay_incr"):
            error(f"config key '{key}' is the length of a growing weight decay, but '{style_key}' is constant; "
                  f"remove it or set '{style_key}' linear or cosine", key, style_key)
    elif not mixed_units and sched.weight_decay_incr_length is None:
        run = "run.train_samples" if sched.in_samples else "run.train_iters"
        error(f"'{style_key}' {opt.weight_decay_incr_style!r} needs '{length_key}' (where the weight decay "
              f"reaches 'optimizer.end_weight_decay'; the trainer derives it from {run})", length_key, style_key)


def _wsd_rules(sched, decay_key: str, error) -> None:
    """WSD's anneal length: set exactly when the schedule is WSD, and within the decay after the warmup."""
    wsd_key = f"scheduler.{sched.length_key('wsd_decay')}"
    if sched.type != "wsd":
        for key in _lengths_given(sched, "wsd_decay"):
            error(f"config key '{key}' applies to scheduler.type wsd only, but scheduler.type is "
                  f"{sched.type!r}; remove it or set scheduler.type to wsd", key, "scheduler.type")
    elif sched.wsd_length is None:
        error(f"scheduler.type 'wsd' needs '{wsd_key}': how long the final anneal to scheduler.min_lr lasts (it "
              f"ends at '{decay_key}')", wsd_key)
    elif sched.decay_length is not None and sched.wsd_length > sched.decay_length - sched.warmup_length:
        error(f"config key '{wsd_key}' ({sched.wsd_length}) must be at most '{decay_key}' ({sched.decay_length}) "
              f"minus {_warmup(sched)}: the anneal ends at the decay length and starts after the warmup", wsd_key,
              decay_key, _warmup_key(sched))


def _lengths_given(sched, name: str) -> List[str]:
    """The keys of length ``name`` that are set, in steps or in samples (for a rule that wants neither)."""
    return [f"scheduler.{key}" for key in (f"{name}_iters", f"{name}_samples") if getattr(sched, key) is not None]


def _data_rules(cfg: "HybridConfig", error) -> None:
    """One source of training data: random tokens, data.path divided by data.split, or a path for each split."""
    data = cfg.data
    given = [key for key in data.PATH_KEYS if getattr(data, key)]
    own = [key for key in ("valid_path", "test_path") if getattr(data, key)]  # a split's path of its own
    if data.mock and given:
        error(f"'data.mock' trains on random tokens and would ignore 'data.{given[0]}'; give one of them",
              "data.mock", f"data.{given[0]}")
    elif own and not data.train_path:
        error(f"'data.{own[0]}' goes with 'data.train_path' (a path for each split); give the training data too",
              f"data.{own[0]}", "data.train_path")
    elif not data.mock and not data.path and not data.train_path:
        error("config key 'data.path' is required (a preprocessed prefix from tools/preprocess_data.py; or "
              "'data.train_path' and 'data.valid_path', a path for each split), or set 'data.mock' for random "
              "tokens", "data.path", "data.train_path", "data.mock")
    elif data.path and data.train_path:
        error("give the data as 'data.path' (divided by 'data.split') or as a path for each split "
              "('data.train_path', 'data.valid_path', 'data.test_path'), not both", "data.path", "data.train_path")
    elif data.train_path and data.split != type(data)().split:  # its default
        error(f"'data.split' {data.split!r} divides 'data.path'; with a path for each split it divides nothing: "
              f"remove it", "data.split", "data.train_path")
    elif data.train_path and not data.valid_path and cfg.eval.validates:
        error(f"evaluation every {cfg.eval.interval} steps ('eval.interval') needs validation data: give "
              f"'data.valid_path', or set 'eval.interval' 0", "data.valid_path", "eval.interval")
    for key in data.EOD_KEYS:
        if getattr(data, key) and data.mock:
            error(f"'data.{key}' acts at end-of-document tokens, and random tokens ('data.mock') have none: "
                  f"remove it", f"data.{key}", "data.mock")
        elif getattr(data, key) and not data.tokenizer.given:
            error(f"'data.{key}' needs the tokenizer's end-of-document id: give the tokenizer the data was "
                  f"preprocessed with ('data.tokenizer_model', or 'data.vocab_file' and 'data.merge_file')",
                  f"data.{key}", "data.tokenizer_model", "data.vocab_file")


def _warmup(sched) -> str:
    """The warmup as the config gave it, for an error: ``'scheduler.warmup_iters' (N)`` or its fraction."""
    if sched.warmup_fraction is None:
        return f"'{_warmup_key(sched)}' ({sched.warmup_length})"
    return (f"the {sched.warmup_length} warmup {sched.unit} of 'scheduler.warmup_fraction' "
            f"({sched.warmup_fraction})")


def _warmup_key(sched) -> str:
    if sched.warmup_fraction is not None:
        return "scheduler.warmup_fraction"
    return "scheduler.warmup_samples" if sched.in_samples else "scheduler.warmup_iters"


def _training_requirements(cfg: "HybridConfig", problems: List[ConfigError]) -> None:
    """Add to ``problems`` an error for each setting the trainer cannot run without (the engine alone needs
    none of them)."""
    error = _adder(cfg, problems)
    if cfg.run.train_iters is None and cfg.run.train_samples is None and not cfg.run.skip_train:
        error("give the run's length: 'run.train_iters' (optimizer steps) or 'run.train_samples'",
              "run.train_iters", "run.train_samples")
    model = cfg.model
    shape = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    if model.preset is None and any(getattr(model, k) is None for k in shape):
        keys = [f"model.{k}" for k in ("preset",) + shape]
        error("give a model: 'model.preset', or all of 'model.num_layers', 'model.hidden_size', "
              "'model.num_attention_heads' and 'model.seq_length'", *keys)
    if model.vocab_size is None and not cfg.data.tokenizer.given and model.preset is None:
        error("the vocabulary size is unknown: give a tokenizer ('data.tokenizer_model', or 'data.vocab_file' and "
              "'data.merge_file' with 'data.tokenizer_type' GPT2BPETokenizer), 'model.vocab_size' or "
              "'model.preset'", "data.tokenizer_model", "data.vocab_file", "model.vocab_size", "model.preset")
    _data_rules(cfg, error)
    ckpt = cfg.checkpoint
    for key in ("finetune", "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        if getattr(ckpt, key) and ckpt.load is None:
            error(f"config key 'checkpoint.{key}' changes how a checkpoint is loaded; it needs "
                  f"'checkpoint.load'", f"checkpoint.{key}", "checkpoint.load")
    if ckpt.override_opt_param_scheduler and ckpt.use_checkpoint_opt_param_scheduler:
        error("'checkpoint.override_opt_param_scheduler' keeps the configured schedule and "
              "'checkpoint.use_checkpoint_opt_param_scheduler' takes the saved one: give one",
              "checkpoint.override_opt_param_scheduler", "checkpoint.use_checkpoint_opt_param_scheduler")
    if ckpt.use_checkpoint_args and ckpt.load is None:
        error("config key 'checkpoint.use_checkpoint_args' reads the model settings from the checkpoint loaded; "
              "it needs 'checkpoint.load'", "checkpoint.use_checkpoint_args", "checkpoint.load")
    if ckpt.async_save and ckpt.save is None:
        error("config key 'checkpoint.async_save' writes the trainer's checkpoints in the background; it "
              "needs 'checkpoint.save' (a directory to save in)", "checkpoint.async_save", "checkpoint.save")
    if cfg.micro_batch_size is None and cfg.global_batch_size is None:
        error("give a batch size: 'micro_batch_size' (the global batch is then micro batch x "
              "accumulation x data-parallel size) and/or 'global_batch_size'",
              "micro_batch_size", "global_batch_size")
    if model.sequence_parallel and (cfg.tensor_parallel_size or 1) == 1:
        error("config key 'model.sequence_parallel' needs 'tensor_parallel_size' > 1",
              "model.sequence_parallel", "tensor_parallel_size")
