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
from model_zoo.qkv_layout import qkv_layout

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]


# ---- rotary positions (the Llama convention: rotate halves, not interleaved pairs) ---------
def rope_inv_freq(config: GPTConfig, device=None) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies ``theta^(-2i/d)`` (fp32), scaled as ``config.rope_scaling`` says.

    ``linear``: all divided by ``rope_scaling_factor``. ``llama3`` (the Llama 3.1
    rule): with wavelength ``w = 2 pi / f`` and ``L = rope_original_max_positions``,
    frequencies with ``w > L / low_freq_factor`` are divided by the factor,
    those with ``w < L / high_freq_factor`` kept, and those between blended:
    ``(1 - a) f / factor + a f`` with ``a = (L / w - low) / (high - low)``.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
    factor = config.rope_scaling_factor
    if config.rope_scaling == "linear":
        return inv_freq / factor
    if config.rope_scaling == "llama3":
        low, high, context = config.rope_low_freq_factor, config.rope_high_freq_factor, \
            config.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        blend = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
        return (1 - blend) * inv_freq / factor + blend * inv_freq
    return inv_freq


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> Tuple[
        torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[b, 1, s, head_dim]`` for ``position_ids`` ``[b, s]``, computed in fp32."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
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


def make_norm(config: GPTConfig, topology: "Topology", device, dtype, per_head: bool = False) -> nn.Module:
    """The config's norm over the hidden size ``[s(/tp), b, h]``, or with ``per_head`` over the head dim of this
    rank's query or key heads ``[..., d]``."""
    size, sp = (config.head_dim, False) if per_head else (config.hidden_size, config.sequence_parallel)
    if config.norm == "rmsnorm":
        return RMSNorm(size, topology, eps=config.norm_eps, sequence_parallel=sp, per_head=per_head, device=device,
                       dtype=dtype)
    return LayerNorm(size, topology, eps=config.norm_eps, bias=config.bias, sequence_parallel=sp,
                     per_head=per_head, device=device, dtype=dtype)


def output_init(config: GPTConfig) -> tp_init.Initializer:
    """Projections that write into the residual stream get a depth-scaled std when configured."""
    std = config.init_std / math.sqrt(2.0 * config.num_layers) if config.scaled_output_init else config.init_std
    return tp_init.normal(std)


# ---- attention ---------------------------------------------------------------------------------
class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over ``"tp"``; grouped-query when ``num_query_groups < num_heads``.

    ``qkv_proj``: column-parallel, full layout ``[q; k; v]`` as
    :mod:`model_zoo.qkv_layout` defines it (``[nh/tp + 2 max(1, ng/tp)] d``
    rows per rank; key/value heads replicated over ``tp/ng`` ranks when
    ``tp > ng``, their gradients summed over those ranks). ``out_proj``:
    row-parallel ``[h, nh d/tp]`` (``nh d`` is ``h`` unless ``kv_channels``
    sets ``d``). With ``qk_norm``, ``q_norm`` and ``k_norm`` (weights ``[d]``,
    replicated; gradients all-reduced over ``"tp"``) normalise each query and
    key head before RoPE. Input and output ``[s(/tp), b, h]``.
    """

    def __init__(self, config: GPTConfig, topology: "Topology", tracker: RNGTracker, device=None, dtype=None):
        super().__init__()
        h, tp = config.hidden_size, topology.tp_size
        layout = qkv_layout(config)
        self.local_heads, self.local_groups = layout.local_heads(tp)
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        self.selective_recompute = config.recompute == "selective"
        self.tracker = tracker
        sp = config.sequence_parallel
        self.qkv_proj = ColumnParallelLinear(h, layout.out_features, topology, bias=config.attention_bias,
                                             sequence_parallel=sp, **layout.tp_split(),
                                             weight_init=tp_init.normal(config.init_std), device=device,
                                             dtype=dtype)
        self.out_proj = RowParallelLinear(config.attention_width, h, topology, bias=config.bias, input_is_parallel=True,
                                          sequence_parallel=sp, weight_init=output_init(config), device=device,
                                          dtype=dtype)
        if config.qk_norm:
            self.q_norm = make_norm(config, topology, device, dtype, per_head=True)
            self.k_norm = make_norm(config, topology, device, dtype, per_head=True)
        else:
            self.q_norm = self.k_norm = None

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[b, heads/tp, s, d]``, k and v ``[b, groups, s, d]`` -> ``[b, heads/tp, s, d]``;
        dropout from the per-TP-rank stream."""
        p = self.attention_dropout if self.training else 0.0
        gqa = {"enable_gqa": True} if self.local_groups != self.local_heads else {}
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        with self.tracker.fork("tp", q.device):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **gqa)

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [s, b, (heads/tp + 2 groups) * d], the whole sequence even under SP
        s, b = qkv.shape[0], qkv.shape[1]
        d = self.head_dim
        q, k, v = (t.view(s, b, -1, d) for t in qkv.split(
            [self.local_heads * d, self.local_groups * d, self.local_groups * d], dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.selective_recompute:
            ctx = checkpoint(self._core, q, k, v, tracker=self.tracker)
        else:
            ctx = self._core(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * d)
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


# ---- one layer ------------------------------------------------------------------------------------
class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``; ``mlp`` is an MoE layer
    (:class:`model_zoo.moe.MoELayer`) when ``moe_aux_scale`` (the model's balancing-loss scale) is given.

    Input and output ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence
    parallelism (the residual stream is then sharded and its dropout draws
    from the per-TP-rank stream; otherwise from the shared stream).
    """

    def __init__(self, config: GPTConfig, topology: "Topology", tracker: RNGTracker, device=None, dtype=None,
                 moe_aux_scale=None):
        super().__init__()
        self.input_norm = make_norm(config, topology, device, dtype)
        self.attention = ParallelAttention(config, topology, tracker, device, dtype)
        self.post_attention_norm = make_norm(config, topology, device, dtype)
        if moe_aux_scale is not None:  # an MoE layer (model_zoo.moe) in place of the MLP
            from model_zoo.moe import MoELayer
            self.mlp = MoELayer(config, topology, tracker, moe_aux_scale, output_init(config), device, dtype)
        else:
            self.mlp = ParallelMLP(config, topology, device, dtype)
        self.hidden_dropout = config.hidden_dropout
        self.tracker = tracker
        self.dropout_stream = "tp" if config.sequence_parallel else "shared"

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, self.tracker, self.dropout_stream)

    def forward(self, x: torch.Tensor, rope: Rope = None) -> torch.Tensor:
        x = x + self._drop(self.attention(self.input_norm(x), rope))
        return x + self._drop(self.mlp(self.post_attention_norm(x)))
