"""The loss spike guard (``--loss-spike-factor K --loss-spike-window N``): a loss far above its recent mean.

A run can blow up without a single non-finite value: the loss jumps to many
times what it was, and the steps that follow train on a broken model. The
guard keeps the last ``window`` finite losses of this run and flags an
iteration whose loss exceeds ``factor`` times their mean, once the window is
full (a resumed run refills it first). The loss it reads is the DP-averaged
one every rank reports, so every rank takes the same decision.
"""

from __future__ import annotations

import collections
import math
from typing import Optional


class LossSpikeGuard:
    """Flags a loss above ``factor`` x the mean of the ``window`` finite losses before it."""

    def __init__(self, factor: float, window: int):
        if not factor > 1.0 or window < 1:
            raise ValueError(f"a loss spike guard needs factor > 1 and window >= 1, got {factor}, {window}")
        self.factor = float(factor)
        self.window = int(window)
        self._recent = collections.deque(maxlen=self.window)

    def spike(self, loss: float) -> Optional[float]:
        """The running mean ``loss`` exceeds ``factor`` times, or None; a finite loss that is no spike joins it."""
        if not math.isfinite(loss):
            return None  # non-finite losses are the non-finite check's (and fp16's skip budget's)
        if len(self._recent) == self.window:
            mean = sum(self._recent) / self.window
            if loss > self.factor * mean:
                return mean
        self._recent.append(loss)
        return None

    def message(self, iteration: int, loss: float, mean: float, fix: str) -> str:
        ratio = loss / mean if mean > 0 else math.inf
        return (f"training diverged at iteration {iteration}: lm loss {loss:.6g} is {ratio:.3g}x the mean "
                f"{mean:.6g} of the {self.window} iterations before it (--loss-spike-factor {self.factor:g}, "
                f"--loss-spike-window {self.window}); {fix}, or raise --loss-spike-factor")
