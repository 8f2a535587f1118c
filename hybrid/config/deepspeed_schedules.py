"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as settings of hybrid's one schedule.

Plain data and arithmetic (no torch): :mod:`hybrid.config.deepspeed` uses it
to translate a DeepSpeed ``scheduler`` section into ``scheduler.*`` keys, and
:mod:`hybrid.optim.lr_schedule` re-exports it for building an
:class:`~hybrid.optim.lr_schedule.LRSchedule` directly.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

# DeepSpeed scheduler parameters and their defaults (None: required, or taken from the optimizer). Read-only.
DEEPSPEED_SCHEDULER_PARAMS: Mapping[str, Mapping] = MappingProxyType({
    "WarmupLR": MappingProxyType({"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                                  "warmup_type": "log"}),
    "WarmupDecayLR": MappingProxyType({"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                       "warmup_num_steps": 1000, "warmup_type": "log"}),
    "WarmupCosineLR": MappingProxyType({"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                                        "cos_min_ratio": 0.0001, "warmup_type": "log"}),
})


def deepspeed_schedule_kwargs(type_name: str, params: Mapping, optimizer_lr: float) -> dict:
    """:class:`~hybrid.optim.lr_schedule.LRSchedule` keyword arguments (including ``max_lr``) for a DeepSpeed scheduler.

    ``params`` must hold only keys of ``DEEPSPEED_SCHEDULER_PARAMS[type_name]``
    (the config translator checks that). DeepSpeed raises warmup steps below 2
    to 2; that is kept. Differences in the step at which a value is applied are
    described in docs/config.md.
    """
    defaults = DEEPSPEED_SCHEDULER_PARAMS[type_name]
    p = {**defaults, **params}
    warmup = max(2, int(p["warmup_num_steps"]))
    common = {"warmup_iters": warmup, "warmup_style": p["warmup_type"]}
    if type_name == "WarmupCosineLR":
        return {"max_lr": optimizer_lr, "decay_style": "cosine", "decay_iters": int(p["total_num_steps"]),
                "warmup_start_lr": optimizer_lr * float(p["warmup_min_ratio"]),
                "min_lr": optimizer_lr * float(p["cos_min_ratio"]), **common}
    max_lr = optimizer_lr if p["warmup_max_lr"] is None else float(p["warmup_max_lr"])
    kwargs = {"max_lr": max_lr, "warmup_start_lr": float(p["warmup_min_lr"]), **common}
    if type_name == "WarmupLR":
        return {**kwargs, "decay_style": "constant", "decay_iters": None, "min_lr": 0.0}
    return {**kwargs, "decay_style": "linear", "decay_iters": int(p["total_num_steps"]),
            "min_lr": float(p["warmup_min_lr"])}
