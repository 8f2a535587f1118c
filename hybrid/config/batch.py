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

import bisect
import dataclasses
import decimal
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
    ``steps`` instead (Megatron-LM's ``--step-batch-size-schedule``): ``(from, size)`` pairs, ``from`` strictly
    increasing from 0; the batch after ``c`` consumed samples is the ``size`` of the last pair with ``from <= c``,
    and ``final`` is the last pair's. Either is a table of such pairs (:attr:`table`), which the rest reads.
    """

    final: int
    start: Optional[int] = None
    increment: Optional[int] = None
    samples: Optional[int] = None
    steps: Optional[Tuple[Tuple[int, int], ...]] = None

    @classmethod
    def constant(cls, global_batch: int) -> "GlobalBatchSchedule":
        return cls(int(global_batch))

    @classmethod
    def stepwise(cls, steps: Sequence[Tuple[int, int]]) -> "GlobalBatchSchedule":
        steps = tuple((int(c), int(n)) for c, n in steps)
        return cls(steps[-1][1], steps=steps)

    @functools.cached_property
    def table(self) -> Tuple[Tuple[int, int], ...]:
        """``(from, size)`` for every size the run may take, in the order it takes them: the size holds from
        ``from`` consumed samples until the next pair's. A ramp's size ``k`` starts at the first count ``c`` with
        ``c * n >= k * samples``."""
        if self.steps is not None:
            return self.steps
        if self.start is None or self.start >= self.final:
            return ((0, self.final),)
        n = (self.final - self.start) // self.increment
        return tuple((-(-k * self.samples // n), self.start + k * self.increment) for k in range(n + 1))

    @property
    def ramps(self) -> bool:
        """Whether the batch changes during the run."""
        return len(self.table) > 1

    def _stage(self, consumed: int) -> int:
        return bisect.bisect_right([c for c, _ in self.table], consumed) - 1

    def size_at(self, consumed: int) -> int:
        """The global batch of the step that starts after ``consumed`` samples."""
        return self.table[self._stage(consumed)][1]

    def sizes(self) -> Tuple[int, ...]:
        """Every size of the schedule, in the order taken (a ramp's smallest first): what a run may take (a step
        skips sizes whose share of the samples is smaller than a batch)."""
        return tuple(size for _, size in self.table)

    def _stages(self, consumed: int) -> Iterator[Tuple[int, Optional[int]]]:
        """From ``consumed`` on, one per size still to come: (the size, the consumed count from which the next
        size is taken, or None for the last size)."""
        table = self.table
        for k in range(self._stage(consumed), len(table)):
            yield table[k][1], (table[k + 1][0] if k + 1 < len(table) else None)

    def steps_within(self, total: int, consumed: int = 0) -> int:
        """How many whole steps fit from ``consumed`` samples up to ``total`` (a last, partial batch is none)."""
        steps = 0
        for size, until in self._stages(consumed):
            # steps at this size (none when an earlier, larger step passed its whole share)
            n = None if until is None else max(-(-(until - consumed) // size), 0)
            if n is None or consumed + n * size > total:
                # the steps left at this size: the one that does not fit ends the run, whatever size comes next
                return steps + max(total - consumed, 0) // size
            steps, consumed = steps + n, consumed + n * size
        return steps

    def samples_after(self, steps: int, consumed: int = 0) -> int:
        """The consumed count after ``steps`` more steps from ``consumed``."""
        for size, until in self._stages(consumed):
            n = steps if until is None else min(steps, max(-(-(until - consumed) // size), 0))
            steps, consumed = steps - n, consumed + n * size
            if steps == 0:
                break
        return consumed

    def describe(self) -> str:
        if not self.ramps:
            return f"global batch {self.final}"
        if self.steps is not None:
            return "global batch by consumed samples: " + ", ".join(f"{n} from {c}" for c, n in self.steps)
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
    steps: Optional[Tuple[Tuple[int, int], ...]] = None  # (from samples, size) of step_batch_size_schedule

    @functools.cached_property
    def schedule(self) -> Optional[GlobalBatchSchedule]:
        """The global batch of each step; None when the batch sizes are unknown."""
        if self.global_batch_size is None:
            return None
        if self.steps is not None:
            return GlobalBatchSchedule.stepwise(self.steps)
        return GlobalBatchSchedule(self.global_batch_size, *(self.rampup or ()))

    @property
    def varies(self) -> bool:
        """Whether the global batch (a ramp's or a step schedule's) changes during the run."""
        return self.rampup is not None or self.steps is not None

    def accumulation_at(self, consumed: int) -> int:
        """Micro-steps per DP rank of the step that starts after ``consumed`` samples."""
        if not self.varies:
            return self.gradient_accumulation_steps
        return self._micro_batches(self.schedule.size_at(consumed))

    def accumulations(self) -> Tuple[int, ...]:
        """The micro-steps per DP rank of every global batch the run may take (:meth:`GlobalBatchSchedule.sizes`)."""
        if not self.varies:
            return (self.gradient_accumulation_steps,)
        return tuple(self._micro_batches(size) for size in self.schedule.sizes())

    def _micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch_size * self.dp_size)


def resolve_batch(micro: Optional[int], accum: Optional[int], global_batch: Optional[int],
                  dp_size: int, rampup: Optional[Sequence[int]] = None,
                  steps: Optional[Sequence[Tuple[int, int]]] = None) -> BatchSizes:
    """Any two of (micro, accum, global) determine the third for ``dp_size`` data-parallel ranks.

    With only micro or only global given, accumulation defaults to 1; with
    nothing given, accumulation is 1 and the sizes stay unknown. ``rampup``
    (start, increment, samples) ramps the global batch up to ``global_batch``
    (:func:`rampup_problem`); ``steps`` (``(from samples, size)`` pairs, :func:`parse_step_schedule`) sets it
    step-wise instead, ending at ``global_batch`` (its last size when unset). Every size either takes must be a
    whole number of micro-batches on each DP rank.
    """
    if steps is not None:
        return _resolve_steps(micro, accum, global_batch, dp_size, tuple(steps), rampup)
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


# ---- Megatron-LM's --step-batch-size-schedule ------------------------------------------------------------------
_STEP_KEY = "step_batch_size_schedule"
_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}  # Megatron's threshold suffixes


def _count(text: str) -> int:
    """A count with Megatron's optional suffix (``2.4B``), read exactly (decimal, not binary, fractions)."""
    word = text.strip().upper()
    scale = _SUFFIXES.get(word[-1:], 1)
    number = decimal.Decimal(word[:-1] if scale > 1 else word) * scale
    if not number.is_finite() or number != number.to_integral_value():
        raise decimal.InvalidOperation
    return int(number)


def parse_step_schedule(words: Sequence[str], seq_length: Optional[int]) -> Tuple[Tuple[int, int], ...]:
    """``step_batch_size_schedule`` (Megatron-LM's ``THRESHOLD:SIZE`` pairs, separated by spaces or commas; each
    THRESHOLD a count of consumed tokens with an optional suffix K, M, B or T, as Megatron's pretraining reads it
    with its sequence length) as ``(from samples, size)`` pairs in threshold order: ``from = THRESHOLD //
    seq_length``, Megatron's conversion. The first threshold must be 0, the thresholds in samples distinct."""
    text = " ".join(str(w) for w in words)
    where = f"{_STEP_KEY} {text}"
    if seq_length is None:
        raise ConfigError(f"{where}: its thresholds are tokens, read with the sequence length; give "
                          f"model.seq_length (or model.preset)", keys=(_STEP_KEY, "model.seq_length"))
    pairs = []
    for entry in text.replace(",", " ").split():
        threshold, colon, size = entry.partition(":")
        try:
            pairs.append((_count(threshold) // seq_length, _count(size)))
        except (decimal.InvalidOperation, IndexError):
            colon = ""
        if not colon or pairs[-1][1] < 1 or pairs[-1][0] < 0:
            raise ConfigError(f"{where}: '{entry}' is not THRESHOLD:SIZE (a token count >= 0 with an optional "
                              f"K, M, B or T, and a global batch >= 1), e.g. 0:16 2.4B:320", keys=(_STEP_KEY,))
    pairs.sort(key=lambda p: p[0])
    if not pairs or pairs[0][0] != 0:
        raise ConfigError(f"{where}: the first threshold must be 0 (the batch the run starts with)",
                          keys=(_STEP_KEY,))
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if a == b:
            raise ConfigError(f"{where}: two thresholds fall on the same sample ({a} = tokens // seq_length "
                              f"{seq_length}); give each size its own threshold", keys=(_STEP_KEY,))
    return tuple(pairs)


def step_schedule_problem(steps: Sequence[Tuple[int, int]], global_batch: Optional[int],
                          rampup: Optional[Sequence[int]]) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """Why the ``(from, size)`` pairs of ``step_batch_size_schedule`` cannot set the global batch beside
    ``global_batch_size`` and ``rampup_batch_size`` (the rules that need no data-parallel size), with the keys
    it is about; or None."""
    final = steps[-1][1]
    if rampup is not None:
        return (f"{_STEP_KEY} and rampup_batch_size both set the global batch of each step; give one",
                (_STEP_KEY, _RAMP_KEY))
    if global_batch is not None and global_batch != final:
        return (f"global_batch_size {global_batch} differs from the last size of {_STEP_KEY}, {final}: the "
                f"schedule ends at the global batch; give {final} or leave global_batch_size unset",
                (_STEP_KEY, "global_batch_size"))
    return None


def _resolve_steps(micro, accum, global_batch, dp_size, steps, rampup) -> BatchSizes:
    problem = step_schedule_problem(steps, global_batch, rampup)
    if problem is not None:
        raise ConfigError(problem[0], keys=problem[1])
    sizes = _resolve(micro, accum, steps[-1][1], dp_size)
    per_step = sizes.micro_batch_size * dp_size
    wrong = [n for _, n in steps if n % per_step]
    if wrong:
        raise ConfigError(f"{_STEP_KEY}: its sizes {', '.join(map(str, wrong))} are not multiples of "
                          f"micro_batch_size x data-parallel size = {sizes.micro_batch_size} x {dp_size} = "
                          f"{per_step}, so that every global batch is whole micro-batches on each rank; choose "
                          f"multiples of {per_step}", keys=(_STEP_KEY, "micro_batch_size"))
    return dataclasses.replace(sizes, steps=steps)
