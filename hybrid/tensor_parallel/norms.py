"""LayerNorm and RMSNorm modules that know about sequence parallelism.

Norm parameters are replicated over the TP group. Without sequence
parallelism every TP rank normalises the same full activations, so each
rank's weight gradient is already the full one. Under sequence parallelism
each rank normalises only its sequence shard ``[s/tp, b, h]``, and a
per-head norm (``per_head=True``: the query/key norms over the head dim
``d``) only this rank's heads; either way its weight gradient is partial,
and the weights then pass through
:func:`~hybrid.tensor_parallel.mappings.copy_to_tp_region`, whose backward
all-reduces their gradient over ``"tp"``. Every TP rank ends with the same
full gradient.

The arithmetic is :mod:`hybrid.kernels` (fused CUDA kernels where they
apply, torch otherwise). RMSNorm follows the Llama definition: normalise in
fp32, cast back to the input dtype, then multiply by the weight.

With ``zero_centered`` (the model's ``apply_layernorm_1p``, Megatron's
zero-centred gamma) the stored weight is ``gamma - 1``, initialised to
zeros, and the norm scales by ``1 + weight``: the sum is formed here, before
the arithmetic, so the fused kernels and the torch path see the same
``gamma`` and the weight's gradient is the one of ``gamma``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from hybrid import kernels, param_meta
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.mappings import copy_to_tp_region

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dim. ``x`` ``[..., h]``, ``weight``/``bias`` ``[h]``."""
    return kernels.layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back before the weight multiply."""
    return kernels.rms_norm(x, weight, eps)


class _TPNorm(nn.Module):
    def __init__(self, hidden_size: int, topology: "Topology", eps: float, sequence_parallel: bool,
                 bias: bool, per_head: bool, zero_centered: bool, device, dtype):
        super().__init__()
        self.topology = topology
        self.hidden_size, self.eps, self.sequence_parallel = hidden_size, eps, sequence_parallel
        self.per_head, self.zero_centered = per_head, zero_centered
        # each TP rank sees part of what the weights multiply: their gradient is summed over "tp"
        self.partial_input = (sequence_parallel or per_head) and topology.tp_size > 1
        self.weight = self._param(hidden_size, tp_init.ZEROS if zero_centered else tp_init.ONES, device, dtype)
        self.bias = self._param(hidden_size, tp_init.ZEROS, device, dtype) if bias else None

    @staticmethod
    def _param(n, init, device, dtype) -> nn.Parameter:
        p = nn.Parameter(torch.empty(n, device=device, dtype=dtype))
        param_meta.set_tp_meta(p)  # replicated
        tp_init.set_initializer(p, init)
        return p

    def _shared(self, p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if p is None or not self.partial_input:
            return p
        return copy_to_tp_region(p, self.topology)

    def gamma(self) -> torch.Tensor:
        """The scale ``[h]`` the norm multiplies by: ``1 + weight`` when zero-centred, else ``weight``."""
        w = self._shared(self.weight)
        return w + 1 if self.zero_centered else w

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, sp={self.sequence_parallel}, per_head={self.per_head}"
                + (", zero_centered=True" if self.zero_centered else ""))


class LayerNorm(_TPNorm):
    """LayerNorm with replicated ``weight``/``bias`` ``[h]``; input ``[s(/tp), b, h]``, or ``[..., d]`` with
    ``per_head`` (this rank's heads)."""

    def __init__(self, hidden_size: int, topology: "Topology", *, eps: float = 1e-5,
                 sequence_parallel: bool = False, bias: bool = True, per_head: bool = False,
                 zero_centered: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, topology, eps, sequence_parallel, bias, per_head, zero_centered, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.gamma(), self._shared(self.bias), self.eps)


class RMSNorm(_TPNorm):
    """RMSNorm with a replicated ``weight`` ``[h]``; input ``[s(/tp), b, h]``, or ``[..., d]`` with ``per_head``
    (this rank's heads)."""

    def __init__(self, hidden_size: int, topology: "Topology", *, eps: float = 1e-6,
                 sequence_parallel: bool = False, per_head: bool = False, zero_centered: bool = False, device=None,
                 dtype=None):
        super().__init__(hidden_size, topology, eps, sequence_parallel, False, per_head, zero_centered, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.gamma(), self.eps)
