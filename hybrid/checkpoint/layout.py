"""Names of everything inside a checkpoint directory.

::

    DIR/
      latest                      text: the name of the newest complete iteration dir
      save.lock                   JSON: host and pid of the job saving here (while it runs)
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

The layout itself is a :class:`hybrid.layout.ParallelLayout`; this module
only turns one into file names, so that the writer, the reader and the
manifest check name every file the same way.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional, Tuple

from hybrid.checkpoint.errors import CheckpointFormatError
from hybrid.layout import ParallelLayout

LATEST_FILE = "latest"
METADATA_FILE = "metadata.json"
SAVE_LOCK_FILE = "save.lock"

_ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def iteration_dir_name(iteration: int) -> str:
    if not isinstance(iteration, int) or iteration < 0:
        raise CheckpointFormatError(f"iteration must be an integer >= 0, got {iteration!r}")
    return f"iter_{iteration:07d}"


def parse_iteration_dir_name(name: str) -> Optional[int]:
    """The iteration of a directory named ``iter_NNNNNNN``, or None for any other name."""
    m = _ITER_DIR_RE.match(name)
    return int(m.group(1)) if m else None


# ---- per-rank file names ---------------------------------------------------------------

def model_file(layout: ParallelLayout, tp_rank: int, pp_rank: int = 0) -> str:
    """The model weights of TP rank ``tp_rank`` (one file per TP rank, shared by its DP group)."""
    return f"model_{_suffix(layout, tp_rank, None, pp_rank)}.safetensors"


def optimizer_file(layout: ParallelLayout, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> str:
    """The optimizer partition of one rank."""
    return f"optim_{_suffix(layout, tp_rank, dp_rank, pp_rank)}.pt"


def rank_state_file(layout: ParallelLayout, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> str:
    """The per-rank state (RNG) of one rank."""
    return f"rank_{_suffix(layout, tp_rank, dp_rank, pp_rank)}.pt"


def _suffix(layout: ParallelLayout, tp_rank: int, dp_rank: Optional[int], pp_rank: int) -> str:
    _check_rank(layout, "tp", tp_rank, layout.tp)
    _check_rank(layout, "pp", pp_rank, layout.pp)
    s = f"tp{tp_rank:02d}"
    if dp_rank is not None:
        _check_rank(layout, "dp", dp_rank, layout.dp)
        s += f"_dp{dp_rank:02d}"
    if layout.pp > 1:  # names of checkpoints without pipeline parallelism carry no pp part
        s += f"_pp{pp_rank:02d}"
    return s


def _check_rank(layout: ParallelLayout, axis: str, rank: int, size: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise CheckpointFormatError(f"{axis} rank {rank!r} is outside [0, {size}) for layout {layout.describe()}")


# ---- enumeration -----------------------------------------------------------------------

def model_positions(layout: ParallelLayout) -> Iterator[Tuple[int, int]]:
    """Every (tp_rank, pp_rank) that owns one model file."""
    for p in range(layout.pp):
        for t in range(layout.tp):
            yield t, p


def rank_positions(layout: ParallelLayout) -> Iterator[Tuple[int, int, int]]:
    """Every (tp_rank, dp_rank, pp_rank), in global-rank order."""
    for p in range(layout.pp):
        for d in range(layout.dp):
            for t in range(layout.tp):
                yield t, d, p
