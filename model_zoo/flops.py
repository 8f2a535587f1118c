"""Parameter counts and model FLOPs per token (for MFU).

Counts use the logical vocabulary (no TP padding): padded rows are storage,
not model. Model FLOPs per token, forward plus backward::

    flops_per_token = 6 * N_matmul + 12 * L * s * a * d

* ``N_matmul`` is every weight that multiplies an activation: per layer the
  q/k/v projection (``h (a d + 2 g d)`` with ``a`` query heads and ``g``
  key/value groups of head dim ``d``; ``3 h^2`` without grouping, where
  ``a d = h``), the output projection (``a d h``) and the MLP (``2 h f`` for GELU,
  ``3 h f`` for SwiGLU), plus the LM head ``V h`` once (tied or not). Input
  embedding lookups, position tables, norms and biases do no matmul and are
  left out. A matmul with ``n`` weights costs ``2n`` FLOPs per token forward
  and ``4n`` backward (input and weight gradients): ``6n``.
* The attention term: per layer ``q k^T`` and ``p v`` cost ``2 s a d`` FLOPs
  each per token forward (full ``s x s`` scores, as the kernels compute them),
  so ``4 s a d`` forward and ``12 s a d`` forward plus backward (``a d = h``
  unless ``kv_channels`` sets the head dim).

Activation recomputation adds work but not model FLOPs, so it is not counted.

**Mixture of Experts** (``docs/moe.md``). On the layers of
``config.moe_layer_pattern()`` the MLP is replaced by the MoE layer:

* router ``[E, h]`` (no bias);
* ``E`` routed experts, each ``b f' h + f' h`` (``b`` = 2 for SwiGLU,
  ``f'`` = ``expert_ffn_size``), with biases ``b f' + h`` when ``config.bias``;
* the shared expert, a dense MLP of width ``fs``
  (``moe_shared_expert_intermediate_size``): ``b fs h + fs h`` (biases as above),
  and its sigmoid gate ``[1, h]`` (``moe_shared_expert_gate``).

:func:`count_parameters` counts every expert (the model's size);
:func:`active_parameters` those one token passes through: ``k`` of the ``E``
routed experts (``moe_router_topk``), the rest unchanged. FLOPs use the active
weights: ``N_matmul`` counts the router, ``k`` experts, the shared expert and
its gate (:func:`moe_layer_parameters` is the one statement of these sizes).
"""

from __future__ import annotations

import math
from typing import Optional

from torch import nn

from hybrid import param_meta
from model_zoo.config import GPTConfig
from model_zoo.qkv_layout import qkv_layout


def mlp_parameters(config: GPTConfig, width: int, with_bias: bool = True) -> int:
    """Parameters of one MLP of hidden ``width``: input projection ``[blocks * width, h]`` (SwiGLU: 2 blocks,
    gate and up), output projection ``[h, width]``, and their biases when ``config.bias`` (``with_bias``)."""
    h, blocks = config.hidden_size, config.mlp_input_blocks
    bias = blocks * width + h if config.bias and with_bias else 0
    return (blocks + 1) * width * h + bias


def moe_layer_parameters(config: GPTConfig, with_bias: bool = True) -> dict:
    """The parameters of one MoE layer by part (0 for a dense model): ``router`` ``E h``, ``expert`` one routed
    expert (:func:`mlp_parameters` of ``expert_ffn_size``), ``experts`` all ``E`` of them, ``active_experts``
    the ``k`` each token passes through, ``shared`` the shared expert with its gate. ``with_bias``: count the
    biases (False: the matmul weights only)."""
    if not config.is_moe:
        return {"router": 0, "expert": 0, "experts": 0, "active_experts": 0, "shared": 0}
    h, E, k = config.hidden_size, config.num_experts, config.moe_router_topk
    expert = mlp_parameters(config, config.expert_ffn_size, with_bias)
    fs = config.moe_shared_expert_intermediate_size
    shared = mlp_parameters(config, fs, with_bias) if fs else 0
    shared += h if config.moe_shared_expert_gate else 0
    return {"router": E * h, "expert": expert, "experts": E * expert, "active_experts": k * expert,
            "shared": shared}


def moe_layers(config: GPTConfig) -> int:
    """How many layers are MoE layers (``config.moe_layer_pattern()``; 0 for a dense model)."""
    return sum(config.moe_layer_pattern())


def expert_parameters(config: GPTConfig) -> int:
    """Parameters of every routed expert of the model: what expert parallelism shares out over ``ep``."""
    return moe_layers(config) * moe_layer_parameters(config)["experts"]


def count_parameters(config: GPTConfig) -> int:
    """Total parameters of the TP=1 model with the logical vocabulary (tied weights counted once); an MoE
    model's with every expert."""
    return _parameters(config, active=False)


def active_parameters(config: GPTConfig) -> int:
    """Parameters one token passes through: :func:`count_parameters` with ``k`` of the ``E`` routed experts of
    each MoE layer (the same as :func:`count_parameters` for a dense model)."""
    return _parameters(config, active=True)


def _parameters(config: GPTConfig, active: bool) -> int:
    h, f, L, V = config.hidden_size, config.ffn_size, config.num_layers, config.vocab_size
    b = 1 if config.bias else 0
    qkv = qkv_layout(config).out_features
    with_bias = 2 if config.norm == "layernorm" and config.bias else 1
    norm = with_bias * h
    qk_norms = 2 * with_bias * config.head_dim if config.qk_norm else 0
    mlp_in = config.mlp_input_size
    attention = (2 * norm + qk_norms
                 + qkv * h + (qkv if config.attention_bias else 0) + config.attention_width * h + b * h)
    mlp = mlp_in * h + b * mlp_in + f * h + b * h
    moe = moe_layer_parameters(config)
    moe_mlp = moe["router"] + moe["active_experts" if active else "experts"] + moe["shared"]
    total = V * h + L * attention + norm + sum(moe_mlp if is_moe else mlp for is_moe in config.moe_layer_pattern())
    if config.position == "learned":
        total += config.num_positions * h
    if not config.tie_embeddings:
        total += V * h
    return total


def matmul_parameters(config: GPTConfig) -> int:
    """``N_matmul``: weights that take part in matmuls, the LM head counted once; on MoE layers the router,
    the ``k`` routed experts a token passes through, the shared expert and its gate (the active weights)."""
    h, f, L, V = config.hidden_size, config.ffn_size, config.num_layers, config.vocab_size
    mlp = (config.mlp_input_size + f) * h  # input and output projections
    moe = moe_layer_parameters(config, with_bias=False)
    moe_mlp = moe["router"] + moe["active_experts"] + moe["shared"]
    mlps = sum(moe_mlp if is_moe else mlp for is_moe in config.moe_layer_pattern())
    return L * (qkv_layout(config).out_features + config.attention_width) * h + mlps + V * h


def flops_per_token(config: GPTConfig, seq_length: Optional[int] = None) -> int:
    """Model FLOPs per token for one forward and backward pass at ``seq_length`` (default the config's)."""
    s = config.seq_length if seq_length is None else seq_length
    return 6 * matmul_parameters(config) + 12 * config.num_layers * s * config.attention_width


def count_model_parameters(module: nn.Module, tp_size: int) -> int:
    """Logical full (TP=1, unpadded) parameter count of a built model, from its parameters' TP metadata.

    Works on the ``meta`` device. Shared (tied) parameters count once.
    """
    total = 0
    for p in module.parameters():
        total += math.prod(param_meta.full_shape(p.shape, param_meta.get_tp_meta(p), tp_size))
    return total
