"""Layout-invariant parameter initialization.

Each parameter's full (TP=1, unpadded) tensor is a pure function of
``(seed, parameter name)``: it is drawn on the CPU in fp32 and then cut to
this TP rank's piece with :func:`hybrid.param_meta.shard`. The same seed
therefore gives the same full model at any TP size.

The full tensor is drawn in *row blocks* (rows along dim 0, about
``ROW_BLOCK_ELEMENTS`` elements per block), block ``b`` from its own
``torch.Generator`` seeded with a stable hash of ``f"{seed}:{name}"`` (block
0) or ``f"{seed}:{name}#{b}"``. Any range of rows can therefore be drawn
without drawing the rest (:func:`draw_rows`, :func:`local_init_slice`): a
ZeRO-3 rank materialises its slice of a 17B-parameter model without ever
generating a whole weight. A tensor of one block draws exactly what one
generator seeded with ``(seed, name)`` would.

Each parameter records *how* it is initialized (an :class:`Initializer`), so a
model built on the ``meta`` device can be materialized later, one parameter at
a time (:func:`materialize`, :func:`local_init_tensor`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from hybrid import param_meta

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

_ATTR = "_hybrid_init"
_KINDS = ("normal", "zeros", "ones")
ROW_BLOCK_ELEMENTS = 1 << 16  # rows drawn from one generator; part of the init definition (changing it changes models)


@dataclasses.dataclass(frozen=True)
class Initializer:
    """How a parameter's full tensor is drawn: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones``."""

    kind: str = "normal"
    std: float = 0.02

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown initializer kind {self.kind!r}; expected one of {', '.join(_KINDS)}")
        if self.kind == "normal" and not self.std > 0:
            raise ValueError(f"normal initializer needs std > 0, got {self.std}")

    def draw(self, shape, generator: torch.Generator) -> torch.Tensor:
        """A new fp32 CPU tensor of ``shape`` (the parameter's logical full shape)."""
        if self.kind == "zeros":
            return torch.zeros(shape, dtype=torch.float32)
        if self.kind == "ones":
            return torch.ones(shape, dtype=torch.float32)
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, self.std, generator=generator)


def normal(std: float) -> Initializer:
    return Initializer("normal", std)


ZEROS = Initializer("zeros", 0.0)
ONES = Initializer("ones", 0.0)


def set_initializer(param: torch.Tensor, init: Initializer) -> torch.Tensor:
    setattr(param, _ATTR, init)
    return param


def get_initializer(param: torch.Tensor) -> Initializer:
    init = getattr(param, _ATTR, None)
    if init is None:
        raise ValueError("parameter has no recorded initializer; create it through the hybrid.tensor_parallel "
                         "layers or call hybrid.tensor_parallel.init.set_initializer on it")
    return init


def seed_for(seed: int, name: str) -> int:
    """A stable 64-bit generator seed for parameter ``name`` (independent of Python's hash salt)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def rows_per_block(shape) -> int:
    """Rows (along dim 0) drawn from one generator for a full tensor of ``shape``; all of them below 2-D."""
    if len(shape) < 2:
        return max(1, shape[0] if shape else 1)
    return max(1, ROW_BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))


def draw_rows(init: Initializer, shape, seed: int, name: str, lo: int, hi: int,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows ``[lo, hi)`` (dim 0) of the full fp32 tensor of ``shape`` that ``(seed, name)`` defines.

    Only the row blocks that overlap ``[lo, hi)`` are drawn; a block wholly
    inside the range is drawn straight into ``out`` (a contiguous fp32
    ``[hi - lo, *shape[1:]]`` tensor, allocated when not given). A 0-d or
    1-d tensor is one block (drawn whole, then sliced).
    """
    shape = list(shape)
    if not shape:
        return init.draw([], torch.Generator(device="cpu").manual_seed(seed_for(seed, name)))
    rest = shape[1:]
    if out is None:
        out = torch.empty([hi - lo] + rest, dtype=torch.float32)
    if init.kind != "normal" or hi <= lo:
        return out.fill_(1.0 if init.kind == "ones" else 0.0)
    per = rows_per_block(shape)
    for b in range(lo // per, (hi - 1) // per + 1):
        b_lo, b_hi = b * per, min((b + 1) * per, shape[0])
        generator = torch.Generator(device="cpu").manual_seed(seed_for(seed, name if b == 0 else f"{name}#{b}"))
        a, z = max(lo, b_lo), min(hi, b_hi)
        if (a, z) == (b_lo, b_hi):  # contiguous rows in memory order: the same numbers as a fresh block
            out[a - lo: z - lo].normal_(0.0, init.std, generator=generator)
        else:
            out[a - lo: z - lo].copy_(init.draw([b_hi - b_lo] + rest, generator)[a - b_lo: z - b_lo])
    return out


def full_init_tensor(param: torch.Tensor, name: str, seed: int, tp_size: int) -> torch.Tensor:
    """The logical full (TP=1, unpadded) fp32 CPU tensor of ``param`` (any device, including meta)."""
    meta = param_meta.get_tp_meta(param)
    shape = param_meta.full_shape(param.shape, meta, tp_size)
    return draw_rows(get_initializer(param), shape, seed, name, 0, shape[0] if shape else 0)


def _shard_rows(param: torch.Tensor, name: str, seed: int, tp_size: int, tp_rank: int, r0: int,
                r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` (dim 0) of this TP rank's piece of ``param``, drawing only the full rows they come from."""
    meta = param_meta.get_tp_meta(param)
    full = param_meta.full_shape(param.shape, meta, tp_size)
    init = get_initializer(param)
    dim = None if not meta.partitioned else meta.dim % len(full)
    if dim != 0:
        rows = draw_rows(init, full, seed, name, r0, r1)  # the piece has every full row
        return rows if dim is None else param_meta.shard(rows, meta, tp_size, tp_rank)
    out = torch.zeros([r1 - r0] + list(full[1:]), dtype=torch.float32)  # padded rows (vocabulary) stay zero
    for run in param_meta.piece_runs(meta, full[0], tp_size, tp_rank):
        a, z = max(r0, run.local_start), min(r1, run.local_start + run.length)
        if a < z and run.full_start is not None:
            lo = run.full_start + a - run.local_start
            draw_rows(init, full, seed, name, lo, lo + z - a, out=out[a - r0: z - r0])
    return out


def local_init_slice(param: torch.Tensor, name: str, seed: int, tp_size: int, tp_rank: int, start: int,
                     end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of this TP rank's flattened initial piece of ``param``, as a 1-D fp32 tensor.

    Equals ``local_init_tensor(...).reshape(-1)[start:end]`` but draws only
    the row blocks those elements come from.
    """
    shape = tuple(param.shape)
    if len(shape) < 2:
        return local_init_tensor(param, name, seed, tp_size, tp_rank).reshape(-1)[start:end]
    cols = math.prod(shape[1:])
    r0, r1 = start // cols, -(-end // cols)
    rows = _shard_rows(param, name, seed, tp_size, tp_rank, r0, r1)
    if tuple(rows.shape[1:]) != shape[1:]:
        raise ValueError(f"parameter {name}: piece rows have shape {tuple(rows.shape[1:])} but the parameter's "
                         f"rows are {shape[1:]}; its TP metadata does not match the TP size {tp_size}")
    return rows.reshape(-1)[start - r0 * cols: end - r0 * cols]


def local_init_tensor(param: torch.Tensor, name: str, seed: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's fp32 CPU piece of ``param``'s full initial tensor, shaped like ``param``."""
    full = full_init_tensor(param, name, seed, tp_size)
    piece = param_meta.shard(full, param_meta.get_tp_meta(param), tp_size, tp_rank)
    if tuple(piece.shape) != tuple(param.shape):
        raise ValueError(f"parameter {name}: initial piece has shape {tuple(piece.shape)} but the parameter is "
                         f"{tuple(param.shape)}; its TP metadata does not match the TP size {tp_size}")
    return piece


def _shared_parameters(module: nn.Module) -> List[Tuple[str, nn.Parameter, List[Tuple[nn.Module, str]]]]:
    """Each distinct parameter once, under its first name, with every (module, attribute) holding it."""
    owners: Dict[int, Tuple[str, nn.Parameter, List[Tuple[nn.Module, str]]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            full_name = f"{mod_name}.{attr}" if mod_name else attr
            entry = owners.setdefault(id(p), (full_name, p, []))
            entry[2].append((mod, attr))
    return list(owners.values())


@torch.no_grad()
def materialize(module: nn.Module, seed: int, topology: "Topology", device=None, dtype=None,
                prefix: str = "", only: Optional[Callable[[str], bool]] = None) -> nn.Module:
    """Give every parameter of ``module`` its layout-invariant initial value, in place.

    Parameters on the ``meta`` device are replaced by real ones on ``device``
    (default: ``topology.device``), keeping their TP metadata, initializer and
    ``requires_grad``, and every module sharing a parameter (tied weights)
    gets the same new one. Other parameters are overwritten in place.
    ``prefix`` is prepended to the parameter names that key the random
    streams (the name a parameter has inside its whole model); ``only``
    selects parameters by that full name. Returns ``module``.
    """
    tp_size, tp_rank = topology.tp_size, topology.tp_rank
    for name, param, holders in _shared_parameters(module):
        full_name = prefix + name
        if only is not None and not only(full_name):
            continue
        value = local_init_tensor(param, full_name, seed, tp_size, tp_rank)
        if param.is_meta:
            target_device = torch.device(device) if device is not None else topology.device
            new = nn.Parameter(value.to(device=target_device, dtype=dtype or param.dtype),
                               requires_grad=param.requires_grad)
            for key, attr_value in vars(param).items():
                if key.startswith("_hybrid_"):
                    setattr(new, key, attr_value)
            for mod, attr in holders:
                mod._parameters[attr] = new
        else:
            param.copy_(value)
    return module
