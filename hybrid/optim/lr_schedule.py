"""Learning-rate schedules: warmup, then constant, linear or cosine decay to a minimum.

``lr(i)`` is the learning rate at position ``i``: the optimizer steps already
taken (the first step uses ``lr(0)``), or, for a schedule that counts samples
(``unit="samples"``), the samples consumed before the step; the lengths below
are in the same unit. With ``W`` warmup steps,
decay ending at step ``D``, peak ``max_lr`` and floor ``min_lr``::

    i < W  (warmup)   linear: start + (max_lr - start) * i / W
                      log:    start + (max_lr - start) * ln(i + 1) / ln(W)
    W <= i < D        ratio = (i - W) / (D - W)
                      constant: max_lr
                      linear:   min_lr + (max_lr - min_lr) * (1 - ratio)
                      cosine:   min_lr + (max_lr - min_lr) * (1 + cos(pi * ratio)) / 2
    i >= D            min_lr (constant keeps max_lr)

DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR are special cases;
:func:`deepspeed_schedule_kwargs` (defined with the DeepSpeed config
translation, re-exported here) maps their parameters onto this one class.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

# The style names belong to the configuration; the DeepSpeed mapping to its translator.
from hybrid.config.deepspeed_schedules import DEEPSPEED_SCHEDULER_PARAMS, deepspeed_schedule_kwargs
from hybrid.config.schema import DECAY_STYLES, WARMUP_STYLES

__all__ = ["LRSchedule", "ScheduleSettingsDiffer", "DECAY_STYLES", "WARMUP_STYLES", "DEEPSPEED_SCHEDULER_PARAMS", "deepspeed_schedule_kwargs"]


class ScheduleSettingsDiffer(ValueError):
    """A saved schedule's settings differ from the configured ones (a strict load refuses them)."""


class LRSchedule:
    """A stateful schedule: :attr:`lr` is the rate of the next optimizer step, :meth:`step` advances it."""

    def __init__(self, max_lr: float, *, decay_style: str = "constant", warmup_iters: int = 0,
                 warmup_style: str = "linear", warmup_start_lr: float = 0.0,
                 decay_iters: Optional[int] = None, min_lr: float = 0.0, unit: str = "steps"):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {', '.join(DECAY_STYLES)}, got {decay_style!r}")
        if warmup_style not in WARMUP_STYLES:
            raise ValueError(f"warmup_style must be one of {', '.join(WARMUP_STYLES)}, got {warmup_style!r}")
        if not max_lr > 0:
            raise ValueError(f"max_lr must be > 0, got {max_lr!r}")
        if not 0 <= min_lr <= max_lr or not 0 <= warmup_start_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr}) and "
                             f"0 <= warmup_start_lr ({warmup_start_lr}) <= max_lr")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        if warmup_style == "log" and 0 < warmup_iters < 2:
            raise ValueError(f"log warmup needs warmup_iters >= 2, got {warmup_iters}")
        if decay_style != "constant" and (decay_iters is None or decay_iters <= warmup_iters):
            raise ValueError(f"{decay_style} decay needs decay_iters > warmup_iters ({warmup_iters}), "
                             f"got {decay_iters}")
        if unit not in ("steps", "samples"):
            raise ValueError(f"unit must be 'steps' or 'samples', got {unit!r}")
        self.unit = unit
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.decay_style = decay_style
        self.warmup_iters = int(warmup_iters)
        self.warmup_style = warmup_style
        self.warmup_start_lr = float(warmup_start_lr)
        self.decay_iters = decay_iters
        self.iteration = 0

    def lr_at(self, i: int) -> float:
        """The learning rate of optimizer step ``i`` (0-based)."""
        if i < 0:
            raise ValueError(f"step index must be >= 0, got {i}")
        w = self.warmup_iters
        if i < w:
            if self.warmup_style == "linear":
                frac = i / w
            else:
                frac = math.log(i + 1) / math.log(w)
            return self.warmup_start_lr + (self.max_lr - self.warmup_start_lr) * frac
        if self.decay_style == "constant":
            return self.max_lr
        if i >= self.decay_iters:
            return self.min_lr
        ratio = (i - w) / (self.decay_iters - w)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + (self.max_lr - self.min_lr) * coeff

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.lr_at(self.iteration)

    def step(self, samples: int = 1) -> float:
        """Advance past one optimizer step of ``samples`` samples (counted by a schedule in samples, ignored by
        one in steps); returns the next step's learning rate."""
        if self.unit == "samples" and (not isinstance(samples, int) or samples < 1):
            raise ValueError(f"a schedule in samples advances by a step's global batch (>= 1), got {samples!r}")
        self.iteration += samples if self.unit == "samples" else 1
        return self.lr

    def settings(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "decay_style": self.decay_style,
                "warmup_iters": self.warmup_iters, "warmup_style": self.warmup_style,
                "warmup_start_lr": self.warmup_start_lr, "decay_iters": self.decay_iters, "unit": self.unit}

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "settings": self.settings()}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        """Restore the position. With ``strict``, a checkpoint made with other settings is an error
        (a changed schedule would silently jump); pass ``strict=False`` to keep this schedule's settings."""
        saved = dict(state.get("settings", {}))
        saved_unit = saved.get("unit", "steps")  # schedules saved before the unit was recorded counted steps
        if saved_unit != self.unit:
            # a position in steps is no position in samples, whichever settings are kept
            raise ValueError(f"the saved learning-rate schedule counts {saved_unit} and the configured one "
                             f"{self.unit}; give the schedule in {saved_unit} to resume from it")
        if strict:
            mine = self.settings()
            changed = sorted(k for k in mine if k in saved and saved[k] != mine[k])
            if changed:
                details = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {mine[k]!r}" for k in changed)
                raise ScheduleSettingsDiffer(f"the saved learning-rate schedule differs from the configured one "
                                             f"({details}); restore the old settings or load with strict=False "
                                             f"to keep the new ones")
        iteration = state["iteration"]
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"schedule state has an invalid iteration {iteration!r}")
        self.iteration = iteration

    def __repr__(self) -> str:
        return f"LRSchedule(iteration={self.iteration}, lr={self.lr:.6g}, {self.settings()})"
