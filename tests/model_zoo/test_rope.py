"""RoPE frequencies and rotations against a float64 implementation written here from the published rules.

* theta: ``f_i = theta^(-2i/d)`` (RoFormer);
* linear ("position interpolation"): every ``f_i / factor``;
* llama3 (Meta's Llama 3.1 ``apply_scaling``): with ``w = 2 pi / f`` and the
  original context ``L``, keep ``f`` when ``w < L / high_freq_factor``, use
  ``f / factor`` when ``w > L / low_freq_factor``, else
  ``(1 - a) f / factor + a f`` with ``a = (L / w - low) / (high - low)``.

The model computes in fp32: each frequency is a few roundings from the exact
value (a power, a division, the blend), so 8 fp32 epsilons relative bound it.
"""

import math

import pytest
import torch

from model_zoo import GPTConfig
from model_zoo.rope import apply_rope, rope_cos_sin, rope_inv_freq

EPS32 = torch.finfo(torch.float32).eps
BASE = dict(vocab_size=64, hidden_size=256, num_layers=1, num_heads=2, position="rope", rope_theta=500000.0)


def _reference_freqs(d, theta, scaling="none", factor=1.0, low=1.0, high=4.0, context=8192):
    out = []
    for i in range(0, d, 2):
        f = theta ** (-i / d)
        if scaling == "linear":
            f = f / factor
        elif scaling == "llama3":
            w = 2 * math.pi / f
            if w < context / high:
                pass
            elif w > context / low:
                f = f / factor
            else:
                a = (context / w - low) / (high - low)
                f = (1 - a) * f / factor + a * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scaling", [
    dict(),
    dict(rope_theta=10000.0),
    dict(rope_scaling="linear", rope_scaling_factor=4.0),
    # The published Llama 3.1 settings, and a short context so that every regime occurs among 64 frequencies.
    dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
         rope_original_max_positions=8192),
    dict(rope_scaling="llama3", rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
         rope_original_max_positions=64),
])
def test_frequencies_match_the_published_rules(scaling):
    cfg = GPTConfig(**dict(BASE, **scaling)).validate()
    want = _reference_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
                            cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_positions)
    got = rope_inv_freq(cfg).double()
    assert got.shape == want.shape == (cfg.head_dim // 2,)
    assert ((got - want).abs() / want).max().item() <= 8 * EPS32
    if cfg.rope_scaling == "llama3":  # the case covers kept, divided and blended frequencies
        w = 2 * math.pi / _reference_freqs(cfg.head_dim, cfg.rope_theta)
        ctx = cfg.rope_original_max_positions
        assert (w < ctx / 4).any() and (w > ctx).any() and ((w >= ctx / 4) & (w <= ctx)).any()


def test_rotation_is_the_rotate_half_convention():
    # x_i and x_{i + d/2} rotate as one pair by angle p * f_i.
    cfg = GPTConfig(**dict(BASE, rope_scaling="llama3", rope_scaling_factor=8.0,
                           rope_original_max_positions=64)).validate()
    d = cfg.head_dim
    x = torch.randn(1, 2, 40, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pos = torch.arange(40).unsqueeze(0)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(cfg), torch.float64)
    got = apply_rope(x, cos, sin)
    f = _reference_freqs(d, cfg.rope_theta, "llama3", 8.0, 1.0, 4.0, 64)
    angle = pos[0, :, None].double() * f  # [s, d/2]
    a, b = x[..., : d // 2], x[..., d // 2:]
    want = torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)
    # The angles are computed in fp32 (p * f with p < 40): an error of ~40 * 2 eps32 radians at most.
    assert (got - want).abs().max().item() <= 100 * EPS32 * x.abs().max().item()


def test_bad_scaling_settings_are_refused():
    with pytest.raises(ValueError, match="rope_scaling='dynamic' is not one of none, linear, llama3, yarn"):
        GPTConfig(**dict(BASE, rope_scaling="dynamic")).validate()
    with pytest.raises(ValueError, match="rope_low_freq_factor < rope_high_freq_factor"):
        GPTConfig(**dict(BASE, rope_scaling="llama3", rope_low_freq_factor=4.0)).validate()
