"""Optimizer-side helpers that are independent of parallelism: learning-rate schedules."""

from hybrid.optim.lr_schedule import DEEPSPEED_SCHEDULER_PARAMS, LRSchedule, deepspeed_schedule_kwargs

__all__ = ["LRSchedule", "deepspeed_schedule_kwargs", "DEEPSPEED_SCHEDULER_PARAMS"]
