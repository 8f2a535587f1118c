"""GPT-2 (``GPT2LMHeadModel``) <-> hybrid GPT with the GPT-2 switches.

The GPT-2 switches: learned positions, LayerNorm, GELU (tanh approximation)
MLP, biases everywhere, tied or untied head. Name map per layer ``i``::

    transformer.wte / wpe                 embedding.word_embeddings / position_embeddings
    transformer.h.i.ln_1, ln_2            layers.i.input_norm, post_attention_norm
    transformer.h.i.attn.c_attn  (T)      layers.i.attention.qkv_proj   ([q; k; v] in both)
    transformer.h.i.attn.c_proj  (T)      layers.i.attention.out_proj
    transformer.h.i.mlp.c_fc     (T)      layers.i.mlp.in_proj
    transformer.h.i.mlp.c_proj   (T)      layers.i.mlp.out_proj
    transformer.ln_f                      final_norm
    lm_head                               lm_head (untied models only)

(T): GPT-2's ``Conv1D`` stores the weight as ``[in, out]``, the transpose of
the hybrid ``[out, in]``; biases are stored the same way in both.
"""

from __future__ import annotations

from typing import Any, Dict, List

from hybrid.convert.hf_common import Link, norm_weight, refuse, setting
from model_zoo.config import GPTConfig

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"

_SWITCHES = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True, "qk_norm": False}
# Both name the tanh approximation of GELU, which is what the hybrid GELU MLP computes.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def mismatches(cfg: GPTConfig) -> List[str]:
    out = [f"{k}={getattr(cfg, k)!r} (GPT-2 has {v!r})" for k, v in _SWITCHES.items() if getattr(cfg, k) != v]
    if cfg.attention_width != cfg.hidden_size:  # GPT-2's config has no head dim of its own: always n_embd / n_head
        out.append(f"kv_channels={cfg.kv_channels} (GPT-2's head dim is n_embd / n_head = "
                   f"{cfg.hidden_size} / {cfg.num_heads})")
    return out


def hf_config(cfg: GPTConfig, dtype_name: str) -> Dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "n_positions": cfg.num_positions, "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
        "n_inner": None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_std, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False,
        "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": dtype_name,
    }


def config_from_hf(hf: Dict[str, Any], where: str) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise refuse(where, "activation_function", act, f"hybrid's GELU MLP is the tanh approximation: "
                                                         f"{' or '.join(_TANH_GELU)}")
    for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                    ("scale_attn_weights", True)):
        if setting(hf, key, where, "true or false", ok) != ok:
            raise refuse(where, key, hf[key], f"hybrid attention needs {key}={ok}")
    # The position table size becomes the sequence length (and thereby the table size, num_positions).
    positions = setting(hf, "n_positions", where, "an integer")
    hidden = setting(hf, "n_embd", where, "an integer")
    # The default width is recorded as None, as the trainer records it when no flag sets it.
    inner = setting(hf, "n_inner", where, "an integer", None)
    ffn = None if inner in (None, 4 * hidden) else inner
    return GPTConfig(
        vocab_size=setting(hf, "vocab_size", where, "an integer"), hidden_size=hidden,
        num_layers=setting(hf, "n_layer", where, "an integer"), num_heads=setting(hf, "n_head", where, "an integer"),
        ffn_hidden_size=ffn, seq_length=positions,
        position="learned", norm="layernorm", norm_eps=setting(hf, "layer_norm_epsilon", where, "a number", 1e-5),
        mlp="gelu", bias=True, tie_embeddings=setting(hf, "tie_word_embeddings", where, "true or false", True),
        hidden_dropout=setting(hf, "resid_pdrop", where, "a number", 0.0),
        attention_dropout=setting(hf, "attn_pdrop", where, "a number", 0.0),
        init_std=setting(hf, "initializer_range", where, "a number", 0.02))


def links(cfg: GPTConfig) -> List[Link]:
    out = [Link("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
           Link("embedding.position_embeddings.weight", ("transformer.wpe.weight",))]
    for i in range(cfg.num_layers):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        for hf_name, name in (("ln_1", "input_norm"), ("ln_2", "post_attention_norm")):
            out += [norm_weight(cfg, f"{dst}{name}.weight", f"{src}{hf_name}.weight"),
                    Link(f"{dst}{name}.bias", (f"{src}{hf_name}.bias",))]
        for hf_name, name in (("attn.c_attn", "attention.qkv_proj"), ("attn.c_proj", "attention.out_proj"),
                              ("mlp.c_fc", "mlp.in_proj"), ("mlp.c_proj", "mlp.out_proj")):
            out.append(Link(f"{dst}{name}.weight", (f"{src}{hf_name}.weight",), transpose=True))
            out.append(Link(f"{dst}{name}.bias", (f"{src}{hf_name}.bias",)))
    out += [norm_weight(cfg, "final_norm.weight", "transformer.ln_f.weight"),
            Link("final_norm.bias", ("transformer.ln_f.bias",))]
    if not cfg.tie_embeddings:
        out.append(Link("lm_head.weight", ("lm_head.weight",)))
    return out


def ignored(name: str, cfg: GPTConfig) -> bool:
    # A tied head duplicates wte; attn.bias / attn.masked_bias are causal-mask buffers of old releases.
    return (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith((".attn.bias", ".attn.masked_bias"))
