"""Config sections -> the objects the engine drives (loss scaler, LR schedule, weight-decay grouping)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hybrid.config.errors import ConfigError
from hybrid.config.schema import HybridConfig
from hybrid.optim.lr_schedule import LRSchedule
from hybrid.optim.wd_schedule import WeightDecaySchedule
from hybrid.optim.weight_decay import decay_everything, exclude_1d_params  # noqa: F401 - re-exported
from hybrid.zero import LossScaler

NoDecayFn = Callable[[str, torch.nn.Parameter], bool]


def build_loss_scaler(cfg: HybridConfig) -> Optional[LossScaler]:
    """A dynamic or static scaler for fp16; None (no scaling) for bf16 and fp32."""
    if cfg.precision != "fp16":
        return None
    ls = cfg.loss_scaling
    return LossScaler(dynamic=ls.loss_scale == 0, initial_scale_power=ls.initial_scale_power,
                      static_scale=ls.loss_scale if ls.loss_scale > 0 else 1.0, window=ls.loss_scale_window,
                      hysteresis=ls.hysteresis, min_scale=ls.min_loss_scale)


def build_lr_schedule(cfg: HybridConfig) -> LRSchedule:
    s = cfg.scheduler
    return LRSchedule(cfg.optimizer.lr, decay_style=s.type, warmup_iters=s.warmup_length,
                      warmup_style=s.warmup_style, warmup_start_lr=s.warmup_start_lr,
                      decay_iters=s.decay_length, min_lr=s.min_lr, unit=s.unit,
                      wsd_decay_iters=s.wsd_length, wsd_decay_style=s.wsd_decay_style,
                      decoupled_lr=cfg.optimizer.decoupled_lr, decoupled_min_lr=cfg.optimizer.decoupled_min_lr)


def build_wd_schedule(cfg: HybridConfig) -> WeightDecaySchedule:
    """The weight decay of each step, at the learning-rate schedule's position (constant unless the config grows it)."""
    start, end = cfg.optimizer.weight_decay_range
    return WeightDecaySchedule(start, end, cfg.optimizer.weight_decay_incr_style,
                               cfg.scheduler.weight_decay_incr_length)


def no_weight_decay_rule(cfg: HybridConfig, user_rule: Optional[NoDecayFn]) -> NoDecayFn:
    """The user's rule when given, else the config's default (``optimizer.decay_1d_params``)."""
    if user_rule is not None:
        if not callable(user_rule):
            raise TypeError(f"no_weight_decay must be a callable (name, param) -> bool, got {user_rule!r}")
        return user_rule
    return decay_everything if cfg.optimizer.decay_1d_params else exclude_1d_params


def check_recompute(model: torch.nn.Module, recompute: str) -> None:
    """A requested recomputation must be the one the model was built with; the engine cannot add it.

    ``'none'`` (the default) requests nothing and leaves a model_zoo model's own setting alone.
    """
    model_cfg = getattr(model, "config", None)
    built_with = getattr(model_cfg, "recompute", None)
    if built_with is None:
        if recompute != "none":
            raise ConfigError(f"config key 'recompute' is {recompute!r}, but {type(model).__name__} has no "
                              f"recomputation switch; it applies to model_zoo models (build them with "
                              f"GPTConfig(recompute=...)), or checkpoint your own layers and set 'none'")
        return
    if recompute != "none" and built_with != recompute:
        raise ConfigError(f"config key 'recompute' is {recompute!r} but the model was built with "
                          f"recompute={built_with!r}; build the model with GPTConfig(recompute={recompute!r}) "
                          f"or set 'recompute' to {built_with!r}")
