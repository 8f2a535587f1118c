"""Values the trainer derives from other keys when they are left unset, each rule written once.

These are derivations, not second defaults: a key keeps its one default in
:mod:`hybrid.config.schema`, and only an unset key is filled in here.

* the decay length of the schedule: a decay that ends (linear, cosine, wsd)
  decays over the whole run, and a warmup given as a fraction
  (``scheduler.warmup_fraction``) is a fraction of the same. A run given in
  samples (``run.train_samples``) gets ``scheduler.decay_samples``, unless the
  schedule is given in steps; a run given in steps gets ``scheduler.decay_iters``.
* the length of a growing weight decay (``optimizer.weight_decay_incr_style``
  linear or cosine): the whole run as well, by the same rule
  (``scheduler.weight_decay_incr_samples`` or ``_iters``).

The batch sizes are derived where the data-parallel size is known, by
:func:`hybrid.config.batch.resolve_batch` (global batch = micro batch x
accumulation x DP, accumulation 1 when unset).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybrid.config.schema import HybridConfig


def derive_for_training(cfg: "HybridConfig") -> "HybridConfig":
    """``cfg`` with the trainer's derived values filled in (a new object; ``cfg`` is unchanged)."""
    out = copy.deepcopy(cfg)
    sched, run = out.scheduler, out.run

    def over_the_run(needed: bool, name: str) -> None:
        """Length ``name`` (one of SchedulerConfig.LENGTHS), when needed and unset: the run's, in its unit."""
        if needed and getattr(sched, sched.length_key(name)) is None:
            if run.train_samples is not None and not sched.given_in_steps:
                setattr(sched, f"{name}_samples", run.train_samples)
            elif run.train_iters is not None and not sched.in_samples:
                setattr(sched, f"{name}_iters", run.train_iters)

    over_the_run(sched.needs_decay_length, "decay")
    over_the_run(out.optimizer.weight_decay_incr_style != "constant", "weight_decay_incr")
    return out
