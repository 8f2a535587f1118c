"""``GPTConfig``: the shape and switches of a decoder-only transformer.

One dataclass covers the GPT-2 family (learned positions, LayerNorm, GELU,
biases, tied embeddings) and the Llama family (RoPE, RMSNorm, SwiGLU, no
biases, untied head), with grouped-query attention (``num_query_groups``
key/value heads shared by the query heads; 1 is multi-query), a head dim
other than ``hidden_size / num_heads`` (``kv_channels``), RoPE scaling
(linear, or Llama 3's frequency-dependent rule) and a QKV bias of its own
(``qkv_bias``: Qwen2 has it with no other bias), and query/key norms
(``qk_norm``: Qwen3; Megatron's ``--qk-layernorm``). :meth:`GPTConfig.validate`
checks it against a tensor-parallel size and names the offending keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from hybrid import param_meta

POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
RECOMPUTE = ("none", "full", "selective")
ROPE_SCALINGS = ("none", "linear", "llama3")


def swiglu_ffn_size(hidden_size: int, multiple_of: int = 256) -> int:
    """The Llama rule for the SwiGLU width: 2/3 of 4h, rounded up to ``multiple_of``."""
    raw = int(2 * 4 * hidden_size / 3)
    return multiple_of * -(-raw // multiple_of)


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: Optional[int] = None  # key/value heads; None: num_heads (plain multi-head), 1: multi-query
    kv_channels: Optional[int] = None  # head dim; None: hidden_size / num_heads (Qwen3, Mistral NeMo: 128 apart)
    ffn_hidden_size: Optional[int] = None  # None: 4h (gelu) or the Llama rule (swiglu)
    seq_length: int = 1024  # training sequence length
    max_position_embeddings: Optional[int] = None  # learned table size; None: seq_length
    position: str = "learned"  # "learned" | "rope"
    rope_theta: float = 10000.0
    # RoPE scaling: "linear" divides every frequency by rope_scaling_factor; "llama3" divides only the low
    # frequencies (wavelength > rope_original_max_positions / rope_low_freq_factor), keeps the high ones
    # (wavelength < rope_original_max_positions / rope_high_freq_factor) and blends in between.
    rope_scaling: str = "none"  # "none" | "linear" | "llama3"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # "gelu" (tanh approximation) | "swiglu"
    bias: bool = True
    qkv_bias: Optional[bool] = None  # bias of the q/k/v projection; None: as ``bias`` (Qwen2: True, bias False)
    qk_norm: bool = False  # each query and key head normalised over its head dim (``norm``), before RoPE (Qwen3)
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0  # embeddings and both residual branches
    attention_dropout: float = 0.0  # attention probabilities
    init_std: float = 0.02
    scaled_output_init: bool = True  # output projections use init_std / sqrt(2 * num_layers)
    sequence_parallel: bool = False
    recompute: str = "none"  # "none" | "full" (every layer) | "selective" (attention core)
    vocab_pad_multiple: int = 128  # vocab padded to a multiple of this times tp

    # ---- derived sizes ---------------------------------------------------------------
    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 4 * self.hidden_size if self.mlp == "gelu" else swiglu_ffn_size(self.hidden_size)

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, or ``hidden_size / num_heads`` when unset."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_heads

    @property
    def attention_width(self) -> int:
        """``num_heads * head_dim``: the query rows of the q/k/v projection and the output projection's input.
        Equal to ``hidden_size`` unless ``kv_channels`` sets another head dim."""
        return self.num_heads * self.head_dim

    @property
    def query_groups(self) -> int:
        """Key/value heads (``num_query_groups``, or ``num_heads`` when unset)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_heads

    @property
    def attention_bias(self) -> bool:
        """Whether the q/k/v projection has a bias."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def num_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        unit = self.vocab_pad_multiple * tp_size
        return -(-self.vocab_size // unit) * unit

    # ---- validation ---------------------------------------------------------------------
    def validate(self, tp_size: int = 1) -> "GPTConfig":
        """Raise ``ValueError`` naming the key and the rule when the config cannot run at ``tp_size``."""
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length", "vocab_pad_multiple"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{key} must be a positive integer, got {value!r}")
        for key, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", MLPS), ("recompute", RECOMPUTE)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"GPTConfig.{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int)
                                                 or self.ffn_hidden_size < 1):
            raise ValueError(f"GPTConfig.ffn_hidden_size must be a positive integer or None, "
                             f"got {self.ffn_hidden_size!r}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"GPTConfig.{key} must be in [0, 1), got {getattr(self, key)}")
        if not self.norm_eps > 0 or not self.init_std > 0 or not self.rope_theta > 0:
            raise ValueError(f"GPTConfig.norm_eps ({self.norm_eps}), init_std ({self.init_std}) and rope_theta "
                             f"({self.rope_theta}) must be > 0")
        if self.num_query_groups is not None and (not isinstance(self.num_query_groups, int)
                                                  or isinstance(self.num_query_groups, bool)
                                                  or self.num_query_groups < 1
                                                  or self.num_heads % self.num_query_groups):
            raise ValueError(f"GPTConfig.num_query_groups={self.num_query_groups!r} must be a positive integer "
                             f"that divides num_heads={self.num_heads}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"GPTConfig.rope_scaling={self.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}")
        if not self.rope_scaling_factor > 0 or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor \
                or not (isinstance(self.rope_original_max_positions, int) and self.rope_original_max_positions > 0):
            raise ValueError(f"GPTConfig RoPE scaling needs rope_scaling_factor > 0 "
                             f"({self.rope_scaling_factor}), 0 < rope_low_freq_factor < rope_high_freq_factor "
                             f"({self.rope_low_freq_factor}, {self.rope_high_freq_factor}) and a positive integer "
                             f"rope_original_max_positions ({self.rope_original_max_positions!r})")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int)
                                             or isinstance(self.kv_channels, bool) or self.kv_channels < 1):
            raise ValueError(f"GPTConfig.kv_channels must be a positive integer or None, got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(f"GPTConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}, or kv_channels must give the head dim")
        if self.position == "rope" and self.head_dim % 2 != 0:
            source = (f"kv_channels = {self.kv_channels}" if self.kv_channels is not None else
                      f"hidden_size/num_heads = {self.hidden_size}/{self.num_heads} = {self.head_dim}")
            raise ValueError(f"rotary positions need an even head dim, but {source}")
        if self.position == "learned" and self.num_positions < self.seq_length:
            raise ValueError(f"GPTConfig.max_position_embeddings={self.num_positions} is smaller than "
                             f"seq_length={self.seq_length}; learned positions need one row per position")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {tp_size!r}")
        if self.num_heads % tp_size != 0:
            raise ValueError(f"GPTConfig.num_heads={self.num_heads} must be divisible by the tensor-parallel "
                             f"size tp={tp_size} (attention heads are split over TP ranks)")
        param_meta.split_units(self.query_groups, tp_size, "GPTConfig.num_query_groups")
        if self.ffn_size % tp_size != 0:
            raise ValueError(f"GPTConfig.ffn_hidden_size={self.ffn_size} must be divisible by the "
                             f"tensor-parallel size tp={tp_size}")
        if self.sequence_parallel and self.seq_length % tp_size != 0:
            raise ValueError(f"GPTConfig.seq_length={self.seq_length} must be divisible by the tensor-parallel "
                             f"size tp={tp_size} when sequence_parallel=True")
        return self

    # ---- (de)serialisation ------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys {unknown}; valid keys are {sorted(known)}")
        return cls(**d)

    def replace(self, **changes) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys {unknown}; valid keys are {sorted(known)}")
        return dataclasses.replace(self, **changes)
