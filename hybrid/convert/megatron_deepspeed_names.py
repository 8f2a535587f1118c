"""Megatron-DeepSpeed's GPT (``megatron/model/gpt_model.py``, ``GPTModel``) names <-> hybrid's, for ``from-deepspeed``.

Megatron-DeepSpeed wraps its (pre-Megatron-Core) ``GPTModel`` with ``deepspeed.initialize``; a ZeRO checkpoint of
it holds the parameters under these names (layer ``i``)::

    language_model.embedding.word_embeddings / position_embeddings   embedding.word_embeddings / position_embeddings
    language_model.encoder.layers.i.input_layernorm                  layers.i.input_norm
    language_model.encoder.layers.i.self_attention.query_key_value  layers.i.attention.qkv_proj   (regrouped)
    language_model.encoder.layers.i.self_attention.dense            layers.i.attention.out_proj
    language_model.encoder.layers.i.post_attention_layernorm        layers.i.post_attention_norm
    language_model.encoder.layers.i.mlp.dense_h_to_4h               layers.i.mlp.in_proj
    language_model.encoder.layers.i.mlp.dense_4h_to_h               layers.i.mlp.out_proj
    language_model.encoder.final_layernorm                          final_norm
    language_model.output_layer (--untie-embeddings-and-output-weights)   lm_head

Weights are ``[out, in]`` in both. ``query_key_value``'s rows are per head (``[sq, b, (np * 3 * hn)]`` viewed as
``[sq, b, np, 3 * hn]`` and split into q, k, v: checkpoint version 2 and later); hybrid's ``qkv_proj`` is
``[q; k; v]``, so its rows (and the bias's, and the same rows of both Adam moments) are regrouped: the same
regrouping as Megatron-Core's ``linear_qkv`` (:func:`hybrid.convert.from_megatron._qkv_regrouped`).

The model's shape comes from the ``args`` Megatron-DeepSpeed saves as DeepSpeed client state, or from a
``--model-config`` JSON of the same keys (Megatron's flag names, ``num_layers``, ``hidden_size``, ...), read
by :func:`hybrid.convert.from_megatron.config_from_args`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping

import torch

from hybrid.convert.consolidate import ConversionError
from hybrid.convert.from_megatron import _qkv_regrouped, config_from_args
from hybrid.convert.hf_common import Link
from model_zoo.config import GPTConfig

ARCHITECTURE = "Megatron-DeepSpeed GPTModel"
PREFIX = "language_model."
_QKV = "attention.qkv_proj"
# Megatron-DeepSpeed's per-layer modules -> hybrid's, below layers.i.
_LAYER_NAMES = (("input_layernorm", "input_norm"), ("self_attention.query_key_value", _QKV),
                ("self_attention.dense", "attention.out_proj"), ("post_attention_layernorm", "post_attention_norm"),
                ("mlp.dense_h_to_4h", "mlp.in_proj"), ("mlp.dense_4h_to_h", "mlp.out_proj"))


def matches(names: Iterable[str]) -> bool:
    """Whether a checkpoint's parameter names are Megatron-DeepSpeed's GPT (chosen over the HF maps)."""
    return any(n.startswith(PREFIX + "encoder.layers.") for n in names)


# The GPT-2-style model these names are read for: what config_from_args gives for it (the map has no other names)
_GPT2_STYLE = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
# Megatron-DeepSpeed flags that change the arithmetic or the names; none of them is read
_REFUSED_FLAGS = ("apply_residual_connection_post_layernorm", "use_rotary_position_embeddings")


def config_from_saved_args(args: Mapping[str, Any], where) -> GPTConfig:
    """The model Megatron-DeepSpeed's ``args`` describe (its ``--layernorm-epsilon`` is Megatron-LM's
    ``--norm-epsilon``; its ``--num-experts`` defaults to ``[1]``, dense; the default MLP width recorded as
    None, as the trainer records it). Only its GPT-2-style model is read: anything else is refused in one line
    naming every problem."""
    args = dict(args)
    if "norm_epsilon" not in args and "layernorm_epsilon" in args:
        args["norm_epsilon"] = args["layernorm_epsilon"]
    experts = args.get("num_experts")
    if experts is not None and set(experts if isinstance(experts, (list, tuple)) else [experts]) == {1}:
        args["num_experts"] = None
    problems = [f"the run used --{flag.replace('_', '-')}" for flag in _REFUSED_FLAGS if args.get(flag)]
    if args.get("num_key_value_heads") not in (None, args.get("num_attention_heads")):
        problems.append(f"the run used --num-key-value-heads {args['num_key_value_heads']} (grouped-query "
                        f"attention)")
    cfg = None
    try:
        cfg = config_from_args(args, where)
    except ConversionError as e:
        problems.append(str(e).removeprefix(f"{where}: "))
    if cfg is not None:
        other = {k: getattr(cfg, k) for k, v in _GPT2_STYLE.items() if getattr(cfg, k) != v}
        if other:
            problems.append(f"it describes a model with {other}")
    if problems:  # every one of them, so that one pass fixes them all
        raise ConversionError(f"{where}: {'; '.join(problems)}; from-deepspeed reads Megatron-DeepSpeed's "
                              f"GPT-2-style model ({_GPT2_STYLE}) with multi-head attention")
    if cfg.ffn_hidden_size == cfg.replace(ffn_hidden_size=None).ffn_size:  # the default width, as the trainer
        cfg = cfg.replace(ffn_hidden_size=None)                              # records it
    return cfg


def links(cfg: GPTConfig) -> List[Link]:
    out = [Link(f"embedding.{n}.weight", (f"{PREFIX}embedding.{n}.weight",))
           for n in ("word_embeddings", "position_embeddings")]
    for i in range(cfg.num_layers):
        src, dst = f"{PREFIX}encoder.layers.{i}.", f"layers.{i}."
        out += [Link(f"{dst}{name}.{p}", (f"{src}{theirs}.{p}",)) for theirs, name in _LAYER_NAMES
                for p in ("weight", "bias")]
    out += [Link(f"final_norm.{p}", (f"{PREFIX}encoder.final_layernorm.{p}",)) for p in ("weight", "bias")]
    if not cfg.tie_embeddings:
        out.append(Link("lm_head.weight", (f"{PREFIX}output_layer.weight",)))
    return out


def ignored(name: str, cfg: GPTConfig) -> bool:
    return False  # Megatron-DeepSpeed's GPTModel saves no buffers among its parameters


def rearrange(hybrid_name: str, t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """``t`` (Megatron-DeepSpeed's rows under hybrid's name) in hybrid's row order: per-head q/k/v regrouped."""
    return _qkv_regrouped(t, cfg) if hybrid_name.rpartition(".")[0].endswith(_QKV) else t


def checkpoint_args(model_states: Mapping[str, Any], where) -> Dict[str, Any]:
    """The ``args`` Megatron-DeepSpeed saved (a namespace or dict) as a dict; {} when the file holds none.
    Checkpoint versions before 2 laid ``query_key_value`` out otherwise and are refused."""
    version = model_states.get("checkpoint_version")
    if version is not None and float(version) < 2.0:
        raise ConversionError(f"{where} has Megatron checkpoint_version {version}: from-deepspeed reads the per-head "
                              f"[q k v] layout of version 2 and later")
    args = model_states.get("args")
    if args is None:
        return {}
    return dict(vars(args)) if hasattr(args, "__dict__") else dict(args)
