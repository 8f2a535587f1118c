"""Flat parameter buffers, the parameter index, and their DP partitioning.

Trainable parameters are grouped by ``(dtype, weight decay on/off, tied
across pipeline stages)`` (:func:`group_classes`). Each group becomes one
contiguous 1-D buffer, and every parameter of the group is rebound to a view
into it, in module registration order (:func:`place_group`). Frozen parameters
(``requires_grad=False``) stay where they are; a parameter reachable under two
names (tied weights) is placed once, under its first name.

A group buffer is cut into *segments* of about ``bucket_numel`` elements
holding whole parameters. On an interleaved pipeline stage a segment also
ends where the model chunks whose backward passes reach the parameters
change (:func:`param_chunk_sets`), so that each segment is reduced in its own
chunks' passes only, never once more for a neighbour's. Each segment is padded so that it divides into
``parts`` equal chunks of a multiple of :data:`ALIGN_BYTES`::

    group buffer  | segment 0               | segment 1         |
                  | c0 | c1 | c2 | c3 (pad) | c0 | c1 | c2 | c3 |

Part ``k`` (DP rank ``k`` for ZeRO stages 1-2; ``parts == 1`` for stage 0)
owns chunk ``k`` of every segment. Its *flat partition* is the concatenation
of those chunks: ``group.numel // parts`` elements, where the chunk of segment
``s`` sits at partition offset ``s.start // parts``. The segment is the unit of
gradient communication (one reduce per segment, launched as soon as its
gradients are complete), so partitioning per segment lets gradients be
reduce-scattered while backward is still running. A parameter may straddle
chunk boundaries; :meth:`ParamRecord.parts` says which piece lives where.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, FrozenSet, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from hybrid.param_meta import TPMeta, get_tp_meta, is_pipeline_tied

ALIGN_BYTES = 128  # every chunk starts on a 128-byte boundary (vector loads, NCCL/gloo fast paths)

NoDecayFn = Callable[[str, torch.nn.Parameter], bool]
# Which of a model's parameters one optimizer takes (``(name, parameter) -> bool``); the rest belong to another
# (:mod:`hybrid.zero.expert_split`: dense and expert parameters). None: every parameter.
ParamFilter = Callable[[str, torch.nn.Parameter], bool]


class ZeroConfigError(ValueError):
    """A ZeRO optimizer argument or model that cannot be laid out."""


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of a parameter that lives in one flat partition.

    Elements ``[param_start, param_end)`` of the flattened parameter sit at
    ``[partition_offset, partition_offset + param_end - param_start)`` of part
    ``part``'s flat partition.
    """

    part: int
    param_start: int
    param_end: int
    partition_offset: int


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """Where one trainable parameter lives in its group's flat buffer."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    group: int  # index into the optimizer's flat groups
    segment: int  # index of the segment inside the group
    offset: int  # element offset in the group's flat buffer
    numel: int
    position: int  # registration order among trainable parameters
    weight_decay: bool
    tp_meta: TPMeta
    parts: Tuple[Part, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype),
                "group": self.group, "segment": self.segment, "offset": self.offset,
                "numel": self.numel, "position": self.position, "weight_decay": self.weight_decay,
                "tp_meta": self.tp_meta.to_json(),
                "parts": [dataclasses.asdict(p) for p in self.parts]}


@dataclasses.dataclass(frozen=True)
class Segment:
    """``[start, start + size)`` of a group buffer; ``size`` divides into ``parts`` aligned chunks."""

    start: int
    size: int  # padded
    used: int  # elements holding parameters; the rest is zero padding
    records: Tuple[int, ...]  # indices into the group's records

    def chunk_numel(self, parts: int) -> int:
        return self.size // parts

    def chunk_range(self, part: int, parts: int) -> Tuple[int, int]:
        c = self.size // parts
        return self.start + part * c, self.start + (part + 1) * c


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def align_elements(dtype: torch.dtype) -> int:
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def plan_segments(numels: Sequence[int], parts: int, bucket_numel: int,
                  align: int, keys: Optional[Sequence[Hashable]] = None) -> List[Segment]:
    """Cut parameters (given by size, in order) into padded segments. Pure arithmetic.

    A segment takes whole parameters until adding the next would pass
    ``bucket_numel``, or until the next one's key (``keys``, one per
    parameter: the model chunks reaching it, :func:`param_chunk_sets`)
    differs; a parameter larger than ``bucket_numel`` gets a segment of its
    own. Each segment is padded to a multiple of ``parts * align`` elements.
    """
    if parts < 1 or bucket_numel < 1 or align < 1:
        raise ZeroConfigError(f"parts={parts}, bucket_numel={bucket_numel} and align={align} "
                              f"must all be >= 1")
    unit = parts * align
    segments: List[Segment] = []
    start, current, used = 0, [], 0

    def close():
        nonlocal start, current, used
        size = -(-used // unit) * unit
        segments.append(Segment(start=start, size=size, used=used, records=tuple(current)))
        start, current, used = start + size, [], 0

    if keys is not None and len(keys) != len(numels):
        raise ZeroConfigError(f"{len(keys)} segment keys for {len(numels)} parameters")
    for i, n in enumerate(numels):
        if current and (used + n > bucket_numel or (keys is not None and keys[i] != keys[current[-1]])):
            close()
        current.append(i)
        used += n
    if current:
        close()
    return segments


def param_parts(offset: int, numel: int, segment: Segment, parts: int) -> Tuple[Part, ...]:
    """The pieces of the parameter at ``[offset, offset + numel)`` owned by each part."""
    c = segment.chunk_numel(parts)
    out = []
    for k in range(parts):
        lo, hi = segment.chunk_range(k, parts)
        a, b = max(lo, offset), min(hi, offset + numel)
        if a < b:
            out.append(Part(part=k, param_start=a - offset, param_end=b - offset,
                            partition_offset=segment.start // parts + (a - lo)))
    assert sum(p.param_end - p.param_start for p in out) == numel and c > 0
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one parameter of a group goes: its segment, its element offset in the group buffer, its parts."""

    segment: int
    offset: int
    parts: Tuple[Part, ...]


def place_group(numels: Sequence[int], parts: int, pad_parts: int, bucket_numel: int,
                align: int, keys: Optional[Sequence[Hashable]] = None) -> Tuple[List[Segment], List[Placement]]:
    """Lay out one group's parameters (given by size, in buffer order): its segments, and each parameter's
    :class:`Placement`. Pure arithmetic: the optimizer's layout, which offline tools reproduce by calling it.

    Segments are padded for ``pad_parts`` and end where ``keys`` change (:func:`plan_segments`); the parameter
    pieces are cut for ``parts`` (see :func:`build_flat_groups`).
    """
    segments = plan_segments(numels, pad_parts, bucket_numel, align, keys)
    placements: List[Optional[Placement]] = [None] * len(numels)
    for s_idx, seg in enumerate(segments):
        offset = seg.start
        for r in seg.records:
            placements[r] = Placement(s_idx, offset, param_parts(offset, numels[r], seg, parts))
            offset += numels[r]
    return segments, placements  # type: ignore[return-value]


def param_chunk_sets(params: Sequence[object], chunk_params: Optional[Sequence[Sequence[object]]],
                     chunks: Optional[int] = None) -> Optional[List[FrozenSet[int]]]:
    """Per parameter of ``params`` (in order), the model chunks whose backward passes give it gradients.

    ``chunk_params[c]``: the parameters a pass through chunk ``c`` of an interleaved pipeline stage reaches
    (parameters, which hash by identity, or their names). A parameter in no chunk's list counts as in all of
    ``chunks`` (default: ``len(chunk_params)``). None for a rank of one chunk, or with no lists.
    """
    chunks = len(chunk_params) if chunks is None and chunk_params is not None else chunks
    if chunk_params is None or not chunks or chunks == 1:
        return None
    held: Dict[Hashable, Set[int]] = collections.defaultdict(set)
    for c, members in enumerate(chunk_params):
        for p in members:
            held[p].add(c)
    every = frozenset(range(chunks))
    return [frozenset(held[p]) if p in held else every for p in params]


def group_classes(keys: Sequence[Hashable]) -> Dict[Hashable, List[int]]:
    """The flat-group class of each parameter (``keys``, in registration order) to its members' indices.

    Classes come in the order in which each first appears: the optimizer's group order, the same on every
    rank of a stage.
    """
    classes: Dict[Hashable, List[int]] = {}
    for i, key in enumerate(keys):
        classes.setdefault(key, []).append(i)
    return classes


class FlatGroup:
    """One contiguous buffer holding every trainable parameter of one (dtype, decay, tied) class.

    ``tied``: the group holds only a weight tied across pipeline stages
    (:func:`hybrid.param_meta.is_pipeline_tied`), alone, so that its partitions
    cover the same elements on both stages that hold a copy.

    Attributes:
        buffer: ``[numel]`` tensor of ``dtype``; each parameter's ``.data`` is a view into it.
        segments: the padded segments, in buffer order.
        records: the parameter records, in buffer order.
        params: the parameters, parallel to ``records``.
    """

    def __init__(self, index: int, dtype: torch.dtype, weight_decay: bool,
                 named: List[Tuple[str, torch.nn.Parameter, int]], parts: int, pad_parts: int,
                 bucket_numel: int, tied: bool = False, segment_keys: Optional[Sequence[Hashable]] = None):
        if pad_parts % parts != 0:
            raise ZeroConfigError(f"pad_parts={pad_parts} must be a multiple of parts={parts}")
        self.index = index
        self.dtype = dtype
        self.weight_decay = weight_decay
        self.decoupled_lr = False  # steps at optimizer.decoupled_lr's schedule (build_flat_groups sets it)
        self.tied = tied
        self.parts = parts
        self.segments, placements = place_group([p.numel() for _, p, _ in named], parts, pad_parts, bucket_numel,
                                                align_elements(dtype), segment_keys)
        self.numel = self.segments[-1].start + self.segments[-1].size
        self.device = named[0][1].device
        self.params: List[torch.nn.Parameter] = [p for _, p, _ in named]
        self.records: List[ParamRecord] = [
            ParamRecord(name=name, shape=tuple(p.shape), dtype=dtype, group=index, segment=at.segment,
                        offset=at.offset, numel=p.numel(), position=position, weight_decay=weight_decay,
                        tp_meta=get_tp_meta(p), parts=at.parts)
            for (name, p, position), at in zip(named, placements)]
        self.buffer = torch.zeros(self.numel, dtype=dtype, device=self.device)
        for rec, p in zip(self.records, self.params):
            view = self.buffer[rec.offset: rec.offset + rec.numel].view(rec.shape)
            view.copy_(p.detach())
            p.data = view

    @property
    def partition_numel(self) -> int:
        return self.numel // self.parts

    def chunk(self, flat: torch.Tensor, segment: int, part: int) -> torch.Tensor:
        """Part ``part``'s chunk of ``segment`` in a buffer-shaped tensor ``flat`` [numel]."""
        lo, hi = self.segments[segment].chunk_range(part, self.parts)
        return flat[lo:hi]

    def partition_chunk(self, partition: torch.Tensor, segment: int) -> torch.Tensor:
        """The chunk of ``segment`` in a partition-shaped tensor ``partition`` [partition_numel]."""
        seg = self.segments[segment]
        lo = seg.start // self.parts
        return partition[lo: lo + seg.chunk_numel(self.parts)]

    def view_of(self, flat: torch.Tensor, record: int) -> torch.Tensor:
        """The parameter-shaped view of record ``record`` in a buffer-shaped tensor ``flat``."""
        rec = self.records[record]
        return flat[rec.offset: rec.offset + rec.numel].view(rec.shape)

    def segment_first_position(self, segment: int) -> int:
        return min(self.records[r].position for r in self.segments[segment].records)


def collect_trainable(model: torch.nn.Module, select: Optional[ParamFilter] = None
                      ) -> Tuple[List[Tuple[str, torch.nn.Parameter]], List[torch.nn.Parameter]]:
    """Trainable parameters in registration order (tied ones once), and the frozen ones.

    ``select``: only the parameters it accepts are listed (trainable or frozen); the others belong to another
    optimizer. Raises :class:`ZeroConfigError` when nothing is trainable.
    """
    trainable, frozen = [], []
    for name, p in model.named_parameters():  # removes duplicates: a tied weight keeps its first name
        if select is not None and not select(name, p):
            continue
        if p.requires_grad:
            trainable.append((name, p))
        else:
            frozen.append(p)
    if not trainable:
        raise ZeroConfigError("the model has no trainable parameters (all have requires_grad=False); "
                              "there is nothing for the optimizer to update")
    return trainable, frozen


def param_owners(group: "FlatGroup", part: int) -> List[torch.Tensor]:
    """Per segment, part ``part``'s chunk of ``group``'s buffer as the record index (0..len(records)-1) of each
    element, ``len(records)`` where it is padding (int64 on the group's device): what LAMB sums its
    per-parameter norms by."""
    owner = torch.full((group.numel,), len(group.records), dtype=torch.long, device=group.device)
    for i, rec in enumerate(group.records):
        owner[rec.offset: rec.offset + rec.numel] = i
    return [group.chunk(owner, s, part) for s in range(len(group.segments))]


def is_embedding_or_output(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron-LM's ``is_embedding_or_output_parameter``: the input embedding and the output layer's weight
    (model_zoo's ``embedding.word_embeddings.weight``, ``output_layer.weight``; one parameter when tied), or a
    parameter a model marks with that attribute. ``optimizer.decoupled_lr`` trains these at their own rate."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False)) or \
        name.endswith(("word_embeddings.weight", "output_layer.weight"))


def build_flat_groups(model: torch.nn.Module, parts: int, pad_parts: int, bucket_numel: int,
                      use_weight_decay: bool, no_weight_decay: Optional[NoDecayFn],
                      chunk_params: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None,
                      select: Optional[ParamFilter] = None, decoupled: bool = False) -> List[FlatGroup]:
    """Rebind every trainable parameter of ``model`` to a view into a flat group buffer.

    ``parts`` is how many flat partitions the state is cut into; segments are
    padded for ``pad_parts`` (a multiple of ``parts``), so that stage 0 (one
    part) lays out and communicates exactly the same bytes as stages 1-2.
    ``chunk_params``: the parameters each model chunk of an interleaved
    pipeline stage reaches; segments end where those chunks change. ``select``: the parameters this
    optimizer takes (:func:`collect_trainable`). ``decoupled``: the embedding and output weights
    (:func:`is_embedding_or_output`) get groups of their own, marked ``decoupled_lr``.
    """
    trainable, _ = collect_trainable(model, select)
    chunk_sets = param_chunk_sets([p for _, p in trainable], chunk_params)
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        raise ZeroConfigError(f"trainable parameters are spread over devices {sorted(map(str, devices))}; "
                              f"move the model to one device before building the optimizer")
    keys = []
    for name, p in trainable:
        if not p.dtype.is_floating_point:
            raise ZeroConfigError(f"parameter {name!r} has dtype {p.dtype}; only floating-point "
                                  f"parameters can be trained")
        if p.device.type == "meta":
            raise ZeroConfigError(f"parameter {name!r} is on the meta device; materialise the model "
                                  f"before building the optimizer")
        decay = use_weight_decay and not (no_weight_decay is not None and no_weight_decay(name, p))
        keys.append((p.dtype, decay, is_pipeline_tied(p), decoupled and is_embedding_or_output(name, p)))
    classes = group_classes(keys)
    groups = []
    for i, ((dtype, decay, tied, own_lr), members) in enumerate(classes.items()):
        group = FlatGroup(i, dtype, decay, [(trainable[m][0], trainable[m][1], m) for m in members], parts,
                          pad_parts, bucket_numel, tied, None if chunk_sets is None else [chunk_sets[m] for m in members])
        group.decoupled_lr = own_lr
        groups.append(group)
    return groups
