"""``global_batch = micro_batch x accumulation x dp``: fill in the unknown, or refuse; and the ramp-up.

A run may ramp its global batch up (``rampup_batch_size = (start, increment,
samples)``): it starts at ``start`` samples and grows by ``increment`` in equal
steps until ``global_batch_size``, spread evenly over the first ``samples``
samples. The batch of an optimizer step is a function of the samples consumed
before it, so a resumed run (in any layout) continues on the same sizes.
:class:`GlobalBatchSchedule` holds that rule, for the data, the engine and the
trainer alike; the micro batch stays fixed and the accumulation count follows.

Errors carry the keys they are about; :meth:`HybridConfig.resolve_batch` adds their flags.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Optional, Sequence, Tuple

from hybrid.config.errors import ConfigError

_BATCH_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "global_batch_size")
_RAMP_KEY = "rampup_batch_size"


@dataclasses.dataclass(frozen=True)
class GlobalBatchSchedule:
    """The global batch of each optimizer step, as a function of the samples consumed before it.

    Without a ramp (``start`` None) every step takes ``final`` samples. With one,
    the ramp has ``n = (final - start) / increment`` increments and the batch after
    ``c`` consumed samples is ``min(start + increment * floor(c * n / samples), final)``:
    each size is kept until the next ``samples / n`` samples have been consumed
    (the last step of a size may pass that mark; the next step takes the next size).
    """

    final: int
    start: Optional[int] = None
    increment: Optional[int] = None
    samples: Optional[int] = None

    @classmethod
    def constant(cls, global_batch: int) -> "GlobalBatchSchedule":
        return cls(int(global_batch))

    @property
    def ramps(self) -> bool:
        return self.start is not None and self.start < self.final

    @property
    def _increments(self) -> int:
        return (self.final - self.start) // self.increment if self.ramps else 0

    def size_at(self, consumed: int) -> int:
        """The global batch of the step that starts after ``consumed`` samples."""
        if not self.ramps:
            return self.final
        stage = consumed * self._increments // self.samples
        return min(self.start + stage * self.increment, self.final)

    def sizes(self) -> Tuple[int, ...]:
        """Every size of the ramp, smallest first: what a run may take (a step skips sizes whose share of the
        ramp's samples is smaller than a batch)."""
        if not self.ramps:
            return (self.final,)
        return tuple(self.start + k * self.increment for k in range(self._increments + 1))

    def _stages(self, consumed: int) -> Iterator[Tuple[int, Optional[int]]]:
        """From ``consumed`` on, one per size still to come: (the size, the consumed count from which the next
        size is taken, or None for the last size)."""
        if not self.ramps:
            yield self.final, None
            return
        n = self._increments
        for k in range(min(consumed * n // self.samples, n), n + 1):
            # the first count c with c * n >= (k + 1) * samples
            yield self.start + k * self.increment, (-(-(k + 1) * self.samples // n) if k < n else None)

    def steps_within(self, total: int, consumed: int = 0) -> int:
        """How many whole steps fit from ``consumed`` samples up to ``total`` (a last, partial batch is none)."""
        steps = 0
        for size, until in self._stages(consumed):
            n = None if until is None else -(-(until - consumed) // size)  # steps at this size
            if n is None or consumed + n * size > total:
                return steps + max(total - consumed, 0) // size  # sizes only grow: nothing later fits either
            steps, consumed = steps + n, consumed + n * size
        return steps

    def samples_after(self, steps: int, consumed: int = 0) -> int:
        """The consumed count after ``steps`` more steps from ``consumed``."""
        for size, until in self._stages(consumed):
            n = steps if until is None else min(steps, -(-(until - consumed) // size))
            steps, consumed = steps - n, consumed + n * size
            if steps == 0:
                break
        return consumed

    def describe(self) -> str:
        if not self.ramps:
            return f"global batch {self.final}"
        return (f"global batch ramping from {self.start} by {self.increment} to {self.final} over the first "
                f"{self.samples} samples")


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes. ``micro_batch_size`` and ``global_batch_size`` are None only when
    neither was configured (a plain training loop that feeds its own batches).

    ``global_batch_size`` and ``gradient_accumulation_steps`` are the sizes a
    ramp-up ends at; :meth:`accumulation_at` gives a step's own.
    """

    micro_batch_size: Optional[int]
    gradient_accumulation_steps: int
    global_batch_size: Optional[int]
    dp_size: int
    rampup: Optional[Tuple[int, int, int]] = None  # (start, increment, samples) of rampup_batch_size

    @functools.cached_property
    def schedule(self) -> Optional[GlobalBatchSchedule]:
        """The global batch of each step; None when the batch sizes are unknown."""
        if self.global_batch_size is None:
            return None
        return GlobalBatchSchedule(self.global_batch_size, *(self.rampup or ()))

    def accumulation_at(self, consumed: int) -> int:
        """Micro-steps per DP rank of the step that starts after ``consumed`` samples."""
        if self.rampup is None:
            return self.gradient_accumulation_steps
        return self._micro_batches(self.schedule.size_at(consumed))

    def accumulations(self) -> Tuple[int, ...]:
        """The micro-steps per DP rank of every global batch the run may take (:meth:`GlobalBatchSchedule.sizes`)."""
        if self.rampup is None:
            return (self.gradient_accumulation_steps,)
        return tuple(self._micro_batches(size) for size in self.schedule.sizes())

    def _micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch_size * self.dp_size)


def resolve_batch(micro: Optional[int], accum: Optional[int], global_batch: Optional[int],
                  dp_size: int, rampup: Optional[Sequence[int]] = None) -> BatchSizes:
    """Any two of (micro, accum, global) determine the third for ``dp_size`` data-parallel ranks.

    With only micro or only global given, accumulation defaults to 1; with
    nothing given, accumulation is 1 and the sizes stay unknown. ``rampup``
    (start, increment, samples) ramps the global batch up to ``global_batch``
    (:func:`rampup_problem`); every size it takes must be a whole number of
    micro-batches on each DP rank.
    """
    sizes = _resolve(micro, accum, global_batch, dp_size)
    if rampup is None:
        return sizes
    rampup = tuple(int(n) for n in rampup)
    problem = rampup_problem(rampup, global_batch)
    if problem is not None:
        raise ConfigError(problem, keys=(_RAMP_KEY, "global_batch_size"))
    start, increment, _ = rampup
    per_step = sizes.micro_batch_size * dp_size
    if any(n % per_step for n in ((start, increment) if start < global_batch else (start,))):
        raise ConfigError(f"rampup_batch_size {start} {increment} {rampup[2]}: its start and increment must be "
                          f"multiples of micro_batch_size x data-parallel size = {sizes.micro_batch_size} x "
                          f"{dp_size} = {per_step}, so that every global batch of the ramp is whole micro-batches "
                          f"on each rank; choose multiples of {per_step}", keys=(_RAMP_KEY, "micro_batch_size"))
    return dataclasses.replace(sizes, rampup=rampup)


def rampup_problem(rampup: Tuple[int, int, int], global_batch: Optional[int]) -> Optional[str]:
    """Why ``rampup_batch_size`` (start, increment, samples) cannot ramp up to ``global_batch``, or None: the
    rules that need no data-parallel size."""
    start, increment, samples = rampup
    text = f"rampup_batch_size {start} {increment} {samples}"
    if global_batch is None:
        return f"{text} needs global_batch_size: the batch the ramp ends at"
    if start > global_batch:
        return f"{text} starts above global_batch_size {global_batch}; the ramp grows the batch up to it"
    if (global_batch - start) % increment:
        return (f"{text}: global_batch_size {global_batch} - start {start} = {global_batch - start} is not a "
                f"multiple of the increment {increment}; the ramp must end on global_batch_size")
    return None


def _resolve(micro: Optional[int], accum: Optional[int], global_batch: Optional[int], dp_size: int) -> BatchSizes:
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"data-parallel size must be an integer >= 1, got {dp_size!r}")
    for name, value in (("micro_batch_size", micro), ("gradient_accumulation_steps", accum),
                        ("global_batch_size", global_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", keys=(name,))

    def describe() -> str:
        return (f"(micro_batch_size={micro}, gradient_accumulation_steps={accum}, "
                f"global_batch_size={global_batch}, data-parallel size={dp_size})")

    if global_batch is None:
        accum = 1 if accum is None else accum
        derived = micro * accum * dp_size if micro is not None else None
        return BatchSizes(micro, accum, derived, dp_size)
    if micro is None and accum is None:
        accum = 1
    if micro is None:
        per_step = accum * dp_size
        if global_batch % per_step != 0:
            raise ConfigError(f"global_batch_size {global_batch} is not divisible by gradient_accumulation_steps "
                            f"x data-parallel size = {accum} x {dp_size} = {per_step} {describe()}; "
                            f"choose a global batch that is a multiple of {per_step}", keys=_BATCH_KEYS)
        return BatchSizes(global_batch // per_step, accum, global_batch, dp_size)
    if accum is None:
        per_step = micro * dp_size
        if global_batch % per_step != 0:
            raise ConfigError(f"global_batch_size {global_batch} is not divisible by micro_batch_size x "
                            f"data-parallel size = {micro} x {dp_size} = {per_step} {describe()}; "
                            f"choose a global batch that is a multiple of {per_step}", keys=_BATCH_KEYS)
        return BatchSizes(micro, global_batch // per_step, global_batch, dp_size)
    if micro * accum * dp_size != global_batch:
        raise ConfigError(f"global_batch_size {global_batch} != micro_batch_size x gradient_accumulation_steps x "
                        f"data-parallel size = {micro} x {accum} x {dp_size} = {micro * accum * dp_size} "
                        f"{describe()}; set two of the three and let hybrid derive the third", keys=_BATCH_KEYS)
    return BatchSizes(micro, accum, global_batch, dp_size)
