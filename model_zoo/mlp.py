"""The dense MLP of a decoder layer (and an MoE layer's shared expert), built from tensor-parallel layers."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from model_zoo.config import GPTConfig

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


def output_init(config: GPTConfig) -> tp_init.Initializer:
    """Projections that write into the residual stream get a depth-scaled std when configured."""
    std = config.init_std / math.sqrt(2.0 * config.num_layers) if config.scaled_output_init else config.init_std
    return tp_init.normal(std)


class ParallelMLP(nn.Module):
    """GELU (tanh) or SwiGLU MLP with the hidden columns split over ``"tp"``.

    ``in_proj``: column-parallel ``[f/tp, h]`` (GELU) or ``[2f/tp, h]`` with
    full layout ``[gate; up]`` (SwiGLU, stride 2). ``out_proj``:
    row-parallel ``[h, f/tp]``. Input and output ``[s(/tp), b, h]``.
    """

    def __init__(self, config: GPTConfig, topology: "Topology", device=None, dtype=None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_size
        self.swiglu = config.mlp == "swiglu"
        sp = config.sequence_parallel
        self.in_proj = ColumnParallelLinear(h, config.mlp_input_size, topology, bias=config.bias,
                                            sequence_parallel=sp, stride=config.mlp_input_blocks,
                                            weight_init=tp_init.normal(config.init_std), device=device,
                                            dtype=dtype)
        self.out_proj = RowParallelLinear(f, h, topology, bias=config.bias, input_is_parallel=True,
                                          sequence_parallel=sp, weight_init=output_init(config), device=device,
                                          dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.in_proj(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return self.out_proj(y)


