"""Reassemble full (TP=1) tensors from the TP ranks' pieces, for tests, export and inspection."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

import torch
from torch import nn

from hybrid import param_meta

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


def gather_pieces(tensor: torch.Tensor, topology: "Topology") -> List[torch.Tensor]:
    """Every TP rank's copy of ``tensor`` (same shape on every rank), in TP-rank order.

    An all-gather over ``"tp"``; every rank of the group must call it.
    """
    tensor = tensor.detach().contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(topology.tp_size)]
    topology.comm.all_gather(pieces, tensor, "tp")
    return pieces


def gather_full(tensor: torch.Tensor, meta: param_meta.TPMeta, topology: "Topology") -> torch.Tensor:
    """The logical full tensor of a TP-partitioned ``tensor`` laid out by ``meta``.

    For a replicated ``meta`` this rank's copy is returned. Collective over ``"tp"``
    for partitioned tensors.
    """
    if not meta.partitioned or topology.tp_size == 1:
        return param_meta.merge([tensor.detach()], meta) if meta.partitioned else tensor.detach().clone()
    return param_meta.merge(gather_pieces(tensor, topology), meta)


def full_state(module: nn.Module, topology: "Topology", grads: bool = False) -> Dict[str, torch.Tensor]:
    """``{name: full tensor}`` of every parameter (or its gradient) of ``module``, in named order.

    Parameters without a gradient are skipped when ``grads``. Collective over ``"tp"``.
    """
    out: Dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = gather_full(t, param_meta.get_tp_meta(p), topology)
    return out
