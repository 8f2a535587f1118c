"""The model_zoo GPT that a config's ``model`` section describes."""

from __future__ import annotations

import re
from typing import Any, Dict, List

from hybrid.config import HybridConfig
from hybrid.config.trainer_sections import MODEL_KEYS

# The model section's keys that take a value (not switches): given, they override the preset's GPTConfig field.
_VALUE_KEYS = tuple(mk for mk in MODEL_KEYS if not mk.is_switch)
_SWITCHES = tuple(mk for mk in MODEL_KEYS if mk.is_switch)

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
    """The config keys whose GPTConfig fields or flags ``message`` (a GPTConfig.validate error) names, in the order
    it names them (``tp``: validate's tensor-parallel size): so that the trainer's error can end with their flags."""
    from hybrid.config.spellings import SPELLINGS

    by_gpt_name = {mk.field: f"model.{mk.key}" for mk in _VALUE_KEYS}
    by_gpt_name["tp"] = "tensor_parallel_size"
    by_flag = {flag: s.leaf.key for flag, s in SPELLINGS.items()}  # the MoE rules name flags (--num-experts)
    named = []
    for word in re.findall(r"--[a-z0-9-]+|[a-z_]+", message):
        key = by_flag.get(word) if word.startswith("--") else by_gpt_name.get(word)
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
    for mk in _VALUE_KEYS:
        if mk.field != "vocab_size" and getattr(m, mk.key) is not None:  # vocab_size: the tokenizer's, above
            changes[mk.field] = _model_zoo_value(mk.field, getattr(m, mk.key))
    for mk in _SWITCHES:
        if getattr(m, mk.key):
            changes[mk.field] = mk.switch
    changes["recompute"] = config.recompute  # a top-level key: the engine reads it too
    return cfg.replace(**changes)
