"""The unit of a pipeline schedule: one forward or backward of one micro-batch on one model chunk."""

from __future__ import annotations

import dataclasses

FORWARD = "F"
BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Action:
    """One unit of work on one rank: ``kind`` (``"F"`` or ``"B"``) of ``microbatch`` on the rank's ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
