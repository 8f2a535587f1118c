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
taken whole. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, List, Optional, Sequence

import torch

from hybrid.param_meta import TPMeta, padded_size


@dataclasses.dataclass(frozen=True)
class SourceRun:
    """``length`` entries of the full tensor from ``full_start`` sit in TP rank ``rank``'s
    piece from ``local_start`` on."""

    rank: int
    local_start: int
    full_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class ShardRun:
    """Entries ``[local_start, local_start + length)`` of a piece come from the full tensor at
    ``full_start`` (``full_start is None``: zero padding)."""

    local_start: int
    full_start: int | None
    length: int


def padded_full_size(meta: TPMeta, full_size: int, tp: int) -> int:
    """Size along ``meta.dim`` of the full tensor once padded for ``tp`` ranks."""
    if meta.logical_size is None:
        return full_size
    return padded_size(full_size, meta, tp)


def piece_size(meta: TPMeta, full_size: int, tp: int) -> int:
    """Size along ``meta.dim`` of one TP rank's piece of a full tensor of ``full_size`` entries."""
    padded = padded_full_size(meta, full_size, tp)
    if padded % (meta.stride * tp) != 0:
        raise ValueError(f"dimension {meta.dim} of size {padded} cannot be split into {meta.stride} blocks of "
                         f"{tp} TP pieces; it must be divisible by {meta.stride * tp}")
    return padded // tp


def source_runs(meta: TPMeta, full_size: int, tp: int, start: int, stop: int) -> Iterator[SourceRun]:
    """The runs of saved pieces (``tp`` ranks, laid out by ``meta``) covering full ``[start, stop)``.

    ``full_size`` is the logical size along ``meta.dim``; ``stop`` must not exceed it.
    """
    if not 0 <= start <= stop <= full_size:
        raise ValueError(f"range [{start}, {stop}) is outside the full size {full_size}")
    block = piece_size(meta, full_size, tp) * tp // meta.stride  # one of the `stride` blocks, padded
    chunk = block // tp  # one rank's part of one block
    i = start
    while i < stop:
        b, within = divmod(i, block)
        rank, offset = divmod(within, chunk)
        n = min(stop - i, chunk - offset)
        yield SourceRun(rank=rank, local_start=b * chunk + offset, full_start=i, length=n)
        i += n


def shard_runs(meta: TPMeta, full_size: int, tp: int, rank: int) -> List[ShardRun]:
    """How TP rank ``rank``'s piece (``tp`` ranks, laid out by ``meta``) is cut from the full tensor."""
    if not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} is outside [0, {tp})")
    chunk = piece_size(meta, full_size, tp) // meta.stride
    block = chunk * tp
    runs = []
    for b in range(meta.stride):
        lo = b * block + rank * chunk
        real = max(0, min(chunk, full_size - lo))  # entries past full_size are padding
        if real:
            runs.append(ShardRun(local_start=b * chunk, full_start=lo, length=real))
        if real < chunk:
            runs.append(ShardRun(local_start=b * chunk + real, full_start=None, length=chunk - real))
    return runs


ReadPiece = Callable[[int, int, int], torch.Tensor]
"""``read(rank, start, stop)``: saved TP rank ``rank``'s piece narrowed to ``[start, stop)`` along the dim."""


def check_same_layout(name: str, saved: TPMeta, current: TPMeta) -> None:
    """Raise unless ``saved`` and ``current`` split the same full tensor the same way (padding may differ)."""
    if (saved.dim, saved.stride, saved.logical_size) != (current.dim, current.stride, current.logical_size):
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
    dim = target.dim
    step = max_rows or full_size or 1
    for run in shard_runs(target, full_size, target_tp, target_rank):
        dst = out.narrow(dim, run.local_start, run.length)
        if run.full_start is None:
            dst.zero_()
            continue
        for src in source_runs(saved, full_size, saved_tp, run.full_start, run.full_start + run.length):
            for lo in range(0, src.length, step):
                n = min(step, src.length - lo)
                start = src.local_start + lo
                dst.narrow(dim, src.full_start - run.full_start + lo, n).copy_(read(src.rank, start, start + n))
    return out
