"""The Llama family: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` <-> hybrid GPT.

The four share one layout and differ in their switches: rotary positions
(rotate-halves convention, the one HF uses, so q and k need no permutation),
RMSNorm, SwiGLU MLP and no MLP or output biases; grouped-query attention
(``num_key_value_heads`` = hybrid's ``num_query_groups``) and RoPE scaling
(``linear``, ``llama3``, ``yarn`` with its attention factor: :func:`_yarn_from_hf`); config.json's
``head_dim``, where it is not ``hidden_size / num_attention_heads``, is hybrid's ``kv_channels``. Qwen2 adds a bias to q, k and v (hybrid's
``qkv_bias``); Qwen3 an RMSNorm over each query and key head (``qk_norm``). Mistral and the Qwens may declare
a sliding attention window,
which hybrid's full causal attention reproduces only when the window covers
every position (null, or at least ``max_position_embeddings``); other
windows are refused. Name map per layer ``i``::

    model.embed_tokens                         embedding.word_embeddings
    model.layers.i.input_layernorm             layers.i.input_norm
    model.layers.i.self_attn.{q,k,v}_proj      layers.i.attention.qkv_proj   ([q; k; v], dim 0; rows of
                                                                             model_zoo.qkv_layout)
    model.layers.i.self_attn.{q,k}_norm        layers.i.attention.{q,k}_norm (Qwen3)
    model.layers.i.self_attn.o_proj            layers.i.attention.out_proj
    model.layers.i.post_attention_layernorm    layers.i.post_attention_norm
    model.layers.i.mlp.{gate,up}_proj          layers.i.mlp.in_proj          ([gate; up], dim 0)
    model.layers.i.mlp.down_proj               layers.i.mlp.out_proj
    model.norm                                 final_norm
    lm_head                                    lm_head (untied models only)

Each architecture is a :class:`LlamaFamily` object with the map interface of
:mod:`hybrid.convert.hf_common`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from hybrid.convert.hf_common import Link, norm_weight, refuse, setting
from model_zoo.config import GPTConfig, swiglu_ffn_size
from model_zoo.qkv_layout import qkv_layout

# HF rope_type -> hybrid rope_scaling, and the HF keys of its parameters -> GPTConfig fields
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
_ROPE_KEYS = {"linear": (("factor", "rope_scaling_factor"),),
              "llama3": (("factor", "rope_scaling_factor"), ("low_freq_factor", "rope_low_freq_factor"),
                         ("high_freq_factor", "rope_high_freq_factor"),
                         ("original_max_position_embeddings", "rope_original_max_positions")),
              "yarn": (("factor", "rope_scaling_factor"),
                       ("original_max_position_embeddings", "rope_original_max_positions"),
                       ("beta_fast", "rope_yarn_beta_fast"), ("beta_slow", "rope_yarn_beta_slow"))}


@dataclasses.dataclass(frozen=True)
class LlamaFamily:
    ARCHITECTURE: str
    MODEL_TYPE: str
    qkv_bias: bool  # Qwen2's q/k/v bias
    fixed: Tuple[Tuple[str, Any], ...]  # config.json settings export writes as they are
    # The config.json switch that turns sliding_window on (Qwen2's use_sliding_window; None: a window is
    # in force whenever one is given)
    window_switch: Optional[str] = None
    qk_norm: bool = False  # Qwen3's RMSNorm over each query and key head

    def switches(self) -> Dict[str, Any]:
        return {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                "attention_bias": self.qkv_bias, "qk_norm": self.qk_norm}

    def mismatches(self, cfg: GPTConfig) -> List[str]:
        return [f"{k}={getattr(cfg, k)!r} ({self.ARCHITECTURE} has {v!r})" for k, v in self.switches().items()
                if getattr(cfg, k) != v] + self.mlp_mismatches(cfg)

    def mlp_mismatches(self, cfg: GPTConfig) -> List[str]:
        """Why ``cfg``'s MLPs are not this family's: a dense family takes no experts (the mixtures of experts are
        :mod:`hybrid.convert.hf_moe`'s)."""
        return [f"num_experts={cfg.num_experts} ({self.ARCHITECTURE} is dense)"] if cfg.is_moe else []

    def hf_config(self, cfg: GPTConfig, dtype_name: str) -> Dict[str, Any]:
        scaling = _hf_rope_scaling(cfg)
        out = {
            "architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.num_positions, "rms_norm_eps": cfg.norm_eps,
            # Older transformers read rope_theta and rope_scaling, newer ones rope_parameters; all describe
            # the same rotation.
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta),
            "attention_dropout": cfg.attention_dropout, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std, "use_cache": True, "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": dtype_name,
        }
        out.update(self.fixed)
        if self.window_switch is not None:  # no layer has the (switched off) window
            out["max_window_layers"] = cfg.num_layers
        return out

    def config_from_hf(self, hf: Dict[str, Any], where: str) -> GPTConfig:
        heads = setting(hf, "num_attention_heads", where, "an integer")
        hidden = setting(hf, "hidden_size", where, "an integer")
        groups = setting(hf, "num_key_value_heads", where, "an integer", None) or heads
        if heads % groups:
            raise refuse(where, "num_key_value_heads", groups, f"it must divide num_attention_heads={heads}")
        head_dim = setting(hf, "head_dim", where, "an integer", None)
        if not head_dim and hidden % heads:
            raise refuse(where, "num_attention_heads", heads, f"it must divide hidden_size={hidden} when "
                                                               f"config.json gives no head_dim")
        # A head dim other than hidden / heads (Qwen3, Mistral NeMo) is hybrid's kv_channels; the usual one is
        # recorded as None, as the trainer records it when no flag sets it.
        kv_channels = head_dim if head_dim and head_dim * heads != hidden else None
        if hf.get("hidden_act", "silu") != "silu":
            raise refuse(where, "hidden_act", hf["hidden_act"], "the hybrid SwiGLU MLP uses silu")
        for key in ("mlp_bias",) + (() if self.qkv_bias else ("attention_bias",)):
            if hf.get(key):
                raise refuse(where, key, hf[key], f"hybrid's {self.ARCHITECTURE} switches have no such bias")
        # The position table size becomes the sequence length (the trainer's --seq-length may lower it).
        positions = setting(hf, "max_position_embeddings", where, "an integer")
        self._check_window(hf, positions, where)
        # The default SwiGLU width is recorded as None, as the trainer records it when no flag sets it.
        ffn = setting(hf, "intermediate_size", where, "an integer")
        return GPTConfig(
            vocab_size=setting(hf, "vocab_size", where, "an integer"), hidden_size=hidden,
            num_layers=setting(hf, "num_hidden_layers", where, "an integer"), num_heads=heads,
            num_query_groups=None if groups == heads else groups, kv_channels=kv_channels,
            ffn_hidden_size=None if ffn == swiglu_ffn_size(hidden) else ffn, seq_length=positions,
            position="rope", **_rope_from_hf(hf, where), norm="rmsnorm",
            norm_eps=setting(hf, "rms_norm_eps", where, "a number", 1e-6), mlp="swiglu", bias=False,
            qkv_bias=True if self.qkv_bias else None, qk_norm=self.qk_norm,
            tie_embeddings=setting(hf, "tie_word_embeddings", where, "true or false", False),
            attention_dropout=setting(hf, "attention_dropout", where, "a number", 0.0),
            init_std=setting(hf, "initializer_range", where, "a number", 0.02))

    def _check_window(self, hf: Dict[str, Any], positions: int, where: str) -> None:
        window = setting(hf, "sliding_window", where, "an integer", None)
        used = window is not None and (self.window_switch is None or hf.get(self.window_switch)
                                       or "sliding_attention" in (hf.get("layer_types") or ()))
        if used and window < positions:
            raise refuse(where, "sliding_window", window, f"hybrid's attention is full causal, which matches a "
                                                          f"window only when it is null or at least "
                                                          f"max_position_embeddings={positions}")

    def links(self, cfg: GPTConfig) -> List[Link]:
        rows = qkv_layout(cfg).sections
        out = [Link("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
        for i in range(cfg.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            out += [
                norm_weight(cfg, f"{dst}input_norm.weight", f"{src}input_layernorm.weight"),
                Link(f"{dst}attention.qkv_proj.weight", tuple(f"{src}self_attn.{x}_proj.weight" for x in "qkv"),
                     rows=rows),
            ]
            if cfg.attention_bias:
                out.append(Link(f"{dst}attention.qkv_proj.bias",
                                tuple(f"{src}self_attn.{x}_proj.bias" for x in "qkv"), rows=rows))
            if cfg.qk_norm:
                out += [norm_weight(cfg, f"{dst}attention.{x}_norm.weight", f"{src}self_attn.{x}_norm.weight")
                        for x in "qk"]
            out += [
                Link(f"{dst}attention.out_proj.weight", (f"{src}self_attn.o_proj.weight",)),
                norm_weight(cfg, f"{dst}post_attention_norm.weight", f"{src}post_attention_layernorm.weight"),
            ]
            out += self.mlp_links(cfg, i)
        out.append(norm_weight(cfg, "final_norm.weight", "model.norm.weight"))
        if not cfg.tie_embeddings:
            out.append(Link("lm_head.weight", ("lm_head.weight",)))
        return out

    def mlp_links(self, cfg: GPTConfig, i: int) -> List[Link]:
        """Layer ``i``'s MLP (the SwiGLU ``[gate; up]`` and down projections); the MoE families replace it."""
        return swiglu_links(f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj"))

    def ignored(self, name: str, cfg: GPTConfig) -> bool:
        # A tied head duplicates embed_tokens; rotary_emb.inv_freq is a buffer some releases saved.
        return (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith("rotary_emb.inv_freq")


def swiglu_links(src: str, dst: str, names: Tuple[str, str, str]) -> List[Link]:
    """One SwiGLU MLP: hybrid ``{dst}in_proj.weight`` ``[gate; up]`` and ``{dst}out_proj.weight`` from the HF
    ``{src}{gate}.weight``, ``{src}{up}.weight`` and ``{src}{down}.weight`` of ``names = (gate, up, down)``."""
    gate, up, down = names
    return [Link(f"{dst}in_proj.weight", (f"{src}{gate}.weight", f"{src}{up}.weight")),
            Link(f"{dst}out_proj.weight", (f"{src}{down}.weight",))]


LLAMA = LlamaFamily("LlamaForCausalLM", "llama", qkv_bias=False,
                    fixed=(("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1)))
MISTRAL = LlamaFamily("MistralForCausalLM", "mistral", qkv_bias=False, fixed=(("sliding_window", None),))
QWEN2 = LlamaFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True,
                    fixed=(("sliding_window", None), ("use_sliding_window", False)), window_switch="use_sliding_window")
QWEN3 = LlamaFamily("Qwen3ForCausalLM", "qwen3", qkv_bias=False,
                    fixed=(("attention_bias", False), ("sliding_window", None), ("use_sliding_window", False)),
                    window_switch="use_sliding_window", qk_norm=True)
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3)


def _hf_rope_scaling(cfg: GPTConfig):
    if cfg.rope_scaling == "none":
        return None
    hf_type = next(k for k, v in _ROPE_TYPES.items() if v == cfg.rope_scaling)
    out = {"rope_type": hf_type, **{hf_key: getattr(cfg, key) for hf_key, key in _ROPE_KEYS[cfg.rope_scaling]}}
    if cfg.rope_scaling == "yarn":
        # Written only where they differ from what transformers assumes when a key is absent (its attention
        # factor from factor alone, truncated ramp ends), so that a config.json stays as a release writes it.
        if cfg.rope_yarn_mscale_all_dim:
            out.update(mscale=cfg.rope_yarn_mscale, mscale_all_dim=cfg.rope_yarn_mscale_all_dim)
        if cfg.rope_attention_factor is not None:
            out["attention_factor"] = float(cfg.rope_attention_factor)
        if not cfg.rope_yarn_truncate:
            out["truncate"] = False
    return out


def _rope_from_hf(hf: Dict[str, Any], where: str) -> Dict[str, Any]:
    """GPTConfig's rope fields from ``rope_parameters`` (newer transformers) or ``rope_scaling`` + ``rope_theta``."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if kind not in _ROPE_TYPES:
        raise refuse(where, f"{source}.rope_type", kind, f"hybrid implements {', '.join(_ROPE_TYPES)}")
    theta = setting(params, "rope_theta", f"{where} ({source})", "a number", None)
    out: Dict[str, Any] = {"rope_theta": theta or setting(hf, "rope_theta", where, "a number", 10000.0),
                           "rope_scaling": _ROPE_TYPES[kind]}
    if kind == "yarn":
        return {**out, **_yarn_from_hf(hf, params, f"{where} ({source})")}
    for hf_key, key in _ROPE_KEYS.get(_ROPE_TYPES[kind], ()):
        out[key] = setting(params, hf_key, f"{where} ({source})",
                           "an integer" if key == "rope_original_max_positions" else "a number")
    if params.get("attention_factor") not in (None, 1.0):
        raise refuse(where, f"{source}.attention_factor", params["attention_factor"], "hybrid scales no attention")
    return out


def _yarn_from_hf(hf: Dict[str, Any], params: Dict[str, Any], where: str) -> Dict[str, Any]:
    """GPTConfig's yarn fields from the rope parameters ``params`` of config.json ``hf``, read as transformers
    reads them (modeling_rope_utils): the original context from a top-level ``original_max_position_embeddings``
    first, then the parameters', else ``max_position_embeddings``; ``factor`` required (transformers 5 refuses a
    yarn without one); a missing (or 0) ``beta_fast``/``beta_slow`` 32/1; ``mscale`` counts
    only together with a non-zero ``mscale_all_dim`` (else the attention factor is ``0.1 ln(factor) + 1``), and
    an ``attention_factor`` replaces both."""
    positions = setting(hf, "max_position_embeddings", where, "an integer")
    original = setting(hf, "original_max_position_embeddings", where, "an integer", None) or \
        setting(params, "original_max_position_embeddings", where, "an integer", positions)
    out: Dict[str, Any] = {
        "rope_original_max_positions": original, "rope_scaling_factor": setting(params, "factor", where, "a number"),
        "rope_yarn_beta_fast": setting(params, "beta_fast", where, "a number", None) or 32.0,
        "rope_yarn_beta_slow": setting(params, "beta_slow", where, "a number", None) or 1.0,
        "rope_yarn_truncate": setting(params, "truncate", where, "true or false", True),
        "rope_attention_factor": setting(params, "attention_factor", where, "a number", None)}
    mscale = setting(params, "mscale", where, "a number", None)
    mscale_all_dim = setting(params, "mscale_all_dim", where, "a number", None)
    if mscale and mscale_all_dim:
        out.update(rope_yarn_mscale=mscale, rope_yarn_mscale_all_dim=mscale_all_dim)
    return out
