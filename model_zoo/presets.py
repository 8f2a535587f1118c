"""Named model shapes. ``get_preset(name, **overrides)`` returns a fresh :class:`GPTConfig`.

Published parameter counts (logical vocabulary, no padding) are kept next to
each preset in :data:`PUBLISHED_PARAMS` (exact), :data:`ROUNDED_PARAMS` (in
billions, as the model cards give them) and :data:`NOMINAL_PARAMS`; the
tests check the model against them.
"""

from __future__ import annotations

from typing import Callable, Dict, List

from model_zoo.config import GPTConfig

GPT2_VOCAB = 50257


def _gpt2_style(hidden: int, layers: int, heads: int, seq: int = 1024, vocab: int = GPT2_VOCAB) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, seq_length=seq,
                     position="learned", norm="layernorm", norm_eps=1e-5, mlp="gelu", bias=True,
                     tie_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1)


def _llama_style(hidden: int, layers: int, heads: int, ffn: int, vocab: int, seq: int, groups=None,
                 theta: float = 10000.0, eps: float = 1e-6, **switches) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_query_groups=groups, ffn_hidden_size=ffn, seq_length=seq, position="rope",
                     rope_theta=theta, norm="rmsnorm", norm_eps=eps, mlp="swiglu", bias=False, tie_embeddings=False,
                     hidden_dropout=0.0, attention_dropout=0.0, scaled_output_init=False, **switches)


_PRESETS: Dict[str, Callable[[], GPTConfig]] = {
    # Small enough for CPU tests and the demo: ~1.3M parameters.
    "tiny": lambda: _gpt2_style(hidden=128, layers=4, heads=8, seq=128, vocab=4096).replace(
        hidden_dropout=0.0, attention_dropout=0.0),
    "llama-tiny": lambda: _llama_style(hidden=128, layers=4, heads=8, ffn=352, vocab=4096, seq=128),
    # Llama 3 style for CPU tests and the demo: 8 query heads sharing 2 key/value groups, llama3 RoPE scaling.
    "tiny-gqa": lambda: _llama_style(hidden=128, layers=4, heads=8, ffn=352, vocab=4096, seq=128, groups=2,
                                     theta=500000.0, eps=1e-5, rope_scaling="llama3", rope_scaling_factor=8.0,
                                     rope_original_max_positions=64),
    "gpt2-small": lambda: _gpt2_style(hidden=768, layers=12, heads=12),
    "gpt2-medium": lambda: _gpt2_style(hidden=1024, layers=24, heads=16),
    "gpt2-large": lambda: _gpt2_style(hidden=1280, layers=36, heads=20),
    "gpt2-xl": lambda: _gpt2_style(hidden=1600, layers=48, heads=25),
    "megatron-8.3b": lambda: _gpt2_style(hidden=3072, layers=72, heads=24),
    "turing-nlg-17b": lambda: _gpt2_style(hidden=4256, layers=78, heads=28),
    "gpt3-175b": lambda: _gpt2_style(hidden=12288, layers=96, heads=96, seq=2048),
    "llama-7b": lambda: _llama_style(hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000, seq=4096),
    # The config.json of each Hugging Face release (see docs/model_zoo.md).
    "llama3-8b": lambda: _llama_style(hidden=4096, layers=32, heads=32, groups=8, ffn=14336, vocab=128256,
                                      seq=8192, theta=500000.0, eps=1e-5),
    "llama3-70b": lambda: _llama_style(hidden=8192, layers=80, heads=64, groups=8, ffn=28672, vocab=128256,
                                       seq=8192, theta=500000.0, eps=1e-5),
    "mistral-7b": lambda: _llama_style(hidden=4096, layers=32, heads=32, groups=8, ffn=14336, vocab=32000,
                                       seq=4096, theta=10000.0, eps=1e-5),
    "qwen2-7b": lambda: _llama_style(hidden=3584, layers=28, heads=28, groups=4, ffn=18944, vocab=152064,
                                     seq=4096, theta=1000000.0, eps=1e-6, qkv_bias=True),
    # 32 heads of 128 channels on a hidden size of 5120: a head dim of its own (kv_channels)
    "mistral-nemo-12b": lambda: _llama_style(hidden=5120, layers=40, heads=32, groups=8, ffn=14336, vocab=131072,
                                             seq=4096, theta=1000000.0, eps=1e-5, kv_channels=128),
    # 16 heads of 128 channels on a hidden size of 1024, each query and key head RMS-normalised; tied embeddings
    "qwen3-0.6b": lambda: _llama_style(hidden=1024, layers=28, heads=16, groups=8, ffn=3072, vocab=151936, seq=4096,
                                       theta=1000000.0, eps=1e-6, kv_channels=128, qk_norm=True).replace(
        tie_embeddings=True),
    # Mixture of Experts. tiny-moe: the demo's MoE, 4 SwiGLU experts of 256 channels, top-2, every layer.
    "tiny-moe": lambda: _llama_style(hidden=128, layers=4, heads=8, ffn=352, vocab=4096, seq=128, num_experts=4,
                                     moe_ffn_hidden_size=256, moe_router_topk=2, moe_aux_loss_coeff=1e-2),
    # Mixtral 8x7B: 8 experts of 14336 channels, top-2 renormalised, every layer
    "mixtral-8x7b": lambda: _llama_style(hidden=4096, layers=32, heads=32, groups=8, ffn=14336, vocab=32000,
                                         seq=4096, theta=1000000.0, eps=1e-5, num_experts=8, moe_router_topk=2,
                                         moe_aux_loss_coeff=0.02),
    # Qwen3-30B-A3B: 128 experts of 768 channels, top-8 renormalised, heads of 128 channels, q/k norms
    "qwen3-30b-a3b": lambda: _llama_style(hidden=2048, layers=48, heads=32, groups=4, ffn=6144, vocab=151936,
                                          seq=4096, theta=1000000.0, eps=1e-6, kv_channels=128, qk_norm=True,
                                          num_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
                                          moe_aux_loss_coeff=0.001),
}

# Exact published counts where one exists (Hugging Face checkpoints); the large
# GPT-style models are published only by their nominal size.
PUBLISHED_PARAMS: Dict[str, int] = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616,
}
# Published rounded, in billions (the model cards' totals); the tests check the exact count rounds to them.
ROUNDED_PARAMS: Dict[str, str] = {
    "llama3-8b": "8.03",
    "llama3-70b": "70.6",
    "mistral-7b": "7.24",
    "qwen2-7b": "7.62",
    "mistral-nemo-12b": "12.2",
    "qwen3-0.6b": "0.6",
    "mixtral-8x7b": "46.7",
    "qwen3-30b-a3b": "30.5",
}
NOMINAL_PARAMS: Dict[str, float] = {
    "megatron-8.3b": 8.3e9,
    "turing-nlg-17b": 17.0e9,
    "gpt3-175b": 175.0e9,
}


def list_presets() -> List[str]:
    return list(_PRESETS)


def get_preset(name: str, **overrides) -> GPTConfig:
    """A new :class:`GPTConfig` for preset ``name``, with ``overrides`` applied (validated at tp=1)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(_PRESETS)}")
    config = _PRESETS[name]()
    if overrides:
        config = config.replace(**overrides)
    return config.validate(1)
