"""The pieces of one pre-LN decoder layer, built from tensor-parallel layers.

Activations are ``[s, b, h]`` (sequence first); under sequence parallelism
the activations between the TP blocks are ``[s/tp, b, h]``. Attention heads
and MLP columns are split over the ``"tp"`` ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.context_parallel import context_parallel_attention
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from hybrid.tensor_parallel.norms import LayerNorm, RMSNorm
from hybrid.tensor_parallel.random import RNGTracker, checkpoint
from model_zoo.config import GPTConfig
from model_zoo.document_attention import document_attention
from model_zoo.mlp import ParallelMLP, output_init  # noqa: F401 (importers read them here)
from model_zoo.moe import MoELayer
from model_zoo.qkv_layout import qkv_layout
from model_zoo.rope import Rope, apply_rope, rope_cos_sin, rope_inv_freq  # noqa: F401 (importers read them here)

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

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
    common = dict(eps=config.norm_eps, sequence_parallel=sp, per_head=per_head,
                  zero_centered=config.apply_layernorm_1p, device=device, dtype=dtype)
    if config.norm == "rmsnorm":
        return RMSNorm(size, topology, **common)
    return LayerNorm(size, topology, bias=config.bias, **common)


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
        # context parallelism: attention over the sequence split across the "cp" ranks (hybrid.context_parallel)
        self.topology, self.cp_comm_type = topology, config.cp_comm_type
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

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q ``[b, heads/tp, s, d]``, k and v ``[b, groups, s, d]`` -> ``[b, heads/tp, s, d]``; causal, and inside
        each packed document when ``document_ids`` ``[b, s]`` is given (:mod:`model_zoo.document_attention`);
        dropout from the per-TP-rank stream."""
        p = self.attention_dropout if self.training else 0.0
        gqa = {"enable_gqa": True} if self.local_groups != self.local_heads else {}
        if self.topology.cp_size > 1:
            return context_parallel_attention(q, k, v, self.topology, self.cp_comm_type, document_ids)
        if document_ids is not None:
            return document_attention(q, k, v, document_ids, dropout_p=p, tracker=self.tracker, **gqa)
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        with self.tracker.fork("tp", q.device):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **gqa)

    def forward(self, x: torch.Tensor, rope: Rope = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
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
            ctx = checkpoint(self._core, q, k, v, document_ids, tracker=self.tracker)
        else:
            ctx = self._core(q, k, v, document_ids)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * d)
        return self.out_proj(ctx)


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
            self.mlp = MoELayer(config, topology, tracker, moe_aux_scale, output_init(config), device, dtype)
        else:
            self.mlp = ParallelMLP(config, topology, device, dtype)
        self.hidden_dropout = config.hidden_dropout
        self.tracker = tracker
        self.dropout_stream = "tp" if config.sequence_parallel else "shared"

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, self.tracker, self.dropout_stream)

    def forward(self, x: torch.Tensor, rope: Rope = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self._drop(self.attention(self.input_norm(x), rope, document_ids))
        return x + self._drop(self.mlp(self.post_attention_norm(x)))
