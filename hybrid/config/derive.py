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

* Megatron-DeepSpeed's token counts (``run.train_tokens``, ``scheduler.warmup_tokens``,
  ``scheduler.decay_tokens``): read as samples with the model's sequence length (its
  ``consumed_train_tokens`` are the consumed samples x ``seq_length``): the warmup and decay lengths to the nearest
  sample, the run to the end of the step that reaches the tokens (Megatron-DeepSpeed trains while fewer tokens are
  consumed), or earlier when ``run.train_iters`` or ``run.train_samples`` ends it first. A token key is then
  unset; one that cannot be read stays, for :func:`token_problem`'s error.

The batch sizes are derived where the data-parallel size is known, by
:func:`hybrid.config.batch.resolve_batch` (global batch = micro batch x
accumulation x DP, accumulation 1 when unset).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, List, Optional

from hybrid.config.errors import ConfigError

if TYPE_CHECKING:
    from hybrid.config.schema import HybridConfig

# Megatron-DeepSpeed's token counts -> the keys the trainer reads them as
TOKEN_KEYS = {"scheduler.warmup_tokens": "scheduler.warmup_samples", "scheduler.decay_tokens": "scheduler.decay_samples",
              "run.train_tokens": "run.train_samples"}


def config_value(cfg, key: str):
    """The value of the dotted ``key`` (section.name) of ``cfg``."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def token_problem(cfg: "HybridConfig", key: str) -> Optional[str]:
    """Why the token count ``key`` (one of :data:`TOKEN_KEYS`) of ``cfg`` cannot be read as samples, or None."""
    if cfg.model_seq_length() is None:
        return f"'{key}' is read as samples with the sequence length: give 'model.seq_length' (or 'model.preset')"
    if key == "run.train_tokens":
        if cfg.global_batch_size is None and not cfg.step_batch_size_schedule:
            return f"'{key}' ends the run after the step that reaches it: give 'global_batch_size'"
        return None
    sched, length = cfg.scheduler, key.split(".")[1][:-len("_tokens")]
    given = [k for k in (f"{length}_iters", f"{length}_samples", f"{length}_fraction")
             if getattr(sched, k, None) not in (None, 0)]  # warmup_iters' unset value is 0
    if given:
        return f"give the {length} as '{key}' or as 'scheduler.{given[0]}', not both"
    return None


def _read_tokens(out: "HybridConfig", notes: Optional[List[str]]) -> None:
    """:data:`TOKEN_KEYS` of ``out`` read as samples in place (see the module's text), each named in ``notes``."""
    from hybrid.config.batch import GlobalBatchSchedule
    from hybrid.config.spellings import LEAVES

    seq = out.model_seq_length()
    for key, read_as in TOKEN_KEYS.items():
        tokens = config_value(out, key)
        if tokens is None or token_problem(out, key) is not None:
            continue
        section, name = key.split(".")
        run = out.run
        if key == "run.train_tokens":
            try:
                steps = out.batch_steps()
            except ConfigError:
                continue  # the schedule's own error names it
            schedule = GlobalBatchSchedule.stepwise(steps) if steps else \
                GlobalBatchSchedule(out.global_batch_size, *(out.rampup_batch_size or ()))
            # the first step count whose samples hold the tokens: one more than fit below ceil(tokens / seq)
            needed = -(-tokens // seq)
            count = schedule.steps_within(needed - 1) + 1
            if run.train_iters is not None:
                read_as, value = "run.train_iters", min(run.train_iters, count)
            else:
                value = schedule.samples_after(count)
                value = value if run.train_samples is None else min(run.train_samples, value)
            why = f"the run ends after {count} steps, the first whose samples x --seq-length {seq} reach it"
        else:
            value = max((2 * tokens + seq) // (2 * seq), 1 if name == "decay_tokens" else 0)  # the nearest sample
            why = f"tokens / --seq-length {seq}" + (", to the nearest sample" if tokens % seq else "")
        read_section, read_name = read_as.split(".")
        setattr(getattr(out, read_section), read_name, value)
        setattr(getattr(out, section), name, None)
        if notes is not None:
            notes.append(f"{LEAVES[key].flag} {tokens} (read as {LEAVES[read_as].flag} {value}: {why})")


def derive_for_training(cfg: "HybridConfig", notes: Optional[List[str]] = None) -> "HybridConfig":
    """``cfg`` with the trainer's derived values filled in (a new object; ``cfg`` is unchanged); ``notes`` receives
    a line for each token count read as samples."""
    out = copy.deepcopy(cfg)
    _read_tokens(out, notes)
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
