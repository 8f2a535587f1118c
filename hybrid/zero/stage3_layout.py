"""ZeRO stage 3 layout: which parameters are gathered together, and where each rank's slice lives.

A *unit* is the set of trainable parameters gathered by one collective. Each
module that directly owns trainable parameters (``module._parameters``, not
its children's) gives one unit; a parameter reachable from several modules
(tied embeddings) belongs to the first module that owns it in
``named_modules`` order. Parameters with at most ``persistence_threshold``
elements (biases, norm weights) are pooled into one *persistent* unit that
every rank keeps whole: gathering them per module would cost more in
latency than they save in memory.

A unit's parameters are laid out back to back in a flat buffer of
``unit.numel`` elements (weight-decayed ones first, then the rest), padded to
a multiple of ``N_d x 128 bytes`` and cut into ``N_d`` equal chunks; DP rank
``k`` keeps chunk ``k``. One all-gather of the chunks over ``dp`` therefore
rebuilds the whole unit buffer, and every parameter is a view into it.

A rank's *partition* is the concatenation of its chunks of every unit, in unit
order: ``partition_numel`` elements, the chunk of unit ``u`` at
``u.partition_offset``. The master weights, Adam state and gradient
partition all share this layout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from hybrid.param_meta import TPMeta, get_tp_meta
from hybrid.zero.flat_buffer import (ParamFilter, ParamRecord, Segment, ZeroConfigError, align_elements,
                                     collect_trainable, param_parts)

NoDecayFn = Callable[[str, torch.nn.Parameter], bool]
PERSISTENT_UNIT_NAME = "<persistent>"


@dataclasses.dataclass(frozen=True)
class UnitParam:
    """One parameter inside its unit's flat buffer: elements ``[offset, offset + numel)``."""

    name: str
    shape: Tuple[int, ...]
    numel: int
    offset: int
    position: int  # registration order among trainable parameters (tied ones once)
    weight_decay: bool
    tp_meta: TPMeta

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "numel": self.numel, "offset": self.offset,
                "position": self.position, "weight_decay": self.weight_decay, "tp_meta": self.tp_meta.to_json()}


@dataclasses.dataclass
class Unit:
    """The parameters gathered together (one module's, or the persistent pool)."""

    index: int
    module_name: str
    persistent: bool
    records: List[UnitParam]
    params: List[nn.Parameter]
    numel: int  # padded, a multiple of dp * align
    used: int  # elements that hold parameters
    decay_end: int  # elements [0, decay_end) are weight-decayed
    dp: int
    partition_offset: int = 0

    @property
    def chunk_numel(self) -> int:
        return self.numel // self.dp

    @property
    def whole_parameter(self) -> bool:
        """One parameter filling the unit, no padding: its gradient can be the unit's staging buffer as autograd
        made it (:mod:`hybrid.zero.stage3_grads`), which the planner's replay of backward counts once."""
        return len(self.records) == 1 and self.used == self.numel

    def chunk_range(self, dp_rank: int) -> Tuple[int, int]:
        return dp_rank * self.chunk_numel, (dp_rank + 1) * self.chunk_numel

    def pieces(self, dp_rank: int):
        """``(record index, param_start, param_end, chunk_offset)`` for each parameter piece in ``dp_rank``'s chunk."""
        lo, hi = self.chunk_range(dp_rank)
        for i, rec in enumerate(self.records):
            a, b = max(lo, rec.offset), min(hi, rec.offset + rec.numel)
            if a < b:
                yield i, a - rec.offset, b - rec.offset, a - lo


def _owners(model: nn.Module, trainable_ids: Dict[int, int]) -> List[Tuple[str, List[int]]]:
    """``(module name, [positions of the trainable parameters it owns first])`` in module order."""
    seen = set()
    out = []
    for mod_name, mod in model.named_modules():
        owned = []
        for p in mod._parameters.values():
            if p is None or id(p) not in trainable_ids or id(p) in seen:
                continue
            seen.add(id(p))
            owned.append(trainable_ids[id(p)])
        if owned:
            out.append((mod_name, owned))
    return out


def build_units(model: nn.Module, dp: int, persistence_threshold: int, use_weight_decay: bool,
                no_weight_decay: Optional[NoDecayFn], select: Optional[ParamFilter] = None
                ) -> Tuple[List[Unit], List[nn.Parameter]]:
    """Cut ``model``'s trainable parameters into units (see the module docstring); also return the frozen ones.

    Pure bookkeeping: no tensor is copied or moved. Every unit's
    ``partition_offset`` is filled in. ``select``: the parameters this optimizer takes
    (:func:`~hybrid.zero.flat_buffer.collect_trainable`).
    """
    trainable, frozen = collect_trainable(model, select)
    dtypes = {p.dtype for _, p in trainable}
    if len(dtypes) > 1:
        raise ZeroConfigError(f"ZeRO stage 3 needs every trainable parameter in one dtype, got "
                              f"{sorted(map(str, dtypes))}; cast the model (model.to(dtype)) first")
    devices = {p.device.type for _, p in trainable} - {"meta"}
    if len(devices) > 1:
        raise ZeroConfigError(f"trainable parameters are spread over devices {sorted(devices)}; move the model "
                              f"to one device before building the optimizer")
    if persistence_threshold < 0:
        raise ZeroConfigError(f"persistence_threshold must be >= 0 elements, got {persistence_threshold} "
                              f"(config key zero.persistence_threshold)")
    dtype = trainable[0][1].dtype
    if not dtype.is_floating_point:
        raise ZeroConfigError(f"parameters have dtype {dtype}; only floating-point parameters can be trained")
    align = align_elements(dtype)
    ids = {id(p): i for i, (_, p) in enumerate(trainable)}

    def decays(i: int) -> bool:
        name, p = trainable[i]
        return use_weight_decay and not (no_weight_decay is not None and no_weight_decay(name, p))

    persistent = [i for i, (_, p) in enumerate(trainable) if p.numel() <= persistence_threshold]
    persistent_set = set(persistent)
    groups = [(name, [i for i in owned if i not in persistent_set]) for name, owned in _owners(model, ids)]
    groups = [(name, owned) for name, owned in groups if owned]
    if persistent:
        groups.append((PERSISTENT_UNIT_NAME, persistent))

    units: List[Unit] = []
    offset_in_partition = 0
    for index, (mod_name, positions) in enumerate(groups):
        ordered = sorted(positions, key=lambda i: (not decays(i), i))  # decayed first, stable
        records, params, offset = [], [], 0
        for i in ordered:
            name, p = trainable[i]
            records.append(UnitParam(name=name, shape=tuple(p.shape), numel=p.numel(), offset=offset, position=i,
                                     weight_decay=decays(i), tp_meta=get_tp_meta(p)))
            params.append(p)
            offset += p.numel()
        unit_align = dp * align
        numel = max(unit_align, -(-offset // unit_align) * unit_align)
        decay_end = sum(r.numel for r in records if r.weight_decay)
        unit = Unit(index=index, module_name=mod_name, persistent=mod_name == PERSISTENT_UNIT_NAME,
                    records=records, params=params, numel=numel, used=offset, decay_end=decay_end, dp=dp,
                    partition_offset=offset_in_partition)
        offset_in_partition += unit.chunk_numel
        units.append(unit)
    return units, frozen


def partition_numel(units: List[Unit]) -> int:
    return sum(u.chunk_numel for u in units)


def param_index(units: List[Unit], dp: int) -> List[ParamRecord]:
    """The parameter index of a ZeRO-3 partition, in the form stages 1-2 record theirs.

    The units laid end to end are one flat group (index 0) whose segments are
    the units: a parameter's ``offset`` counts from the start of the first
    unit, and its ``parts`` say where each DP rank's partition holds it, so
    checkpoint tools read a stage-3 partition like any other.
    """
    records = []
    start = 0
    for u in units:
        segment = Segment(start=start, size=u.numel, used=u.used, records=())
        for rec, p in zip(u.records, u.params):
            records.append(ParamRecord(name=rec.name, shape=rec.shape, dtype=p.dtype, group=0, segment=u.index,
                                       offset=start + rec.offset, numel=rec.numel, position=rec.position,
                                       weight_decay=rec.weight_decay, tp_meta=rec.tp_meta,
                                       parts=param_parts(start + rec.offset, rec.numel, segment, dp)))
        start += u.numel
    return sorted(records, key=lambda r: r.position)
