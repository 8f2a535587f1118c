"""Tensor-parallel metadata carried by every parameter.

Each parameter records how its full (TP=1) tensor maps onto the TP ranks:

* replicated: every TP rank holds the whole tensor;
* partitioned along ``dim`` with ``stride`` s: the full dimension is cut into
  ``s`` equal blocks (for example the gate and up halves of a fused SwiGLU
  projection), every block is cut into ``tp`` pieces, and TP rank r holds
  piece r of each block, concatenated;
* partitioned along ``dim`` 0 in unequal ``blocks`` ``((size, units), ...)``
  (the q, k and v of a grouped-query projection): block b has ``size``
  entries made of ``units`` equal, indivisible units (heads). With ``tp``
  ranks it is cut into ``n = min(units, tp)`` pieces and TP rank r holds
  piece ``r * n // tp`` of every block, concatenated. When ``tp > units`` a
  piece is therefore held by ``tp / units`` consecutive ranks (a replicated
  key/value head), whose gradients the model sums over exactly those ranks;
  the gradient norm counts such a piece on the first of them only
  (:func:`norm_ranges`). ``units`` and ``tp`` must divide one another
  (:func:`split_units`);
* optionally padded: the full dimension has ``logical_size`` entries and is
  padded with zeros up to a multiple of ``pad_multiple * tp`` before cutting
  (the vocabulary of the embedding).

Gradient norms (count replicated parameters once), checkpoint resharding and
format conversion all read this one record, so :func:`piece_runs` (which
full ranges make up a piece) and :func:`source_runs` (which piece holds a
full range) below are the only definition of the layout; :func:`shard` and
:func:`merge` apply them to whole tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from hybrid.tp_units import split_units  # the rule, torch-free; read here by the TP cuts and their callers

_ATTR = "_hybrid_tp_meta"

Blocks = Tuple[Tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class TPMeta:
    dim: Optional[int] = None  # None: replicated over the TP group
    stride: int = 1
    logical_size: Optional[int] = None  # unpadded full size along ``dim``
    pad_multiple: int = 1  # full size is padded to a multiple of pad_multiple * tp
    blocks: Optional[Blocks] = None  # unequal blocks ((size, units), ...) along dim 0; see the module docstring

    def __post_init__(self):
        if self.blocks is not None:
            blocks = tuple((int(s), int(u)) for s, u in self.blocks)
            object.__setattr__(self, "blocks", blocks)
            if self.dim != 0 or self.stride != 1 or self.logical_size is not None:
                raise ValueError(f"TPMeta: blocks {blocks} need dim=0, stride=1 and no padding, got dim={self.dim}, "
                                 f"stride={self.stride}, logical_size={self.logical_size}")
            for size, units in blocks:
                if units < 1 or size % units:
                    raise ValueError(f"TPMeta: a block of {size} entries cannot hold {units} equal units")

    @property
    def partitioned(self) -> bool:
        return self.dim is not None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if self.blocks is None:  # checkpoints of models without blocks keep their old records
            del d["blocks"]
        else:
            d["blocks"] = [list(b) for b in self.blocks]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TPMeta":
        return cls(**d)


REPLICATED = TPMeta()


def set_tp_meta(param: torch.Tensor, dim: Optional[int] = None, stride: int = 1,
                logical_size: Optional[int] = None, pad_multiple: int = 1,
                blocks: Optional[Blocks] = None) -> torch.Tensor:
    setattr(param, _ATTR, TPMeta(dim, stride, logical_size, pad_multiple, blocks))
    return param


def get_tp_meta(param: torch.Tensor) -> TPMeta:
    return getattr(param, _ATTR, REPLICATED)


# An expert parameter of an MoE layer: only the ranks of one ``ep`` position hold it, so its gradient is reduced,
# and its optimizer state partitioned, over ``edp`` (hybrid.topology.Topology.expert_data_view), not ``dp``.
_EXPERT_ATTR = "_hybrid_expert"


def set_expert(param: torch.Tensor) -> torch.Tensor:
    setattr(param, _EXPERT_ATTR, True)
    return param


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, _EXPERT_ATTR, False)


def padded_size(logical: int, meta: TPMeta, tp: int) -> int:
    unit = meta.pad_multiple * tp
    return -(-logical // unit) * unit


def _blocks(meta: TPMeta, full_size: int, tp: int) -> List[Tuple[int, int, int]]:
    """The blocks along ``meta.dim`` as ``(full_start, size, pieces)``; sizes include the vocabulary padding."""
    if meta.blocks is not None:
        if full_size != sum(s for s, _ in meta.blocks):
            raise ValueError(f"dimension 0 of size {full_size} does not match its blocks {meta.blocks}")
        out, start = [], 0
        for size, units in meta.blocks:
            out.append((start, size, split_units(units, tp)))
            start += size
        return out
    padded = padded_size(full_size, meta, tp) if meta.logical_size is not None else full_size
    if padded % (meta.stride * tp) != 0:
        raise ValueError(f"dimension {meta.dim} of size {padded} cannot be split into {meta.stride} blocks of "
                         f"{tp} TP pieces; it must be divisible by {meta.stride * tp}")
    block = padded // meta.stride
    return [(b * block, block, tp) for b in range(meta.stride)]


def piece_size(meta: TPMeta, full_size: int, tp: int) -> int:
    """Size along ``meta.dim`` of one TP rank's piece of a full tensor of ``full_size`` logical entries."""
    return sum(size // n for _, size, n in _blocks(meta, full_size, tp))


def full_size_of(meta: TPMeta, local_size: int, tp: int) -> int:
    """The logical full size along ``meta.dim`` of a tensor whose TP pieces have ``local_size`` entries there."""
    if meta.blocks is not None:
        return sum(s for s, _ in meta.blocks)
    return meta.logical_size if meta.logical_size is not None else local_size * tp


def full_shape(local_shape: Sequence[int], meta: TPMeta, tp: int) -> List[int]:
    """The logical (unpadded) TP=1 shape of a parameter whose shard has ``local_shape``."""
    shape = list(local_shape)
    if meta.partitioned:
        shape[meta.dim] = full_size_of(meta, shape[meta.dim], tp)
    return shape


@dataclasses.dataclass(frozen=True)
class ShardRun:
    """Entries ``[local_start, local_start + length)`` of a piece come from the full tensor at
    ``full_start`` (``full_start is None``: zero padding)."""

    local_start: int
    full_start: Optional[int]
    length: int


@dataclasses.dataclass(frozen=True)
class SourceRun:
    """``length`` entries of the full tensor from ``full_start`` sit in TP rank ``rank``'s
    piece from ``local_start`` on."""

    rank: int
    local_start: int
    full_start: int
    length: int


def piece_runs(meta: TPMeta, full_size: int, tp: int, rank: int) -> List[ShardRun]:
    """How TP rank ``rank``'s piece (``tp`` ranks, laid out by ``meta``) is cut from the full tensor."""
    if not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} is outside [0, {tp})")
    runs, local = [], 0
    for start, size, n in _blocks(meta, full_size, tp):
        chunk = size // n
        lo = start + (rank * n // tp) * chunk
        real = max(0, min(chunk, full_size - lo))  # entries past full_size are padding
        if real:
            runs.append(ShardRun(local_start=local, full_start=lo, length=real))
        if real < chunk:
            runs.append(ShardRun(local_start=local + real, full_start=None, length=chunk - real))
        local += chunk
    return runs


def source_runs(meta: TPMeta, full_size: int, tp: int, start: int, stop: int) -> Iterator[SourceRun]:
    """The runs of pieces (``tp`` ranks, laid out by ``meta``) covering full ``[start, stop)``.

    A piece held by several ranks is read from the first of them.
    ``full_size`` is the logical size along ``meta.dim``; ``stop`` must not exceed it.
    """
    if not 0 <= start <= stop <= full_size:
        raise ValueError(f"range [{start}, {stop}) is outside the full size {full_size}")
    local = 0
    for b_start, size, n in _blocks(meta, full_size, tp):
        chunk = size // n
        i = max(start, b_start)
        while i < min(stop, b_start + size):
            p, offset = divmod(i - b_start, chunk)
            length = min(stop - i, chunk - offset)
            yield SourceRun(rank=p * (tp // n), local_start=local + offset, full_start=i, length=length)
            i += length
        local += chunk


def replicated_runs(meta: TPMeta, full_size: int, tp: int) -> List[Tuple[int, int, int]]:
    """``(lo, hi, replicas)``: the ranges ``[lo, hi)`` along the dim of every rank's piece that
    ``replicas`` > 1 consecutive TP ranks hold alike (block pieces of fewer units than ranks)."""
    if meta.blocks is None:
        return []
    out, local = [], 0
    for _, size, n in _blocks(meta, full_size, tp):
        if n < tp:
            out.append((local, local + size // n, tp // n))
        local += size // n
    return out


def norm_ranges(meta: TPMeta, local_shape: Sequence[int], tp: int, rank: int) -> List[Tuple[int, int]]:
    """``[lo, hi)`` ranges of this rank's flattened piece that the gradient norm counts on this rank.

    Every gradient element is counted once over the TP group: a replicated
    parameter on TP rank 0, a partitioned one by every rank, and a block
    piece held by several ranks on the first of them.
    """
    numel = 1
    for s in local_shape:
        numel *= s
    if not meta.partitioned:
        return [(0, numel)] if rank == 0 else []
    if not numel:
        return []
    row = numel // local_shape[0]
    out: List[Tuple[int, int]] = []
    start = 0
    for lo, hi, replicas in replicated_runs(meta, full_size_of(meta, local_shape[0], tp), tp):
        if rank % replicas:  # another rank holds this piece first
            if lo > start:
                out.append((start * row, lo * row))
            start = hi
    if start < local_shape[0]:
        out.append((start * row, local_shape[0] * row))
    return out


def shard(full: torch.Tensor, meta: TPMeta, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of the logical full tensor (a new contiguous tensor)."""
    if not meta.partitioned:
        return full.clone()
    dim = meta.dim
    if meta.logical_size is not None and full.shape[dim] != meta.logical_size:
        raise ValueError(f"expected {meta.logical_size} entries along dim {dim}, got {full.shape[dim]}")
    parts = []
    for run in piece_runs(meta, full.shape[dim], tp, rank):
        if run.full_start is None:
            pad_shape = list(full.shape)
            pad_shape[dim] = run.length
            parts.append(full.new_zeros(pad_shape))
        else:
            parts.append(full.narrow(dim, run.full_start, run.length))
    return torch.cat(parts, dim=dim).contiguous()


def merge(pieces: Sequence[torch.Tensor], meta: TPMeta) -> torch.Tensor:
    """Inverse of :func:`shard`: the logical full tensor from every TP rank's piece, in rank order."""
    if not meta.partitioned:
        return pieces[0].clone()
    dim, tp = meta.dim, len(pieces)
    size = full_size_of(meta, pieces[0].shape[dim], tp)
    parts = [pieces[r.rank].narrow(dim, r.local_start, r.length) for r in source_runs(meta, size, tp, 0, size)]
    return torch.cat(parts, dim=dim).contiguous()


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
