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
"""

from __future__ import annotations

import math
from typing import Optional

from torch import nn

from hybrid import param_meta
from model_zoo.config import GPTConfig
from model_zoo.qkv_layout import qkv_layout


def count_parameters(config: GPTConfig) -> int:
    """Total parameters of the TP=1 model with the logical vocabulary (tied weights counted once)."""
    h, f, L, V = config.hidden_size, config.ffn_size, config.num_layers, config.vocab_size
    b = 1 if config.bias else 0
    qkv = qkv_layout(config).out_features
    with_bias = 2 if config.norm == "layernorm" and config.bias else 1
    norm = with_bias * h
    qk_norms = 2 * with_bias * config.head_dim if config.qk_norm else 0
    mlp_in = config.mlp_input_size
    per_layer = (2 * norm + qk_norms
                 + qkv * h + (qkv if config.attention_bias else 0) + config.attention_width * h + b * h  # attention
                 + mlp_in * h + b * mlp_in + f * h + b * h)  # MLP
    total = V * h + L * per_layer + norm
    if config.position == "learned":
        total += config.num_positions * h
    if not config.tie_embeddings:
        total += V * h
    return total


def matmul_parameters(config: GPTConfig) -> int:
    """``N_matmul``: weights that take part in matmuls, the LM head counted once."""
    h, f, L, V = config.hidden_size, config.ffn_size, config.num_layers, config.vocab_size
    mlp = (config.mlp_input_size + f) * h  # input and output projections
    return L * ((qkv_layout(config).out_features + config.attention_width) * h + mlp) + V * h


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
