"""Paired ratios over interleaved benchmark rounds, with their spread.

A shared machine's load drifts over minutes, so two contenders timed minutes
apart are not comparable, and a ratio of two medians taken over different
spells hides how much the comparison itself moved. Each round runs every
contender once; the ratio of one round pairs two medians timed within that
round. The figure to publish is the median of those per-round ratios, beside
their range (min-max over rounds): a rerun's ratio should fall inside it.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class PairedRatio:
    """``ratios[i]`` = a / b of the i-th round in which both contenders ran (rounds listed in ``rounds``)."""

    rounds: Tuple[int, ...]
    ratios: Tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> Tuple[float, float]:
        """(min, max) of the per-round ratios."""
        return min(self.ratios), max(self.ratios)

    def format(self) -> str:
        """``0.87x (0.80-0.95)``: the median ratio and its min-max over rounds."""
        lo, hi = self.spread
        return f"{self.median:.2f}x ({lo:.2f}-{hi:.2f})"

    def as_dict(self) -> dict:
        lo, hi = self.spread
        return {"median": self.median, "min": lo, "max": hi, "rounds": list(self.rounds), "ratios": list(self.ratios)}


def paired_ratio(a_by_round: Mapping[int, float], b_by_round: Mapping[int, float]) -> Optional[PairedRatio]:
    """Per-round a/b over the rounds that timed both (a round where either failed pairs nothing); None if none."""
    rounds = tuple(sorted(set(a_by_round) & set(b_by_round)))
    if not rounds:
        return None
    for r in rounds:
        if not b_by_round[r] > 0:
            raise ValueError(f"round {r}: the denominator's time is {b_by_round[r]!r}; a step time must be > 0")
    return PairedRatio(rounds, tuple(a_by_round[r] / b_by_round[r] for r in rounds))
