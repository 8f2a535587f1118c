"""Layout-invariant parameter initialization.

Each parameter's full (TP=1, unpadded) tensor is a pure function of
``(seed, parameter name)``: it is drawn on the CPU in fp32 from a
``torch.Generator`` seeded with a stable hash of ``f"{seed}:{name}"`` and then
cut to this TP rank's piece with :func:`hybrid.param_meta.shard`. The same
seed therefore gives the same full model at any TP size.

Each parameter records *how* it is initialized (an :class:`Initializer`), so a
model built on the ``meta`` device can be materialized later, one parameter at
a time (:func:`materialize`, :func:`local_init_tensor`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from hybrid import param_meta

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

_ATTR = "_hybrid_init"
_KINDS = ("normal", "zeros", "ones")


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


def full_init_tensor(param: torch.Tensor, name: str, seed: int, tp_size: int) -> torch.Tensor:
    """The logical full (TP=1, unpadded) fp32 CPU tensor of ``param`` (any device, including meta)."""
    meta = param_meta.get_tp_meta(param)
    shape = param_meta.full_shape(param.shape, meta, tp_size)
    generator = torch.Generator(device="cpu").manual_seed(seed_for(seed, name))
    return get_initializer(param).draw(shape, generator)


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
