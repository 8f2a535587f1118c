"""Tensor-parallel metadata carried by every parameter.

Each parameter records how its full (TP=1) tensor maps onto the TP ranks:

* replicated: every TP rank holds the whole tensor;
* partitioned along ``dim`` with ``stride`` s: the full dimension is cut into
  ``s`` equal blocks (for example q, k and v of a fused projection), every
  block is cut into ``tp`` pieces, and TP rank r holds piece r of each block,
  concatenated;
* optionally padded: the full dimension has ``logical_size`` entries and is
  padded with zeros up to a multiple of ``pad_multiple * tp`` before cutting
  (the vocabulary of the embedding).

Gradient norms (count replicated parameters once), checkpoint resharding and
format conversion all read this one record, so :func:`shard` and
:func:`merge` below are the only definition of the layout.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

_ATTR = "_hybrid_tp_meta"


@dataclasses.dataclass(frozen=True)
class TPMeta:
    dim: Optional[int] = None  # None: replicated over the TP group
    stride: int = 1
    logical_size: Optional[int] = None  # unpadded full size along ``dim``
    pad_multiple: int = 1  # full size is padded to a multiple of pad_multiple * tp

    @property
    def partitioned(self) -> bool:
        return self.dim is not None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TPMeta":
        return cls(**d)


REPLICATED = TPMeta()


def set_tp_meta(param: torch.Tensor, dim: Optional[int] = None, stride: int = 1,
                logical_size: Optional[int] = None, pad_multiple: int = 1) -> torch.Tensor:
    setattr(param, _ATTR, TPMeta(dim, stride, logical_size, pad_multiple))
    return param


def get_tp_meta(param: torch.Tensor) -> TPMeta:
    return getattr(param, _ATTR, REPLICATED)


def padded_size(logical: int, meta: TPMeta, tp: int) -> int:
    unit = meta.pad_multiple * tp
    return -(-logical // unit) * unit


def full_shape(local_shape: Sequence[int], meta: TPMeta, tp: int) -> List[int]:
    """The logical (unpadded) TP=1 shape of a parameter whose shard has ``local_shape``."""
    shape = list(local_shape)
    if meta.partitioned:
        shape[meta.dim] = meta.logical_size if meta.logical_size is not None else shape[meta.dim] * tp
    return shape


def shard(full: torch.Tensor, meta: TPMeta, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of the logical full tensor (a new contiguous tensor)."""
    if not meta.partitioned:
        return full.clone()
    dim = meta.dim
    if meta.logical_size is not None:
        if full.shape[dim] != meta.logical_size:
            raise ValueError(f"expected {meta.logical_size} entries along dim {dim}, got {full.shape[dim]}")
        pad = padded_size(meta.logical_size, meta, tp) - meta.logical_size
        if pad:
            pad_shape = list(full.shape)
            pad_shape[dim] = pad
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    size = full.shape[dim]
    if size % (meta.stride * tp) != 0:
        raise ValueError(f"dimension {dim} of size {size} cannot be split into {meta.stride} blocks "
                         f"of {tp} TP pieces; it must be divisible by {meta.stride * tp}")
    blocks = full.chunk(meta.stride, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def merge(pieces: Sequence[torch.Tensor], meta: TPMeta) -> torch.Tensor:
    """Inverse of :func:`shard`: the logical full tensor from every TP rank's piece, in rank order."""
    if not meta.partitioned:
        return pieces[0].clone()
    dim, tp = meta.dim, len(pieces)
    per_rank = [p.chunk(meta.stride, dim=dim) for p in pieces]
    blocks = [torch.cat([per_rank[r][b] for r in range(tp)], dim=dim) for b in range(meta.stride)]
    full = torch.cat(blocks, dim=dim)
    if meta.logical_size is not None:
        full = full.narrow(dim, 0, meta.logical_size)
    return full.contiguous()


# ---- pipeline ties --------------------------------------------------------------------------------
_TIED_ATTR = "_hybrid_pipeline_tied"


def set_pipeline_tied(param: torch.Tensor) -> torch.Tensor:
    """Mark ``param`` as one of two copies of a weight tied across the first and the last pipeline stage
    (the input and output embeddings). The ZeRO optimizer keeps it in a flat group of its own, laid out
    identically on both stages, sums its gradient over the ``"embed"`` axis, and counts it once in the norm."""
    setattr(param, _TIED_ATTR, True)
    return param


def is_pipeline_tied(param: torch.Tensor) -> bool:
    return bool(getattr(param, _TIED_ATTR, False))
