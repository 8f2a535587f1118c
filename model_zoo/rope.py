"""Rotary position embeddings (the Llama convention: rotate halves, not interleaved pairs) and their scaling.

:func:`rope_inv_freq` gives the rotation frequencies a :class:`~model_zoo.config.GPTConfig` asks for
(``rope_theta``, ``rope_scaling``), :func:`rope_attention_factor` the factor YaRN puts on cos and sin,
:func:`rope_cos_sin` the (scaled) cos and sin of given positions, and :func:`apply_rope` rotates query or key
heads by them.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from model_zoo.config import GPTConfig

Rope = Optional[Tuple[torch.Tensor, torch.Tensor]]


def rope_inv_freq(config: GPTConfig, device=None) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies ``theta^(-2i/d)`` (fp32), scaled as ``config.rope_scaling`` says.

    ``linear``: all divided by ``rope_scaling_factor``. ``llama3`` (the Llama 3.1
    rule): with wavelength ``w = 2 pi / f`` and ``L = rope_original_max_positions``,
    frequencies with ``w > L / low_freq_factor`` are divided by the factor,
    those with ``w < L / high_freq_factor`` kept, and those between blended:
    ``(1 - a) f / factor + a f`` with ``a = (L / w - low) / (high - low)``.
    ``yarn``: see :func:`yarn_ramp`.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
    factor = config.rope_scaling_factor
    if config.rope_scaling == "linear":
        return inv_freq / factor
    if config.rope_scaling == "llama3":
        low, high, context = config.rope_low_freq_factor, config.rope_high_freq_factor, \
            config.rope_original_max_positions
        wavelen = 2 * math.pi / inv_freq
        blend = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
        return (1 - blend) * inv_freq / factor + blend * inv_freq
    if config.rope_scaling == "yarn":
        ramp = yarn_ramp(config).to(device)
        return ramp * inv_freq / factor + (1 - ramp) * inv_freq
    return inv_freq


def yarn_ramp(config: GPTConfig) -> torch.Tensor:
    """YaRN's "NTK-by-parts" blend, ``[head_dim / 2]`` fp32: 0 where a frequency is kept, 1 where it is divided
    by ``rope_scaling_factor``, linear in the pair index ``i`` in between.

    Pair ``i`` turns ``L / (2 pi theta^(2i/d))`` times over the original context ``L =
    rope_original_max_positions``; the index at which that count is ``r`` is ``d ln(L / (2 pi r)) / (2 ln
    theta)``. The ramp runs from the index of ``r = rope_yarn_beta_fast`` (faster pairs are kept: they
    already turned many times within ``L``) to that of ``r = rope_yarn_beta_slow`` (slower ones are
    interpolated), the two ends rounded down and up to whole indices when ``rope_yarn_truncate``, clipped to
    ``[0, d - 1]``; equal ends are 0.001 apart.
    """
    d, theta, context = config.head_dim, config.rope_theta, config.rope_original_max_positions

    def index_of(turns: float) -> float:
        return d * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_of(config.rope_yarn_beta_fast), index_of(config.rope_yarn_beta_slow)
    if config.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    return ((torch.arange(d // 2, dtype=torch.float) - low) / (high - low)).clamp(0.0, 1.0)


def _yarn_mscale(factor: float, m: float) -> float:
    """The YaRN paper's ``sqrt(1/t) = 0.1 m ln(s) + 1`` for a scale ``s > 1`` (1 otherwise)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_attention_factor(config: GPTConfig) -> float:
    """The factor on cos and sin (so ``factor^2`` on every query-key product of the rotated dims): 1 unless
    ``config.rope_scaling`` is ``yarn``; then ``rope_attention_factor`` where set, else ``mscale(s, m1) /
    mscale(s, m2)`` with ``s = rope_scaling_factor``, ``m1 = rope_yarn_mscale``, ``m2 = rope_yarn_mscale_all_dim``
    (``mscale(s, 0) = 1``), the rule of Hugging Face and Megatron-Core (model_zoo.config.yarn_problem refuses
    the pairs where they differ).

    DeepSeek's multi-latent attention also multiplies its softmax scale by ``mscale(s, m2)^2``; that belongs to
    an attention with unrotated query-key dims, which model_zoo's has not, and Hugging Face's Llama and Qwen
    classes do not apply it either.
    """
    if config.rope_scaling != "yarn":
        return 1.0
    if config.rope_attention_factor is not None:
        return float(config.rope_attention_factor)
    s = config.rope_scaling_factor
    return _yarn_mscale(s, config.rope_yarn_mscale) / _yarn_mscale(s, config.rope_yarn_mscale_all_dim)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 attention_factor: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[b, 1, s, head_dim]`` for ``position_ids`` ``[b, s]``, computed in fp32, each times
    ``attention_factor`` (:func:`rope_attention_factor`) before the cast to ``dtype``."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, d]`` by the angles in ``cos``/``sin`` ``[b, 1, s, d]``."""
    return x * cos + _rotate_half(x) * sin
