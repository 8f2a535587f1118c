"""The model_zoo GPT that a config's ``model`` section describes."""

from __future__ import annotations

import re
from typing import Any, Dict, List

from hybrid.config import HybridConfig

# model section key -> GPTConfig field, for the shape settings that override a preset when given.
_SHAPE_KEYS = (("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("num_attention_heads", "num_heads"),
               ("num_query_groups", "num_query_groups"), ("kv_channels", "kv_channels"),
               ("ffn_hidden_size", "ffn_hidden_size"), ("seq_length", "seq_length"),
               ("max_position_embeddings", "max_position_embeddings"), ("position_embedding_type", "position"),
               ("normalization", "norm"), ("hidden_dropout", "hidden_dropout"),
               ("attention_dropout", "attention_dropout"), ("init_method_std", "init_std"),
               ("norm_epsilon", "norm_eps"), ("rotary_base", "rope_theta"), ("rope_scaling", "rope_scaling"),
               ("rope_scaling_factor", "rope_scaling_factor"), ("rope_low_freq_factor", "rope_low_freq_factor"),
               ("rope_high_freq_factor", "rope_high_freq_factor"),
               ("rope_original_max_positions", "rope_original_max_positions"))

# model_zoo's choices whose names Megatron-LM writes otherwise: in any case (--normalization RMSNorm), and
# --position-embedding-type learned_absolute for model_zoo's learned
_ANY_CASE = ("norm", "position")
_MEGATRON_NAMES = {"learned_absolute": "learned"}


def _model_zoo_value(gpt_key: str, value: Any) -> Any:
    if gpt_key not in _ANY_CASE:
        return value
    value = str(value).lower()
    return _MEGATRON_NAMES.get(value, value)


def keys_named_in(message: str) -> List[str]:
    """The config keys whose GPTConfig fields ``message`` (a GPTConfig.validate error) names, in the order it
    names them (``tp``: validate's tensor-parallel size): so that the trainer's error can end with their flags."""
    by_gpt_name = {gpt_key: f"model.{key}" for key, gpt_key in _SHAPE_KEYS + (("vocab_size", "vocab_size"),)}
    by_gpt_name["tp"] = "tensor_parallel_size"
    named = []
    for word in re.findall(r"[a-z_]+", message):
        key = by_gpt_name.get(word)
        if key is not None and key not in named:
            named.append(key)
    return named


def model_config(config: HybridConfig, vocab_size: int):
    """The :class:`model_zoo.GPTConfig` of ``config`` for a tokenizer of ``vocab_size`` (not yet validated)."""
    from model_zoo.config import GPTConfig
    from model_zoo.presets import get_preset

    m = config.model
    if m.preset is not None:
        cfg = get_preset(m.preset)
    else:
        cfg = GPTConfig(vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                        num_heads=m.num_attention_heads, seq_length=m.seq_length)
    changes: Dict[str, Any] = {}
    if m.vocab_size is not None or config.data.tokenizer.given or m.preset is None:
        changes["vocab_size"] = vocab_size
    for key, gpt_key in _SHAPE_KEYS:
        if getattr(m, key) is not None:
            changes[gpt_key] = _model_zoo_value(gpt_key, getattr(m, key))
    if m.swiglu:
        changes["mlp"] = "swiglu"
    if m.disable_bias_linear:
        changes["bias"] = False
    if m.add_qkv_bias:
        changes["qkv_bias"] = True
    if m.qk_layernorm:
        changes["qk_norm"] = True
    if m.untie_embeddings_and_output_weights:
        changes["tie_embeddings"] = False
    changes["sequence_parallel"] = m.sequence_parallel
    changes["recompute"] = config.recompute
    return cfg.replace(**changes)
