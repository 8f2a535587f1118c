"""Learning-rate schedules: warmup, then constant, linear, cosine, inverse-square-root or WSD decay.

``lr(i)`` is the learning rate at position ``i``: the optimizer steps already
taken (the first step uses ``lr(0)``), or, for a schedule that counts samples
(``unit="samples"``), the samples consumed before the step; the lengths below
are in the same unit. With ``W`` warmup steps, decay ending at step ``D``
(optional for inverse-square-root), a WSD anneal of ``A`` steps, peak
``max_lr`` and floor ``min_lr``::

    i < W  (warmup)   linear: start + (max_lr - start) * i / W
                      log:    start + (max_lr - start) * ln(i + 1) / ln(W)
    W <= i <= D       constant:            max_lr
                      inverse-square-root: max(min_lr, max_lr * sqrt(max(W, 1) / max(i, 1)))
                      otherwise min_lr + (max_lr - min_lr) * c(r), with
                      linear, cosine:  r = (i - W) / (D - W)
                      WSD:             c = 1 (stable) while i <= D - A, then r = (i - (D - A)) / A
                      and c(r) = 1 - r (linear), (1 + cos(pi r)) / 2 (cosine),
                                 2 * 0.5^r - 1 (exponential), 1 - sqrt(r) (minus_sqrt)
    i > D             min_lr (constant keeps max_lr)

Every c(r) falls from 1 at r = 0 to exactly 0 at r = 1, so each decay with
an end meets min_lr at D without a jump (inverse-square-root, which has no
end of its own, drops to min_lr after a D that is given). These are Megatron-LM's formulas (its
``--lr-decay-style``, ``--lr-wsd-decay-style``); DeepSpeed's WarmupLR,
WarmupDecayLR and WarmupCosineLR are special cases:
:func:`deepspeed_schedule_kwargs` (defined with the DeepSpeed config
translation, re-exported here) maps their parameters onto this one class.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

# The style names belong to the configuration; the DeepSpeed mapping to its translator.
from hybrid.config.deepspeed_schedules import DEEPSPEED_SCHEDULER_PARAMS, deepspeed_schedule_kwargs
from hybrid.config.schema import DECAY_STYLES, DECAY_STYLES_WITH_END, WARMUP_STYLES, WSD_DECAY_STYLES

__all__ = ["LRSchedule", "ScheduleSettingsDiffer", "DECAY_SHAPES", "DECAY_STYLES", "WARMUP_STYLES", "WSD_DECAY_STYLES",
           "DEEPSPEED_SCHEDULER_PARAMS", "deepspeed_schedule_kwargs"]

# c(r): the fraction of (max_lr - min_lr) left at decay progress r in [0, 1]; each is 1 at r = 0 and 0 at r = 1.
DECAY_SHAPES = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (1.0 + math.cos(math.pi * r)),
    "exponential": lambda r: 2.0 * 0.5 ** r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


class ScheduleSettingsDiffer(ValueError):
    """A saved schedule's settings differ from the configured ones (a strict load refuses them)."""


def check_same_settings(what: str, saved: Mapping, mine: Mapping) -> None:
    """Raise :class:`ScheduleSettingsDiffer` naming each setting of ``mine`` that ``saved`` (a checkpoint's, of
    the schedule ``what``) records with another value; a setting it does not record (an older release's) passes."""
    changed = sorted(k for k in mine if k in saved and saved[k] != mine[k])
    if changed:
        details = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {mine[k]!r}" for k in changed)
        raise ScheduleSettingsDiffer(f"the saved {what} differs from the configured one ({details}); restore the "
                                     f"old settings, or keep the new ones or take the saved ones on load")


class LRSchedule:
    """A stateful schedule: :attr:`lr` is the rate of the next optimizer step, :meth:`step` advances it."""

    def __init__(self, max_lr: float, *, decay_style: str = "constant", warmup_iters: int = 0,
                 warmup_style: str = "linear", warmup_start_lr: float = 0.0,
                 decay_iters: Optional[int] = None, min_lr: float = 0.0, unit: str = "steps",
                 wsd_decay_iters: Optional[int] = None, wsd_decay_style: str = "exponential",
                 decoupled_lr: Optional[float] = None, decoupled_min_lr: Optional[float] = None):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {', '.join(DECAY_STYLES)}, got {decay_style!r}")
        if warmup_style not in WARMUP_STYLES:
            raise ValueError(f"warmup_style must be one of {', '.join(WARMUP_STYLES)}, got {warmup_style!r}")
        if wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"wsd_decay_style must be one of {', '.join(WSD_DECAY_STYLES)}, "
                             f"got {wsd_decay_style!r}")
        if not max_lr > 0:
            raise ValueError(f"max_lr must be > 0, got {max_lr!r}")
        if not 0 <= min_lr <= max_lr or not 0 <= warmup_start_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr}) and "
                             f"0 <= warmup_start_lr ({warmup_start_lr}) <= max_lr")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        if warmup_style == "log" and 0 < warmup_iters < 2:
            raise ValueError(f"log warmup needs warmup_iters >= 2, got {warmup_iters}")
        if decay_style in DECAY_STYLES_WITH_END and decay_iters is None:
            raise ValueError(f"{decay_style} decay needs decay_iters > warmup_iters ({warmup_iters})")
        if decay_style != "constant" and decay_iters is not None and decay_iters <= warmup_iters:
            raise ValueError(f"{decay_style} decay needs decay_iters > warmup_iters ({warmup_iters}), "
                             f"got {decay_iters}")
        if decay_style == "wsd" and not (isinstance(wsd_decay_iters, int)
                                         and 1 <= wsd_decay_iters <= decay_iters - warmup_iters):
            raise ValueError(f"wsd decay needs 1 <= wsd_decay_iters <= decay_iters - warmup_iters "
                             f"({decay_iters - warmup_iters}): the anneal ends at decay_iters and starts after "
                             f"the warmup; got {wsd_decay_iters!r}")
        if decoupled_lr is not None and not 0 <= (min_lr if decoupled_min_lr is None else decoupled_min_lr) \
                <= decoupled_lr:
            raise ValueError(f"need 0 <= decoupled_min_lr ({decoupled_min_lr}, unset: min_lr {min_lr}) <= "
                             f"decoupled_lr ({decoupled_lr})")
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
        self.wsd_decay_iters = wsd_decay_iters if decay_style == "wsd" else None
        self.wsd_decay_style = wsd_decay_style
        # Megatron-LM's --decoupled-lr / --decoupled-min-lr: the embedding and output weights' peak and floor, on
        # this same schedule (the floor defaults to min_lr)
        self.decoupled = None if decoupled_lr is None else \
            (float(decoupled_lr), float(min_lr if decoupled_min_lr is None else decoupled_min_lr))
        self.iteration = 0

    def lr_at(self, i: int, peak: Optional[float] = None, floor: Optional[float] = None) -> float:
        """The learning rate of optimizer step ``i`` (0-based); ``peak`` and ``floor`` in place of ``max_lr`` and
        ``min_lr`` give the same schedule for another peak and floor (the decoupled rate's)."""
        if i < 0:
            raise ValueError(f"step index must be >= 0, got {i}")
        max_lr = self.max_lr if peak is None else peak
        min_lr = self.min_lr if floor is None else floor
        w, d = self.warmup_iters, self.decay_iters
        if i < w:
            if self.warmup_style == "linear":
                frac = i / w
            else:
                frac = math.log(i + 1) / math.log(w)
            return self.warmup_start_lr + (max_lr - self.warmup_start_lr) * frac
        if self.decay_style == "constant":
            return max_lr
        if d is not None and i > d:  # at d itself every decay with an end is exactly min_lr already
            return min_lr
        if self.decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(w, 1) / max(i, 1)))
        if self.decay_style == "wsd":
            anneal_start = d - self.wsd_decay_iters
            if i <= anneal_start:
                return max_lr
            coeff = DECAY_SHAPES[self.wsd_decay_style]((i - anneal_start) / self.wsd_decay_iters)
        else:
            coeff = DECAY_SHAPES[self.decay_style]((i - w) / (d - w))
        return min_lr + (max_lr - min_lr) * coeff

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.lr_at(self.iteration)

    @property
    def decoupled_lr(self) -> Optional[float]:
        """The embedding and output weights' rate for the next step (None without a decoupled rate)."""
        return None if self.decoupled is None else self.lr_at(self.iteration, *self.decoupled)

    def step(self, samples: int = 1) -> float:
        """Advance past one optimizer step of ``samples`` samples (counted by a schedule in samples, ignored by
        one in steps); returns the next step's learning rate."""
        if self.unit == "samples" and (not isinstance(samples, int) or samples < 1):
            raise ValueError(f"a schedule in samples advances by a step's global batch (>= 1), got {samples!r}")
        self.iteration += samples if self.unit == "samples" else 1
        return self.lr

    def settings(self) -> dict:
        """The settings a checkpoint records (WSD's anneal only under WSD, so that it never blocks another
        style's strict load)."""
        out = {"max_lr": self.max_lr, "min_lr": self.min_lr, "decay_style": self.decay_style,
               "warmup_iters": self.warmup_iters, "warmup_style": self.warmup_style,
               "warmup_start_lr": self.warmup_start_lr, "decay_iters": self.decay_iters, "unit": self.unit}
        if self.decay_style == "wsd":
            out.update(wsd_decay_iters=self.wsd_decay_iters, wsd_decay_style=self.wsd_decay_style)
        if self.decoupled is not None:  # recorded only when set, so that it never blocks an older checkpoint's load
            out.update(decoupled_lr=self.decoupled[0], decoupled_min_lr=self.decoupled[1])
        return out

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
            check_same_settings("learning-rate schedule", saved, self.settings())
        iteration = state["iteration"]
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"schedule state has an invalid iteration {iteration!r}")
        self.iteration = iteration

    def __repr__(self) -> str:
        return f"LRSchedule(iteration={self.iteration}, lr={self.lr:.6g}, {self.settings()})"
