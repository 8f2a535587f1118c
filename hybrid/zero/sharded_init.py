"""Sharded deferred initialization: a rank builds only its own TP and ZeRO-3 slice of a huge model.

The model is constructed on the ``meta`` device (shapes and metadata, no
memory). :func:`zero3_from_meta` then builds the stage-3 optimizer with each
rank filling only its partition: for every piece of every parameter that
falls in this rank's chunk, :func:`hybrid.tensor_parallel.init.local_init_slice`
draws just the row blocks of the full tensor that piece comes from. Peak
memory is the partition plus the rows of one parameter piece, never a whole
layer of the full model.

Initialization stays layout-invariant: every value is the one
``(seed, parameter name)`` gives at TP=1 and ZeRO-0, so the gathered model
equals ``GPTModel(config, Topology.local(), seed=seed)``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from hybrid.config.schema import OptimizerConfig, ZeroConfig
from hybrid.layout import stage_traits
from hybrid.tensor_parallel import init as tp_init
from hybrid.zero.flat_buffer import ZeroConfigError
from hybrid.zero.stage3_layout import Unit


def stub_meta_parameters(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every ``meta`` parameter by a real one of the same shape that holds one element (stride 0).

    The stub keeps the parameter's attributes (TP metadata, initializer) and
    ``requires_grad``, and every module sharing it gets the same new
    parameter. Stage 3 then rebinds each parameter to its gathered storage.
    Frozen meta parameters are materialised whole instead (they are not
    partitioned). Returns how many parameters were stubbed.
    """
    owners = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None and p.is_meta:
                owners.setdefault(id(p), (p, []))[1].append((mod, attr))
    for p, holders in owners.values():
        if not p.requires_grad:
            raise ValueError("a frozen parameter is still on the meta device; materialise frozen parameters "
                             "(model.materialize(only=...)) before building a sharded ZeRO-3 optimizer")
        data = torch.zeros(1, dtype=dtype, device=device).expand(p.shape)
        new = nn.Parameter(data, requires_grad=True)
        for key, value in vars(p).items():
            if key.startswith("_hybrid_"):
                setattr(new, key, value)
        for mod, attr in holders:
            mod._parameters[attr] = new
    return len(owners)


@torch.no_grad()
def init_partition(units: List[Unit], partition: torch.Tensor, seed: int, tp_size: int, tp_rank: int,
                   dp_rank: int) -> None:
    """Fill ``partition`` ([partition_numel]) with DP rank ``dp_rank``'s chunks of every unit's initial values.

    Padding is zero. Each parameter's piece is drawn with
    :func:`~hybrid.tensor_parallel.init.local_init_slice` (only its rows).
    """
    partition.zero_()
    for u in units:
        base = u.partition_offset
        for r, start, end, chunk_offset in u.pieces(dp_rank):
            rec, p = u.records[r], u.params[r]
            values = tp_init.local_init_slice(p, rec.name, seed, tp_size, tp_rank, start, end)
            partition[base + chunk_offset: base + chunk_offset + (end - start)].copy_(values)


def zero3_from_meta(model: nn.Module, topology, seed: int, zero: ZeroConfig, optimizer: Optional[OptimizerConfig] = None,
                    *, dtype: torch.dtype = torch.float32, **runtime):
    """A ZeRO optimizer for ``model`` built on ``meta``, each rank materialising only its slice.

    ``zero`` must ask for a stage that partitions the parameters (the whole
    model never exists on one rank). ``seed`` is the model's init seed
    (``GPTModel(..., seed=...)``); ``runtime`` goes to
    :func:`~hybrid.zero.build_zero_optimizer`. No DP broadcast is needed:
    every rank computes its own slice from ``(seed, name)``.
    """
    from hybrid.zero.factory import build_zero_optimizer

    if not stage_traits(zero.stage).parameters:
        raise ZeroConfigError(f"zero.stage={zero.stage} keeps whole parameters on every rank; sharded "
                              f"initialisation from the meta device needs a stage that partitions them")
    stub_meta_parameters(model, topology.device, dtype)

    def fill(units, partition, topo):
        init_partition(units, partition, seed, topo.tp_size, topo.tp_rank, topo.dp_rank)

    return build_zero_optimizer(model, topology, zero, optimizer, partition_init=fill, **runtime)
