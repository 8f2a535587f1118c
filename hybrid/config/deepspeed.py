"""Read a DeepSpeed-style JSON config into a :class:`~hybrid.config.schema.HybridConfig`.

Every DeepSpeed key falls in one of four kinds:

* mapped: translated to a hybrid key (see ``docs/config.md`` for the table);
* fixed: a setting hybrid always has, accepted only at that value
  (``zero_optimization.contiguous_gradients: true``); the dtypes of
  ``data_types`` are such settings at the value the config's precision gives
  (``grad_accum_dtype`` is what hybrid accumulates gradients in: the
  parameters' dtype, see :func:`hybrid.layout.precision_traits`);
* no effect: a tuning knob of DeepSpeed's own implementation with nothing to
  tune in hybrid's (``zero_optimization.allgather_bucket_size``), accepted
  when its value has the right type;
* known but unsupported: an error that names the key and says what to do. A
  feature section switched off (``"flops_profiler": {"enabled": false}``) is
  accepted: hybrid runs without the feature too;
* unknown: an error with the nearest known key.

Every key of the config is checked before anything is translated, and all the
keys that need changing are named in one error, each with its fix. Nothing is
silently ignored. Values DeepSpeed's Hugging Face integration
fills in (``"auto"``) must be given as numbers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from hybrid.compression import OFF, ONEBIT_ADAM, ZERO_ONE_ADAM, formats_for_deepspeed
from hybrid.config.deepspeed_schedules import DEEPSPEED_SCHEDULER_PARAMS, deepspeed_schedule_kwargs
from hybrid.config.errors import ConfigError, one_error_for_all, suggestion, value_suggestion
from hybrid.config.parse import apply_overrides
from hybrid.config.schema import HybridConfig
from hybrid.layout import precision_traits

# section -> {DeepSpeed key: hybrid dotted key}
_MAPPED = {
    "": {"train_batch_size": "global_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
         "gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "clip_grad",
         "steps_per_print": "steps_per_print"},
    "zero_optimization": {"stage": "zero.stage", "reduce_bucket_size": "zero.bucket_size",
                          "overlap_comm": "zero.overlap_comm",
                          "stage3_param_persistence_threshold": "zero.persistence_threshold",
                          "stage3_max_live_parameters": "zero.max_live_parameters",
                          "stage3_prefetch_bucket_size": "zero.prefetch_bucket_size",
                          "stage3_max_reuse_distance": "zero.max_reuse_distance",
                          "zero_hpz_partition_size": "zero.hpz_partition_size",
                          # DeepSpeed reads its ZeRO-3 keys without the stage3_ prefix too
                          "param_persistence_threshold": "zero.persistence_threshold",
                          "max_live_parameters": "zero.max_live_parameters",
                          "prefetch_bucket_size": "zero.prefetch_bucket_size",
                          "max_reuse_distance": "zero.max_reuse_distance",
                          # a consolidated 16-bit model written with each save (and DeepSpeed's other spellings)
                          "stage3_gather_16bit_weights_on_model_save": "checkpoint.save_16bit_model",
                          "gather_16bit_weights_on_model_save": "checkpoint.save_16bit_model",
                          "stage3_gather_fp16_weights_on_model_save": "checkpoint.save_16bit_model"},
    "zero_optimization.offload_optimizer": {"device": "zero.offload_optimizer"},
    "fp16": {"loss_scale": "loss_scaling.loss_scale", "initial_scale_power": "loss_scaling.initial_scale_power",
             "loss_scale_window": "loss_scaling.loss_scale_window", "hysteresis": "loss_scaling.hysteresis",
             "min_loss_scale": "loss_scaling.min_loss_scale"},
    "tensorboard": {"enabled": "tensorboard.enabled", "output_path": "tensorboard.output_path",
                    "job_name": "tensorboard.job_name"},
}
# Sections whose keys are handled by dedicated code below (besides those in _MAPPED).
_HANDLED = {"": {"zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "tensorboard", "data_types",
                 "communication_data_type", "activation_checkpointing"},
            "zero_optimization": {"offload_optimizer", "zero_quantized_gradients", "zero_quantized_weights",
                                  "cpu_offload"},
            "fp16": {"enabled"}, "bf16": {"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"},
            "optimizer": {"type", "params"},
            "scheduler": {"type", "params"}, "data_types": {"grad_accum_dtype", "param_dtype", "buffer_dtype"}}

# Settings hybrid always has: accepted at exactly this value.
_FIXED = {
    "": {"wall_clock_breakdown": False, "prescale_gradients": False, "sparse_gradients": False,
         "gradient_predivide_factor": 1.0, "memory_breakdown": False, "dump_state": False,
         "zero_allow_untested_optimizer": False},
    "zero_optimization": {"contiguous_gradients": True, "reduce_scatter": True, "allgather_partitions": True,
                          # the off values of features listed in _UNSUPPORTED, whose hint the other values get
                          "cpu_offload": False, "round_robin_gradients": False, "elastic_checkpoint": False},
    # hybrid pins host buffers whenever the model is on a CUDA device
    "zero_optimization.offload_optimizer": {"pin_memory": True},
    "fp16": {"auto_cast": False, "consecutive_hysteresis": False},
    "optimizer.params": {"bias_correction": True, "amsgrad": False, "nesterov": False, "dampening": 0.0},
}

_ISSUE_8 = "hybrid does not implement it (parameter offload, NVMe and sub-groups are out of scope); remove it"
# Known DeepSpeed keys hybrid does not support, with what to do instead.
_UNSUPPORTED = {
    "": {
        "amp": "use bf16.enabled or fp16.enabled", "activation_checkpointing":
        "set hybrid's 'recompute' (--recompute-granularity none|full|selective) instead", "flops_profiler": "remove it",
        "zero_allow_untested_optimizer": "remove it; hybrid builds the optimizer from 'optimizer'",
        "zero_force_ds_cpu_optimizer": _ISSUE_8, "sparse_attention": "remove it",
        "wandb": "give hybrid-train --wandb-project PROJECT instead (the trainer's scalars, as TensorBoard gets them: "
                 "docs/monitoring.md)",
        "csv_monitor": "remove it", "comet": "remove it", "comms_logger": "use engine.comm_report()",
        "elasticity": "remove it", "pipeline": "remove it",
        "seq_parallel_communication_data_type": "remove it", "checkpoint": "remove it",
        "aio": _ISSUE_8, "autotuning": "remove it", "compression_training": "remove it",
        "data_efficiency": "remove it", "curriculum_learning": "remove it", "quantize_training": "remove it",
        "eigenvalue": "remove it", "progressive_layer_drop": "remove it", "disable_allgather": "remove it",
        "dataloader_drop_last": "remove it", "load_universal_checkpoint": "remove it",
        "use_node_local_storage": "remove it", "nebula": "remove it", "timers": "remove it",
        "weight_quantization": "remove it", "hybrid_engine": "remove it", "graph_harvesting": "remove it",
        "torch_autocast": "set hybrid's 'precision' and 'autocast: true' instead", "compile": "remove it",
        "bfloat16": "write it as 'bf16'", "train_batch_size_per_gpu": "use train_micro_batch_size_per_gpu",
        "gradient_allreduce_op": "hybrid averages gradients over the data-parallel ranks; remove it",
        "managed_gradient_accumulation": "remove it; hybrid accumulates gradients over gradient_accumulation_steps",
        "use_data_before_expert_parallelism": "Mixture-of-Experts is not implemented yet (issue: MoE); remove it",
    },
    "zero_optimization": {
        "offload_param": "ZeRO-3 parameter offload (the parameter partitions in host or NVMe memory, fetched for "
                         "each module) is not implemented: hybrid's stage 3 keeps each rank's 1/dp of the parameters "
                         "on its device; offload_optimizer.device cpu moves the fp32 masters and the optimizer "
                         "state, most of the memory; remove it (or give device none)",
        "zenflow": "ZenFlow (offloading the updates of the less important gradients) is not implemented; hybrid "
                   "offloads the whole optimizer step (offload_optimizer.device cpu); remove it",
        "cpu_offload_params": _ISSUE_8, "cpu_offload_use_pin_memory": "remove it; host buffers are pinned on GPUs",
        "stage3_model_persistence_threshold": _ISSUE_8, "model_persistence_threshold": _ISSUE_8,
        "cpu_offload_param": _ISSUE_8, "pipeline_loading_checkpoint": "remove it",
        "leaf_module": "Mixture-of-Experts is not implemented yet (issue: MoE); remove it",
        "save_muon_momentum_buffer_in_memory": "hybrid has no Muon optimizer; remove it",
        "zero_quantized_nontrainable_weights": "hybrid trains every weight (none is frozen); remove it",
        "zeropp_loco_param": "ZeRO++'s LoCo error feedback is not implemented; remove it",
        "elastic_checkpoint": "remove it", "load_from_fp32_weights": "remove it",
        "round_robin_gradients": "remove it",
        "mics_shard_size": "remove it", "mics_hierarchical_params_gather": "remove it",
        "ignore_unused_parameters": "remove it", "legacy_stage1": "remove it",
        "memory_efficient_linear": "remove it", "use_multi_rank_bucket_allreduce": "remove it",
    },
    "fp16": {"fp16_master_weights_and_grads": "hybrid keeps fp32 master weights; remove it"},
    "bf16": {"immediate_grad_update": "remove it", "check_grad_overflow": "remove it",
},
    "zero_optimization.offload_optimizer": {
        "ratio": "offloading a part of the optimizer state is not implemented: hybrid offloads all of it (device "
                 "cpu) or none; remove it",
        "nvme_path": _ISSUE_8, "buffer_count": _ISSUE_8, "fast_init": _ISSUE_8, "pipeline_read": _ISSUE_8,
        "pipeline_write": _ISSUE_8, "pipeline": _ISSUE_8, "buffer_size": _ISSUE_8, "max_in_cpu": _ISSUE_8,
        "super_offload": "SuperOffload is not implemented; hybrid offloads the optimizer step to the CPU "
                         "(offload_optimizer.device cpu); remove it"},
    "optimizer.params": {"torch_adam": "remove it; hybrid picks its Adam implementation itself",
                         "max_grad_norm": "clip with the top-level gradient_clipping instead"},
}

# Accepted with no effect when the value has this type (section -> {key: type}): knobs of DeepSpeed's own
# implementation that hybrid's has no counterpart of. allgather_bucket_size caps DeepSpeed's staging buffer for
# the parameter all-gather; hybrid gathers each partition in place into the flat buffer, with no staging copy.
# The 1-bit optimizers' transport switches: hybrid's communicator picks the backend of the device itself.
# ZeroOneAdam's bias_correction: its update, like DeepSpeed's, applies none either way. (Adam's, AdamW's and
# OneBitAdam's is mapped to optimizer.bias_correction; this entry checks its type for them too.)
_NO_EFFECT = {
    # ... and how DeepSpeed's ZeRO-3 fetches parameters (in sequence, by all-reduce, grouped by module size), its
    # debug checks and warnings: hybrid's stage 3 gathers each module's own flat partitions, and computes the same
    "zero_optimization": {"allgather_bucket_size": (int, float), "allgather_sequential": bool,
                          "stage3_allgather_sequential": bool, "use_all_reduce_for_fetch_params": bool,
                          "stage3_use_all_reduce_for_fetch_params": bool, "module_granularity_threshold": int,
                          "stage3_module_granularity_threshold": int, "enable_sanity_checks": bool,
                          "log_trace_cache_warnings": bool, "override_module_apply": bool},
    # the share of CPU cores DeepSpeed's CPU Adam uses; hybrid's runs on torch's threads
    "zero_optimization.offload_optimizer": {"cpuadam_cores_perc": (int, float)},
    # how DeepSpeed's checkpointing stores what it keeps (partitioned over TP, contiguous, on the CPU), how many
    # checkpoints it expects, and its timers: hybrid's recompute keeps each layer's input, and recomputes the same
    "activation_checkpointing": {"partition_activations": bool, "contiguous_memory_optimization": bool,
                                 "cpu_checkpointing": bool, "number_checkpoints": (int, type(None)),
                                 "synchronize_checkpoint_boundary": bool, "profile": bool},
    "optimizer.params": {"cuda_aware": bool, "comm_backend_name": str, "bias_correction": bool},
}

_ROUNDING = ("hybrid averages gradients over the data-parallel ranks in its all-reduce; dividing before the sum "
             "rather than after changes only the rounding (in fp16, an overflow of the sum skips the step and lowers "
             "the dynamic loss scale)")
# Keys accepted at any value of the right type, that change nothing here; named in one note
# (:func:`deepspeed_notes`). Each says why.
_NOTED = {
    "": {"prescale_gradients": (bool, _ROUNDING), "gradient_predivide_factor": ((int, float), _ROUNDING),
         "zero_allow_untested_optimizer": (bool, "hybrid builds its own optimizer from 'optimizer'; there is no "
                                                 "untested client optimizer to allow"),
         "log_level": (str, "the verbosity of DeepSpeed's own logger")},
    "zero_optimization": {"contiguous_gradients": (bool, "hybrid's gradients always live in flat contiguous "
                                                          "buffers; the values are the same"),
                          "sub_group_size": ((int, float), "DeepSpeed's ZeRO-3 steps the optimizer over sub-groups of "
                                                           "this many elements to bound the step's temporary memory; "
                                                           "hybrid steps each rank's partition at once, and Adam's "
                                                           "elementwise update gives the same values")},
    "fp16": {"auto_cast": (bool, "it casts the model's floating-point inputs to fp16; a GPT's inputs are token ids, "
                                 "which it leaves alone")},
}
# Keys DeepSpeed reads into its config and nothing of DeepSpeed acts on (or does not read at all): ignored, named
# in their own note.
_IGNORED_BY_DEEPSPEED = {"": {"cuda_visible_devices": "DeepSpeed's config does not read it (devices are the "
                                                      "launcher's CUDA_VISIBLE_DEVICES)",
                              "disable_allgather": "DeepSpeed reads it and nothing acts on it"}}
# Fixed keys whose other value is a feature not implemented yet: the reason, instead of "always behaves as".
_FIXED_REASONS = {"optimizer.params.bias_correction": (
    "only Adam, AdamW, OneBitAdam and Lamb have a bias correction to switch off (hybrid's optimizer.bias_correction); "
    "remove it")}

# DeepSpeed's dtype keys: the precision of one kind of tensor each, accepted when it is the one hybrid keeps at
# the config's precision (that is, the field of hybrid.layout.precision_traits named here: the gradients are
# reduced in the dtype they accumulate in); null is DeepSpeed's default, which leaves the choice to the precision
# as well.
_DATA_TYPES = {"data_types.grad_accum_dtype": "grads", "data_types.param_dtype": "params",
               "data_types.buffer_dtype": "buffers", "communication_data_type": "grads"}
# the spellings DeepSpeed reads for each precision (its DtypeEnum)
_DTYPE_SPELLINGS = {spelling: precision for precision, spellings in (
    ("fp32", ("fp32", "float32", "float", "torch.float32")),
    ("fp16", ("fp16", "float16", "half", "torch.float16")),
    ("bf16", ("bf16", "bfloat16", "bfloat", "torch.bfloat16"))) for spelling in spellings}

_OPTIMIZER_PARAMS = {"adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"},
                     "adamw": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"},
                     "sgd": {"lr", "momentum", "weight_decay"},
                     "onebitadam": {"lr", "betas", "eps", "weight_decay", "freeze_step", "cuda_aware",
                                    "comm_backend_name", "bias_correction"},
                     "zerooneadam": {"lr", "betas", "eps", "weight_decay", "var_freeze_step", "var_update_scaler",
                                     "local_step_scaler", "local_step_clipper", "cuda_aware", "comm_backend_name",
                                     "bias_correction"},
                     "lamb": {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff"}}
_SUPPORTED_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "onebitadam": "OneBitAdam",
                         "zerooneadam": "ZeroOneAdam", "lamb": "Lamb"}
# DeepSpeed names -> hybrid's optimizer.type where they differ
_OPTIMIZER_TYPES = {"onebitadam": ONEBIT_ADAM, "zerooneadam": ZERO_ONE_ADAM}
_UNSUPPORTED_OPTIMIZERS = ("onebitlamb", "adagrad", "lion", "muadam",
                           "muadamw", "musgd", "muon", "adafactor")


def known_top_level_keys() -> set:
    return (set(_MAPPED[""]) | _HANDLED[""] | set(_FIXED[""]) | set(_UNSUPPORTED[""]) | set(_NOTED[""])
            | set(_IGNORED_BY_DEEPSPEED[""]))


def deepspeed_notes(ds: Mapping[str, Any]) -> List[str]:
    """The notes for a DeepSpeed config :func:`from_deepspeed` accepts: one naming its keys that change nothing
    here (each with why), one naming the keys DeepSpeed itself ignores, one for each setting read as another;
    none when it has none."""
    noted, ignored, read_as = [], [], []
    for table, out in ((_NOTED, noted), (_IGNORED_BY_DEEPSPEED, ignored)):
        for name, keys in table.items():
            section = ds if not name else ds.get(name)
            if not isinstance(section, Mapping):
                continue
            for key, entry in keys.items():
                if key in section:
                    why = entry[1] if isinstance(entry, tuple) else entry
                    out.append(f"{name + '.' if name else ''}{key} ({why})")
    if "activation_checkpointing" in ds:
        read_as.append("DeepSpeed key activation_checkpointing read as recompute full (every layer recomputed in "
                       "the backward pass, Megatron-DeepSpeed's --checkpoint-activations); its storage settings "
                       "change nothing here")
    zero = ds.get("zero_optimization")
    if isinstance(zero, Mapping) and zero.get("cpu_offload") is True:
        read_as.append("DeepSpeed key zero_optimization.cpu_offload read as offload_optimizer.device cpu (its "
                       "current spelling)")
    lines = [f"DeepSpeed keys with no effect here: {'; '.join(noted)}"] if noted else []
    lines += [f"DeepSpeed keys DeepSpeed itself ignores, ignored: {'; '.join(ignored)}"] if ignored else []
    return lines + read_as


def from_deepspeed(ds: Mapping[str, Any]) -> HybridConfig:
    """Translate a DeepSpeed config dict; raises :class:`ConfigError` on anything not translatable.

    A value hybrid rejects names its hybrid key and the DeepSpeed key it came from.
    """
    settings, origin = _translate(ds)
    try:
        return apply_overrides(HybridConfig(), settings)
    except ConfigError as err:
        problems = [_naming_the_source(problem, origin) for problem in getattr(err, "problems", (err,))]
        raise one_error_for_all(problems, "config keys") from None


def _naming_the_source(err: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """``err`` about a hybrid key, naming the DeepSpeed key it came from (``origin``: hybrid key -> DeepSpeed key)."""
    source = next((origin[k.split("[")[0]] for k in err.keys if k.split("[")[0] in origin), None)
    if source is None:
        return err
    return ConfigError(f"{err.message} [from DeepSpeed key '{source}']", keys=err.keys)


def deepspeed_settings(ds: Mapping[str, Any]) -> Dict[str, Any]:
    """The hybrid settings a DeepSpeed config sets, as dotted keys (``{"zero.stage": 2, ...}``), unvalidated."""
    return _translate(ds)[0]


def _translate(ds: Mapping[str, Any]):
    """(dotted hybrid key -> value, dotted hybrid key -> the DeepSpeed key it came from)."""
    if not isinstance(ds, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, got {type(ds).__name__}")
    _reject_auto(ds, "")
    native: Dict[str, Any] = {}
    origin: Dict[str, str] = {}  # hybrid key -> DeepSpeed key, for error messages

    def put(native_key: str, value: Any, ds_key: str) -> None:
        native[native_key] = value
        origin[native_key] = ds_key

    _check_every_key(ds)
    _map_section(ds, "", put)
    for section in ("zero_optimization", "fp16", "bf16", "tensorboard"):
        if section in ds:
            sub = _section(ds, section)
            _map_section(sub, section, put)
            if section == "zero_optimization":
                _map_quantization(sub, put)
            if section == "zero_optimization" and "offload_optimizer" in sub:
                _map_section(_section(sub, "offload_optimizer"), "zero_optimization.offload_optimizer", put)
    _map_precision(ds, put)
    if "activation_checkpointing" in ds:
        put("recompute", "full", "activation_checkpointing")
    if isinstance(ds.get("zero_optimization"), Mapping) and ds["zero_optimization"].get("cpu_offload") is True:
        put("zero.offload_optimizer", "cpu", "zero_optimization.cpu_offload")
    if "optimizer" in ds:
        _map_optimizer(_section(ds, "optimizer"), put)
    if "scheduler" in ds:
        _map_scheduler(_section(ds, "scheduler"), native, put)
    return native, origin


def _section(ds: Mapping, name: str) -> Mapping:
    value = ds[name]
    if not isinstance(value, Mapping):
        raise ConfigError(f"DeepSpeed key '{name}' must be an object, got {value!r}")
    return value


def _reject_auto(node: Any, path: str) -> None:
    if isinstance(node, Mapping):
        for key, value in node.items():
            _reject_auto(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, str) and node == "auto":
        raise ConfigError(f"DeepSpeed key '{path}' is \"auto\", which only DeepSpeed's Hugging Face integration "
                          f"fills in; give the value explicitly")


def _check_every_key(ds: Mapping) -> None:
    """Check the keys of every section :func:`_translate` reads; one ConfigError naming all that need changing."""
    problems: List[str] = []
    _check_keys(ds, "", problems)
    for name in ("zero_optimization", "fp16", "bf16", "tensorboard", "optimizer", "scheduler", "data_types",
                 "activation_checkpointing"):
        if name in ds:
            _check_keys(_section(ds, name), name, problems)
    if isinstance(ds.get("zero_optimization", {}).get("offload_optimizer"), Mapping):
        _check_keys(ds["zero_optimization"]["offload_optimizer"], "zero_optimization.offload_optimizer", problems)
    optimizer = ds.get("optimizer", {})
    kind = optimizer.get("type").lower() if isinstance(optimizer.get("type"), str) else None
    if kind in _OPTIMIZER_PARAMS and isinstance(optimizer.get("params"), Mapping):
        # an unsupported type or params of the wrong type are the optimizer's own errors, raised when it is mapped
        _check_keys(optimizer["params"], "optimizer.params", problems, allowed=_OPTIMIZER_PARAMS[kind])
    _check_data_types(ds, problems)
    if problems:
        raise one_error_for_all([ConfigError(problem) for problem in problems], "DeepSpeed keys")


def _check_keys(section: Mapping, name: str, problems: List[str], allowed=None) -> None:
    """Add to ``problems`` the fixed keys of one section at other values, its unsupported keys (unless switched
    off), its no-effect keys of the wrong type and its unknown keys. ``allowed``: the keys a section admits besides
    its mapped ones (an optimizer's parameters); given, it also decides which no-effect keys are admitted."""
    accepted = set(_MAPPED.get(name, {})) | _HANDLED.get(name, set()) | set(allowed or ())
    no_effect = _NO_EFFECT.get(name, {})
    if allowed is None:
        accepted |= set(no_effect)
    fixed = _FIXED.get(name, {})
    unsupported = _UNSUPPORTED.get(name, {})
    prefix = f"{name}." if name else ""
    noted = {**_NOTED.get(name, {}), **{k: (object, why) for k, why in _IGNORED_BY_DEEPSPEED.get(name, {}).items()}}
    for key, value in section.items():
        if key in noted:
            kind = noted[key][0]
            if not _is_a(value, kind):
                problems.append(f"DeepSpeed key '{prefix}{key}' must be {_type_name(kind)}, got {value!r}")
            continue
        if key == "cpu_offload" and name == "zero_optimization" and not isinstance(value, bool):
            problems.append(f"DeepSpeed key '{prefix}{key}' must be true or false, got {value!r}")
            continue
        if key in accepted:
            kind = no_effect.get(key)
            if kind is not None and not _is_a(value, kind):
                problems.append(f"DeepSpeed key '{prefix}{key}' must be {_type_name(kind)}, got {value!r}")
            continue
        if key in fixed and value == fixed[key] and isinstance(value, bool) == isinstance(fixed[key], bool):
            continue
        if key in unsupported:
            if not _switched_off(value):
                problems.append(f"DeepSpeed key '{prefix}{key}' is not supported by hybrid: {unsupported[key]}")
            continue
        if key in fixed:
            why = _FIXED_REASONS.get(prefix + key, f"hybrid always behaves as {key}={fixed[key]!r}; set that value "
                                                   f"or remove the key")
            problems.append(f"DeepSpeed key '{prefix}{key}' = {value!r} is not supported: {why}")
            continue
        known = accepted | set(fixed) | set(unsupported) | set(noted)
        problems.append(f"unknown DeepSpeed key '{prefix}{key}'.{suggestion(key, known, prefix)}")


def data_types_problems(ds: Mapping, precision: str) -> List[str]:
    """Each dtype key of the DeepSpeed config ``ds`` (:data:`_DATA_TYPES`) that is not the one hybrid keeps at
    ``precision``: the run's precision once settings given on top of the file (flags, overrides) have changed it."""
    problems: List[str] = []
    _check_data_types(ds, problems, precision)
    return problems


def _check_data_types(ds: Mapping, problems: List[str], precision: Optional[str] = None) -> None:
    """Add to ``problems`` each dtype key (:data:`_DATA_TYPES`) that is not the one hybrid keeps at
    ``precision``, by default the config's own."""
    given = {key: _value_at(ds, key) for key in _DATA_TYPES}
    if all(value is None for value in given.values()):
        return
    if precision is None:
        try:
            precision = _precision(ds) or HybridConfig().precision
        except ConfigError:
            return  # fp16/bf16 'enabled' are wrong: their own error, raised when they are mapped
    traits = precision_traits(precision)
    quantized = _enabled_flag(ds.get("zero_optimization"), "zero_quantized_gradients")
    for key, value in given.items():
        if value is None:
            continue
        named = _DTYPE_SPELLINGS.get(value) if isinstance(value, str) else None
        if named is None:
            problems.append(f"DeepSpeed key '{key}' must be one of fp32, fp16, bf16, got {value!r}")
            continue
        kind = _DATA_TYPES[key]
        want = getattr(traits, kind)
        if key == "communication_data_type" and quantized:
            problems.append(f"DeepSpeed key '{key}' = {value!r} is not supported: with "
                            f"'zero_optimization.zero_quantized_gradients', hybrid sends gradients blockwise-"
                            f"quantized; remove it")
            continue
        if named == want:
            continue
        where = f"with {precision} enabled" if precision != "fp32" else "in fp32 (fp16 and bf16 off)"
        does = {"data_types.grad_accum_dtype": f"accumulates gradients in {want}, the parameters' dtype, at every "
                                               f"ZeRO stage",
                "communication_data_type": f"reduces gradients in {want}, the dtype they accumulate in",
                "data_types.param_dtype": f"trains the parameters in {want}",
                "data_types.buffer_dtype": (f"casts floating-point buffers to {want} with the model" if want else
                                            "casts no buffers: they keep the dtype the model has them in")}[key]
        fix = "remove it" + (f", or set it to {want}" if want else "")
        if kind == "grads" and named == "fp32":
            fix += "; for fp32 gradients, keep fp32 parameters with hybrid's 'autocast: true' instead"
        elif kind == "params" and named != "fp32":
            fix += f" (to train in {named}, set {named}.enabled)"
        problems.append(f"DeepSpeed key '{key}' = {value!r} is not supported: {where}, hybrid {does}; {fix}")


def _value_at(ds: Mapping, dotted: str) -> Any:
    """The value at a dotted DeepSpeed key, None where a section on the way is missing or not an object (those
    are their own errors)."""
    node: Any = ds
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _enabled_flag(section: Any, key: str) -> bool:
    return isinstance(section, Mapping) and section.get(key) is True


def _switched_off(value: Any) -> bool:
    """A feature section with ``"enabled": false``, or an offload section with ``"device": "none"``: the feature
    is off, as it is in hybrid."""
    return isinstance(value, Mapping) and (value.get("enabled") is False
                                           or str(value.get("device", "")).lower() == "none")


def _is_a(value: Any, kind) -> bool:
    if kind is object:
        return True
    # JSON's true is no number here: bool is a subclass of int
    return isinstance(value, kind) and (not isinstance(value, bool) or kind is bool)


def _type_name(kind) -> str:
    if kind == (int, float):
        return "a number"
    if isinstance(kind, tuple):
        return " or ".join(_type_name(k) for k in kind)
    return "null" if kind is type(None) else f"a {kind.__name__}"


def _map_section(section: Mapping, name: str, put) -> None:
    prefix = f"{name}." if name else ""
    for key, native_key in _MAPPED.get(name, {}).items():
        if key in section:
            value = section[key]
            if key == "gradient_clipping" and value is None:
                value = 0.0
            put(native_key, value, prefix + key)


def _map_quantization(zero: Mapping, put) -> None:
    """ZeRO++'s switches: true selects the formats ZeRO++ sends (:func:`hybrid.compression.formats_for_deepspeed`)."""
    formats = dict(zip(("zero_quantized_gradients", "zero_quantized_weights"), formats_for_deepspeed()))
    for key, fmt in formats.items():
        if key not in zero:
            continue
        value = zero[key]
        if not isinstance(value, bool):
            raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}' must be true or false, got {value!r}")
        put("zero." + key[len("zero_"):], fmt if value else OFF, "zero_optimization." + key)


def _enabled(ds: Mapping, name: str) -> bool:
    if name not in ds:
        return False
    value = ds[name].get("enabled", False)
    if not isinstance(value, bool):
        raise ConfigError(f"DeepSpeed key '{name}.enabled' must be true or false, got {value!r}")
    return value


def _precision(ds: Mapping) -> Optional[str]:
    """The precision ``fp16.enabled`` or ``bf16.enabled`` selects (None: neither)."""
    fp16, bf16 = _enabled(ds, "fp16"), _enabled(ds, "bf16")
    if fp16 and bf16:
        raise ConfigError("DeepSpeed keys 'fp16.enabled' and 'bf16.enabled' are both true; enable one of them")
    return "fp16" if fp16 else "bf16" if bf16 else None


_BF16_MASTERS = ("bf16_master_weights_and_grads", "bf16_optimizer_states")


def _map_precision(ds: Mapping, put) -> None:
    precision = _precision(ds)
    if precision is not None:
        put("precision", precision, f"{precision}.enabled")
    bf16 = ds.get("bf16") if isinstance(ds.get("bf16"), Mapping) else {}
    given = {key: bf16[key] for key in _BF16_MASTERS if key in bf16}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise ConfigError(f"DeepSpeed key 'bf16.{key}' must be true or false, got {value!r}")
    on = [key for key, value in given.items() if value]
    if len(on) == 1:
        raise ConfigError(f"DeepSpeed key 'bf16.{on[0]}' alone is not supported: hybrid keeps the optimizer state in "
                          f"the masters' dtype, so bf16 masters come with bf16 optimizer states; set both "
                          f"bf16.{_BF16_MASTERS[0]} and bf16.{_BF16_MASTERS[1]} true (zero.master_precision bf16), or "
                          f"neither")
    if on:
        put("zero.master_precision", "bf16", f"bf16.{on[0]}")


def _map_optimizer(opt: Mapping, put) -> None:
    type_name = opt.get("type")
    if not isinstance(type_name, str):
        raise ConfigError(f"DeepSpeed key 'optimizer.type' must be one of "
                          f"{', '.join(_SUPPORTED_OPTIMIZERS.values())}, got {type_name!r}")
    kind = type_name.lower()
    if kind not in _SUPPORTED_OPTIMIZERS:
        hint = ("it is a DeepSpeed optimizer hybrid does not implement" if kind in _UNSUPPORTED_OPTIMIZERS
                else f"unknown optimizer.{value_suggestion(type_name, _SUPPORTED_OPTIMIZERS.values())}")
        raise ConfigError(f"DeepSpeed optimizer.type {type_name!r} is not supported ({hint}); use one of "
                          f"{', '.join(_SUPPORTED_OPTIMIZERS.values())}")
    params = opt.get("params", {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"DeepSpeed key 'optimizer.params' must be an object, got {params!r}")
    # DeepSpeed's "Adam" is AdamW (decoupled decay) unless adam_w_mode is false.
    if kind in ("adam", "adamw"):
        adam_w_mode = params.get("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ConfigError(f"DeepSpeed key 'optimizer.params.adam_w_mode' must be true or false, "
                              f"got {adam_w_mode!r}")
        if kind == "adamw" and not adam_w_mode:
            raise ConfigError("DeepSpeed optimizer.type 'AdamW' with optimizer.params.adam_w_mode false is "
                              "contradictory; use type 'Adam' with adam_w_mode false for L2-style Adam")
        kind = "adamw" if adam_w_mode else "adam"
    put("optimizer.type", _OPTIMIZER_TYPES.get(kind, kind), "optimizer.type")
    # ZeroOneAdam's is accepted with no effect (_NO_EFFECT): its update has no bias correction to switch off
    if "bias_correction" in params and kind in ("adam", "adamw", "onebitadam", "lamb"):
        put("optimizer.bias_correction", params["bias_correction"], "optimizer.params.bias_correction")
    for key in ("lr", "betas", "eps", "weight_decay", "momentum", "freeze_step", "var_freeze_step",
                "var_update_scaler", "local_step_scaler", "local_step_clipper", "max_coeff", "min_coeff"):
        if key in params:
            put(f"optimizer.{key}", params[key], f"optimizer.params.{key}")


def _map_scheduler(sched: Mapping, native: dict, put) -> None:
    type_name = sched.get("type")
    if type_name not in DEEPSPEED_SCHEDULER_PARAMS:
        others = "LRRangeTest", "OneCycle"
        hint = "" if type_name in others else value_suggestion(str(type_name), DEEPSPEED_SCHEDULER_PARAMS)
        raise ConfigError(f"DeepSpeed scheduler.type {type_name!r} is not supported; use one of "
                          f"{', '.join(DEEPSPEED_SCHEDULER_PARAMS)}.{hint}")
    params = sched.get("params", {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"DeepSpeed key 'scheduler.params' must be an object, got {params!r}")
    defaults = DEEPSPEED_SCHEDULER_PARAMS[type_name]
    for key, value in params.items():
        if key not in defaults:
            raise ConfigError(f"unknown DeepSpeed key 'scheduler.params.{key}' for {type_name}."
                              f"{suggestion(key, defaults, 'scheduler.params.')}")
        if key == "warmup_type" and value not in ("linear", "log"):
            raise ConfigError(f"DeepSpeed key 'scheduler.params.warmup_type' must be 'linear' or 'log', "
                              f"got {value!r}")
        if key != "warmup_type" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"DeepSpeed key 'scheduler.params.{key}' must be a number, got {value!r}")
    for key, default in defaults.items():
        if default is None and key != "warmup_max_lr" and key not in params:
            raise ConfigError(f"DeepSpeed scheduler {type_name} needs 'scheduler.params.{key}'")
    base_lr = native.get("optimizer.lr", HybridConfig().optimizer.lr)
    kwargs = deepspeed_schedule_kwargs(type_name, params, float(base_lr))
    # DeepSpeed's WarmupLR/WarmupDecayLR set the peak through warmup_max_lr, whatever the optimizer's lr.
    put("optimizer.lr", kwargs.pop("max_lr"), f"scheduler.params ({type_name})")
    put("scheduler.type", kwargs.pop("decay_style"), "scheduler.type")
    for key, value in kwargs.items():
        put(f"scheduler.{key}", value, f"scheduler.params ({type_name})")
