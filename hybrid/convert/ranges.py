"""Index arithmetic between a full tensor and its TP pieces, along the partition dim.

:func:`hybrid.param_meta.shard` and :func:`~hybrid.param_meta.merge` define
the layout on whole tensors. A converter that must stay small in memory
cannot afford to hold every piece *and* the full tensor, so this module
answers the same question range by range:

* :func:`source_runs` - which slices of which saved pieces hold the logical
  full range ``[start, stop)``;
* :func:`shard_runs` - which full ranges make up TP rank ``rank``'s piece in
  a (possibly different) TP size, and where the zero padding goes.

With both, a target piece is assembled straight from the saved pieces
(:func:`assemble`), reading only the rows it needs, and the full tensor never
exists. Positions are counted along ``meta.dim`` only; every other dim is
taken whole. Pure arithmetic, no I/O; the runs themselves are defined in
:mod:`hybrid.param_meta`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

# The run arithmetic is the layout's definition and lives with it; re-exported for the converters.
from hybrid.param_meta import ShardRun, SourceRun, TPMeta, piece_runs, piece_size, source_runs  # noqa: F401


shard_runs = piece_runs  # which full ranges make up a piece: the layout's own definition


ReadPiece = Callable[[int, int, int], torch.Tensor]
"""``read(rank, start, stop)``: saved TP rank ``rank``'s piece narrowed to ``[start, stop)`` along the dim."""


def check_same_layout(name: str, saved: TPMeta, current: TPMeta) -> None:
    """Raise unless ``saved`` and ``current`` split the same full tensor the same way (padding may differ)."""
    if (saved.dim, saved.stride, saved.logical_size, saved.blocks) != \
            (current.dim, current.stride, current.logical_size, current.blocks):
        if saved.logical_size != current.logical_size and saved.dim == current.dim:
            raise ValueError(f"{name}: cannot re-pad: the checkpoint holds {saved.logical_size} logical entries "
                             f"along dim {saved.dim} (the vocabulary), the current model {current.logical_size}")
        raise ValueError(f"{name}: the checkpoint splits it over TP as {saved} but the current model as "
                         f"{current}; the model code changed in a way a checkpoint cannot follow")


def assemble(read: ReadPiece, shape: Sequence[int], dtype: torch.dtype, saved: TPMeta, saved_tp: int,
             full_size: int, target: TPMeta, target_tp: int, target_rank: int,
             max_rows: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Target TP rank ``target_rank``'s piece, built from the saved pieces through ``read``.

    ``shape`` is the target piece's shape (``target_tp == 1`` with an unpadded
    ``target`` gives the logical full tensor). Padding entries are zero.
    Reads only the rows the piece needs, one run at a time, and at most
    ``max_rows`` entries along the dim per ``read`` (bounding what a reader
    backed by a memory map pages in at once). ``out``, when given, receives
    the piece (any strides) and is returned.
    """
    if out is None:
        out = torch.empty(tuple(shape), dtype=dtype)
    elif tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {list(out.shape)}, the piece {list(shape)}")
    for run in shard_runs(target, full_size, target_tp, target_rank):
        dst = out.narrow(target.dim, run.local_start, run.length)
        if run.full_start is None:
            dst.zero_()
        else:
            copy_rows(read, dst, saved, saved_tp, full_size, run.full_start, max_rows)
    return out


def copy_rows(read: ReadPiece, dst: torch.Tensor, saved: TPMeta, saved_tp: int, full_size: int, start: int,
              max_rows: Optional[int] = None) -> torch.Tensor:
    """Fill ``dst`` with the full range ``[start, start + dst.shape[dim])`` along ``saved.dim``, read from the
    saved pieces through ``read`` at most ``max_rows`` entries at a time. Returns ``dst``."""
    dim = saved.dim
    step = max_rows or full_size or 1
    stop = start + dst.shape[dim]
    for src in source_runs(saved, full_size, saved_tp, start, stop):
        for lo in range(0, src.length, step):
            n = min(step, src.length - lo)
            first = src.local_start + lo
            dst.narrow(dim, src.full_start - start + lo, n).copy_(read(src.rank, first, first + n))
    return dst
