"""Rotary position embeddings (the Llama convention: rotate halves, not interleaved pairs) and their scaling.

:func:`rope_inv_freq` gives the rotation frequencies a :class:`~model_zoo.config.GPTConfig` asks for
(``rope_theta``, ``rope_scaling``), :func:`rope_cos_sin` the angles of given positions, and
:func:`apply_rope` rotates query or key heads by them.
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
    return inv_freq


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> Tuple[
        torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[b, 1, s, head_dim]`` for ``position_ids`` ``[b, s]``, computed in fp32."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, d]`` by the angles in ``cos``/``sin`` ``[b, 1, s, d]``."""
    return x * cos + _rotate_half(x) * sin
