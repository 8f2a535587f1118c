"""Llama (``LlamaForCausalLM``) <-> hybrid GPT with the Llama switches.

The Llama switches: rotary positions (rotate-halves convention, the one HF
uses, so q and k need no permutation), RMSNorm, SwiGLU MLP, no biases,
usually an untied head. Name map per layer ``i``::

    model.embed_tokens                         embedding.word_embeddings
    model.layers.i.input_layernorm             layers.i.input_norm
    model.layers.i.self_attn.{q,k,v}_proj      layers.i.attention.qkv_proj   ([q; k; v], dim 0)
    model.layers.i.self_attn.o_proj            layers.i.attention.out_proj
    model.layers.i.post_attention_layernorm    layers.i.post_attention_norm
    model.layers.i.mlp.{gate,up}_proj          layers.i.mlp.in_proj          ([gate; up], dim 0)
    model.layers.i.mlp.down_proj               layers.i.mlp.out_proj
    model.norm                                 final_norm
    lm_head                                    lm_head (untied models only)

Grouped-query attention (fewer key/value heads) and RoPE scaling have no
hybrid counterpart yet and are refused on import.
"""

from __future__ import annotations

from typing import Any, Dict, List

from hybrid.convert.hf_common import Link, refuse, require
from model_zoo.config import GPTConfig, swiglu_ffn_size

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

_SWITCHES = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}


def mismatches(cfg: GPTConfig) -> List[str]:
    return [f"{k}={getattr(cfg, k)!r} (Llama has {v!r})" for k, v in _SWITCHES.items() if getattr(cfg, k) != v]


def hf_config(cfg: GPTConfig, dtype_name: str) -> Dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.num_positions, "rms_norm_eps": cfg.norm_eps,
        # Older transformers read rope_theta, newer ones rope_parameters; both describe the same rotation.
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "attention_bias": False, "attention_dropout": cfg.attention_dropout,
        "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "pretraining_tp": 1, "use_cache": True, "bos_token_id": None, "eos_token_id": None,
        "torch_dtype": dtype_name,
    }


def _rope_theta(hf: Dict[str, Any], where: str) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for source, cfg in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = cfg.get("rope_type", cfg.get("type", "default"))
        if kind != "default":
            raise refuse(where, f"{source}.rope_type", kind, "hybrid implements plain RoPE, no scaling")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: Dict[str, Any], where: str) -> GPTConfig:
    heads = require(hf, "num_attention_heads", where)
    hidden = require(hf, "hidden_size", where)
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise refuse(where, "num_key_value_heads", kv_heads, f"grouped-query attention; hybrid needs as many "
                                                             f"key/value heads as attention heads ({heads})")
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise refuse(where, "head_dim", head_dim, f"hybrid needs head_dim = hidden_size / num_attention_heads = "
                                                  f"{hidden} / {heads}")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", hf["hidden_act"], "the hybrid SwiGLU MLP uses silu")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise refuse(where, key, hf[key], "the hybrid Llama switches have no biases")
    # The position table size becomes the sequence length (the trainer's --seq-length may lower it).
    positions = require(hf, "max_position_embeddings", where)
    # The default SwiGLU width is recorded as None, as the trainer records it when no flag sets it.
    ffn = require(hf, "intermediate_size", where)
    return GPTConfig(
        vocab_size=require(hf, "vocab_size", where), hidden_size=hidden,
        num_layers=require(hf, "num_hidden_layers", where), num_heads=heads,
        ffn_hidden_size=None if ffn == swiglu_ffn_size(hidden) else ffn, seq_length=positions, position="rope",
        rope_theta=_rope_theta(hf, where), norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        mlp="swiglu", bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))


def links(cfg: GPTConfig) -> List[Link]:
    out = [Link("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out += [
            Link(f"{dst}input_norm.weight", (f"{src}input_layernorm.weight",)),
            Link(f"{dst}attention.qkv_proj.weight", tuple(f"{src}self_attn.{x}_proj.weight" for x in "qkv")),
            Link(f"{dst}attention.out_proj.weight", (f"{src}self_attn.o_proj.weight",)),
            Link(f"{dst}post_attention_norm.weight", (f"{src}post_attention_layernorm.weight",)),
            Link(f"{dst}mlp.in_proj.weight", (f"{src}mlp.gate_proj.weight", f"{src}mlp.up_proj.weight")),
            Link(f"{dst}mlp.out_proj.weight", (f"{src}mlp.down_proj.weight",)),
        ]
    out.append(Link("final_norm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        out.append(Link("lm_head.weight", ("lm_head.weight",)))
    return out


def ignored(name: str, cfg: GPTConfig) -> bool:
    # A tied head duplicates embed_tokens; rotary_emb.inv_freq is a buffer some releases saved.
    return (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith("rotary_emb.inv_freq")
