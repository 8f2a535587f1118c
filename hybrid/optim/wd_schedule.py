"""Weight decay that grows over a run (Megatron-LM's ``--start-weight-decay``, ``--end-weight-decay``,
``--weight-decay-incr-style``).

``wd(i)`` is the weight decay of the step at position ``i`` (the learning-rate schedule's position: optimizer
steps taken, or samples consumed, see :mod:`hybrid.optim.lr_schedule`). With ``N`` the increment's length::

    constant   end
    i > N      end
    r = i / N  end - (end - start) * c(r)

with ``c`` the learning rate's decay shape of the same name (:data:`hybrid.optim.lr_schedule.DECAY_SHAPES`:
``1 - r``, ``(1 + cos(pi r)) / 2``), which falls from 1 to 0: the weight decay rises from ``start`` at ``i = 0``
to exactly ``end`` at ``i = N``. These are Megatron-LM's formulas (its linear ``start + (end - start) r`` and
cosine ``start + (end - start) (1 + cos(pi (1 - r))) / 2``, written with ``c``).
"""

from __future__ import annotations

from typing import Optional

from hybrid.config.schema import WD_INCR_STYLES
from hybrid.optim.lr_schedule import DECAY_SHAPES


class WeightDecaySchedule:
    def __init__(self, start: float, end: float, style: str = "constant", length: Optional[int] = None):
        if style not in WD_INCR_STYLES:
            raise ValueError(f"weight decay increment style must be one of {', '.join(WD_INCR_STYLES)}, "
                             f"got {style!r}")
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start ({start}) <= end ({end}) weight decay")
        if style == "constant" and start != end:
            raise ValueError(f"a constant weight decay has start == end, got {start} and {end}")
        if style != "constant" and not (isinstance(length, int) and length >= 1):
            raise ValueError(f"a {style} weight decay increment needs a length >= 1, got {length!r}")
        self.start, self.end, self.style, self.length = float(start), float(end), style, length

    def value_at(self, i: int) -> float:
        """The weight decay of the step at position ``i``."""
        if self.style == "constant" or i > self.length:
            return self.end
        return self.end - (self.end - self.start) * DECAY_SHAPES[self.style](i / self.length)

    def settings(self) -> dict:
        """What a checkpoint records, so that a resumed run does not silently change its weight decay."""
        return {"start": self.start, "end": self.end, "style": self.style, "length": self.length}

    def __repr__(self) -> str:
        return f"WeightDecaySchedule({self.start:g} -> {self.end:g}, {self.style}, length={self.length})"
