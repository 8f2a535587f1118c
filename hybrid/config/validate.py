"""Every rule a :class:`~hybrid.config.schema.HybridConfig` must satisfy, in one place.

Per-key rules (``choices``, bounds) come from the schema's field metadata;
rules that tie keys together are listed in :func:`_cross_key_rules`. Rules that
need the world (the batch sizes against the data-parallel size, the tensor
parallel size against the topology) are checked when the world is known, in
:func:`hybrid.config.batch.resolve_batch` and by the engine.
"""

from __future__ import annotations

import dataclasses
import math

from hybrid.config.errors import ConfigError, value_suggestion
from hybrid.config.schema import ZERO_STAGES, HybridConfig


def validate(cfg: HybridConfig) -> None:
    """Raise :class:`ConfigError` naming the first key that breaks a rule."""
    _check_fields(cfg, "")
    _cross_key_rules(cfg)


def _check_fields(section, path: str) -> None:
    for f in dataclasses.fields(section):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, key)
            continue
        if value is None:
            continue
        meta = f.metadata
        if "choices" in meta and value not in meta["choices"]:
            choices = [str(c) for c in meta["choices"]]
            raise ConfigError(f"config key '{key}' must be one of {', '.join(choices)}; got {value!r}."
                              f"{value_suggestion(str(value), choices)}")
        for number in (value if isinstance(value, tuple) else (value,)):
            _check_bounds(key, number, meta)


def _check_bounds(key: str, value, meta) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if "ge" in meta and not value >= meta["ge"]:
        raise ConfigError(f"config key '{key}' must be >= {meta['ge']}, got {value!r}")
    if "gt" in meta and not value > meta["gt"]:
        raise ConfigError(f"config key '{key}' must be > {meta['gt']}, got {value!r}")
    if "le" in meta and not value <= meta["le"]:
        raise ConfigError(f"config key '{key}' must be <= {meta['le']}, got {value!r}")
    if "lt" in meta and not value < meta["lt"]:
        raise ConfigError(f"config key '{key}' must be < {meta['lt']}, got {value!r}")


def _cross_key_rules(cfg: HybridConfig) -> None:
    if cfg.zero.stage not in ZERO_STAGES:
        raise ConfigError(f"config key 'zero.stage' must be one of 0, 1, 2, 3, got {cfg.zero.stage}")
    if cfg.zero.offload_optimizer != "none" and cfg.zero.stage == 0:
        raise ConfigError("config key 'zero.offload_optimizer' is 'cpu' but 'zero.stage' is 0; offload moves the "
                          "partitioned optimizer state, so set zero.stage to 1, 2 or 3, or offload_optimizer to none")
    if cfg.autocast and cfg.precision == "fp32":
        raise ConfigError("config key 'autocast' is true but 'precision' is fp32; autocast runs the forward "
                          "in bf16 or fp16: set precision to bf16 or fp16, or autocast to false")

    opt = cfg.optimizer
    for i, beta in enumerate(opt.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"config key 'optimizer.betas[{i}]' must be in [0, 1), got {beta!r}")
    if opt.momentum != 0.0 and opt.type != "sgd":
        raise ConfigError(f"config key 'optimizer.momentum' applies to sgd only, but optimizer.type is "
                          f"{opt.type!r}; remove it or set optimizer.type to sgd")

    sched = cfg.scheduler
    if sched.type in ("linear", "cosine"):
        if sched.decay_iters is None:
            raise ConfigError(f"scheduler.type {sched.type!r} needs 'scheduler.decay_iters' (the step at which "
                              f"the learning rate reaches scheduler.min_lr, warmup included)")
        if sched.decay_iters <= sched.warmup_iters:
            raise ConfigError(f"config key 'scheduler.decay_iters' ({sched.decay_iters}) must be greater than "
                              f"'scheduler.warmup_iters' ({sched.warmup_iters}): decay starts after warmup")
    if sched.warmup_style == "log" and 0 < sched.warmup_iters < 2:
        raise ConfigError(f"scheduler.warmup_style 'log' needs scheduler.warmup_iters >= 2, got "
                          f"{sched.warmup_iters} (log(1) = 0 leaves nothing to warm up over)")
    if sched.min_lr > opt.lr:
        raise ConfigError(f"config key 'scheduler.min_lr' ({sched.min_lr}) exceeds the peak "
                          f"'optimizer.lr' ({opt.lr})")
    if sched.warmup_start_lr > opt.lr:
        raise ConfigError(f"config key 'scheduler.warmup_start_lr' ({sched.warmup_start_lr}) exceeds the "
                          f"peak 'optimizer.lr' ({opt.lr})")

    if cfg.tensorboard.enabled and not cfg.tensorboard.output_path:
        raise ConfigError("tensorboard.enabled is true but 'tensorboard.output_path' is empty; give a directory")

    micro, accum, glob = cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.global_batch_size
    if micro is not None and accum is not None and glob is not None and glob % (micro * accum) != 0:
        raise ConfigError(f"global_batch_size {glob} is not divisible by micro_batch_size {micro} x "
                          f"gradient_accumulation_steps {accum} = {micro * accum}; global batch = micro "
                          f"batch x accumulation x data-parallel size")
