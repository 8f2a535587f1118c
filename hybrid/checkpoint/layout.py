"""Names of everything inside a checkpoint directory.

::

    DIR/
      latest                      text: the name of the newest complete iteration dir
      iter_0000200/
        model_tp00.safetensors    model weights of TP rank 0 (written by DP rank 0)
        model_tp01.safetensors
        optim_tp00_dp00.pt        optimizer partition of (TP 0, DP 0), weights_only
        optim_tp00_dp01.pt
        ...
        rank_tp00_dp00.pt         per-rank state (RNG), weights_only
        ...
        metadata.json             written last: its presence marks the dir complete

With pipeline parallelism (``pp > 1``) every per-rank name gains ``_ppNN``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Optional, Tuple

from hybrid.checkpoint.errors import CheckpointFormatError

LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)

_ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    if not isinstance(iteration, int) or iteration < 0:
        raise CheckpointFormatError(f"iteration must be an integer >= 0, got {iteration!r}")
    return f"iter_{iteration:07d}"


def parse_iteration_dir_name(name: str) -> Optional[int]:
    """The iteration of a directory named ``iter_NNNNNNN``, or None for any other name."""
    m = _ITER_DIR_RE.match(name)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint was saved in."""

    tp: int
    dp: int
    pp: int = 1
    zero_stage: int = 0
    precision: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointFormatError(f"layout {name} must be an integer >= 1, got {value!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise CheckpointFormatError(f"layout zero_stage must be one of {ZERO_STAGES}, "
                                        f"got {self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            raise CheckpointFormatError(f"layout precision must be one of {PRECISIONS}, "
                                        f"got {self.precision!r}")

    @classmethod
    def from_topology(cls, topology, zero_stage: int, precision: str) -> "Layout":
        """The layout of a :class:`hybrid.topology.Topology`."""
        return cls(tp=topology.tp_size, dp=topology.dp_size, pp=topology.pp_size,
                   zero_stage=zero_stage, precision=precision)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"layout must be a JSON object, got {d!r}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise CheckpointFormatError(f"layout has unknown keys {sorted(unknown)}")
        return cls(**d)

    # ---- file names ------------------------------------------------------------------
    def _suffix(self, tp_rank: int, dp_rank: Optional[int], pp_rank: int) -> str:
        self._check_rank("tp", tp_rank, self.tp)
        self._check_rank("pp", pp_rank, self.pp)
        s = f"tp{tp_rank:02d}"
        if dp_rank is not None:
            self._check_rank("dp", dp_rank, self.dp)
            s += f"_dp{dp_rank:02d}"
        if self.pp > 1:
            s += f"_pp{pp_rank:02d}"
        return s

    @staticmethod
    def _check_rank(axis: str, rank: int, size: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise CheckpointFormatError(f"{axis} rank {rank!r} is outside [0, {size}) for this layout")

    def model_file(self, tp_rank: int, pp_rank: int = 0) -> str:
        return f"model_{self._suffix(tp_rank, None, pp_rank)}.safetensors"

    def optimizer_file(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> str:
        return f"optim_{self._suffix(tp_rank, dp_rank, pp_rank)}.pt"

    def rank_state_file(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> str:
        return f"rank_{self._suffix(tp_rank, dp_rank, pp_rank)}.pt"

    # ---- enumeration -----------------------------------------------------------------
    def model_positions(self) -> Iterator[Tuple[int, int]]:
        """Every (tp_rank, pp_rank) that owns one model file."""
        for p in range(self.pp):
            for t in range(self.tp):
                yield t, p

    def rank_positions(self) -> Iterator[Tuple[int, int, int]]:
        """Every (tp_rank, dp_rank, pp_rank), in global-rank order."""
        for p in range(self.pp):
            for d in range(self.dp):
                for t in range(self.tp):
                    yield t, d, p
