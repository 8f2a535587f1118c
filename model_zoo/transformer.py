"""The pieces of one pre-LN decoder layer, built from tensor-parallel layers.

Activations are ``[s, b, h]`` (sequence first); under sequence parallelism
the activations between the TP blocks are ``[s/tp, b, h]``. Attention heads
and MLP columns are split over the ``"tp"`` ranks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from hybrid.tensor_parallel.norms import LayerNorm, RMSNorm
from hybrid.tensor_parallel.random import RNGTracker, checkpoint
from model_zoo.config import GPTConfig

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]


# ---- rotary positions (the Llama convention: rotate halves, not interleaved pairs) ---------
def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> Tuple[
        torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[b, 1, s, head_dim]`` for ``position_ids`` ``[b, s]``, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device)
                                / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, d]`` by the angles in ``cos``/``sin`` ``[b, 1, s, d]``."""
    return x * cos + _rotate_half(x) * sin


# ---- shared helpers --------------------------------------------------------------------------
def dropout(x: torch.Tensor, p: float, training: bool, tracker: RNGTracker, stream: str) -> torch.Tensor:
    """Dropout drawing from ``tracker``'s ``stream``; the identity when off."""
    if p == 0.0 or not training:
        return x
    with tracker.fork(stream, x.device):
        return F.dropout(x, p, training=True)


def make_norm(config: GPTConfig, topology: "Topology", device, dtype) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden_size, topology, eps=config.norm_eps,
                       sequence_parallel=config.sequence_parallel, device=device, dtype=dtype)
    return LayerNorm(config.hidden_size, topology, eps=config.norm_eps, bias=config.bias,
                     sequence_parallel=config.sequence_parallel, device=device, dtype=dtype)


def output_init(config: GPTConfig) -> tp_init.Initializer:
    """Projections that write into the residual stream get a depth-scaled std when configured."""
    std = config.init_std / math.sqrt(2.0 * config.num_layers) if config.scaled_output_init else config.init_std
    return tp_init.normal(std)


# ---- attention ---------------------------------------------------------------------------------
class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over ``"tp"``.

    ``qkv_proj``: column-parallel ``[3h/tp, h]``, full layout ``[q; k; v]``
    (stride 3, heads contiguous inside each). ``out_proj``: row-parallel
    ``[h, h/tp]``. Input and output ``[s(/tp), b, h]``.
    """

    def __init__(self, config: GPTConfig, topology: "Topology", tracker: RNGTracker, device=None, dtype=None):
        super().__init__()
        h, tp = config.hidden_size, topology.tp_size
        self.local_heads = config.num_heads // tp
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.selective_recompute = config.recompute == "selective"
        self.tracker = tracker
        sp = config.sequence_parallel
        self.qkv_proj = ColumnParallelLinear(h, 3 * h, topology, bias=config.bias, sequence_parallel=sp, stride=3,
                                             weight_init=tp_init.normal(config.init_std), device=device,
                                             dtype=dtype)
        self.out_proj = RowParallelLinear(h, h, topology, bias=config.bias, input_is_parallel=True,
                                          sequence_parallel=sp, weight_init=output_init(config), device=device,
                                          dtype=dtype)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, heads/tp, s, d]`` x3 -> ``[b, heads/tp, s, d]``; dropout from the per-TP-rank stream."""
        p = self.attention_dropout if self.training else 0.0
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with self.tracker.fork("tp", q.device):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [s, b, 3 * heads/tp * d], the whole sequence even under SP
        s, b = qkv.shape[0], qkv.shape[1]
        q, k, v = (t.view(s, b, self.local_heads, self.head_dim).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.selective_recompute:
            ctx = checkpoint(self._core, q, k, v, tracker=self.tracker)
        else:
            ctx = self._core(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.out_proj(ctx)


# ---- MLP ------------------------------------------------------------------------------------------
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
        self.in_proj = ColumnParallelLinear(h, 2 * f if self.swiglu else f, topology, bias=config.bias,
                                            sequence_parallel=sp, stride=2 if self.swiglu else 1,
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


# ---- one layer ------------------------------------------------------------------------------------
class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``.

    Input and output ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence
    parallelism (the residual stream is then sharded and its dropout draws
    from the per-TP-rank stream; otherwise from the shared stream).
    """

    def __init__(self, config: GPTConfig, topology: "Topology", tracker: RNGTracker, device=None, dtype=None):
        super().__init__()
        self.input_norm = make_norm(config, topology, device, dtype)
        self.attention = ParallelAttention(config, topology, tracker, device, dtype)
        self.post_attention_norm = make_norm(config, topology, device, dtype)
        self.mlp = ParallelMLP(config, topology, device, dtype)
        self.hidden_dropout = config.hidden_dropout
        self.tracker = tracker
        self.dropout_stream = "tp" if config.sequence_parallel else "shared"

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, self.tracker, self.dropout_stream)

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        x = x + self._drop(self.attention(self.input_norm(x), rope))
        return x + self._drop(self.mlp(self.post_attention_norm(x)))
