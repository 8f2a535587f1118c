"""YaRN RoPE scaling (issue 50, item 6): frequencies, attention factor and cos/sin against ``transformers``
and against a float64 implementation written here from the paper's rules; a RoPE change on load.

YaRN ("NTK-by-parts", Peng et al. 2023, section 3.2 and eq. 21): pair ``i`` of a head of ``d`` channels
turns ``r_i = L theta^(-2i/d) / (2 pi)`` times over the original context ``L``. With ``s`` the factor,
pairs that turn more than ``beta_fast`` times keep ``f_i``, pairs that turn fewer than ``beta_slow`` times
get ``f_i / s``, and in between (by index, between the indices where ``r = beta_fast`` and ``r = beta_slow``,
rounded outwards unless ``truncate`` is false) the blend is linear. ``cos`` and ``sin`` are multiplied by
``0.1 m ln(s) + 1`` (``m = 1``), or its ratio for ``mscale``/``mscale_all_dim`` (DeepSeek), or an explicit
``attention_factor``.

Bounds: each frequency is a few fp32 roundings from the exact value (a power, a division, the ramp, the
blend), so 8 fp32 epsilons relative; transformers computes in fp32 too, so ours and theirs are within two
such bounds of each other. The attention factor is a Python float on both sides: 4 float64 epsilons.
"""

import math

import pytest
import torch

from model_zoo import GPTConfig
from model_zoo.config import load_conflicts, load_notes
from model_zoo.rope import apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq, yarn_ramp

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps

# name -> (head_dim, theta, HF rope_scaling, GPTConfig fields). Qwen2.5's published YaRN (factor 4 over 32K,
# head dim 128, base 1e6), DeepSeek-V3's (factor 40 over 4K, rotary head dim 64, mscale = mscale_all_dim = 1:
# attention factor 1) and DeepSeek-V2's (mscale = mscale_all_dim = 0.707); gpt-oss's (truncate false); an
# explicit attention factor; and a short context where the ramp covers several indices.
CASES = {
    "qwen2.5": (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768},
                dict(rope_scaling_factor=4.0, rope_original_max_positions=32768)),
    "deepseek-v3": (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                    dict(rope_scaling_factor=40.0, rope_original_max_positions=4096, rope_yarn_mscale=1.0,
                         rope_yarn_mscale_all_dim=1.0)),
    "deepseek-v2": (64, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                                  "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
                    dict(rope_scaling_factor=40.0, rope_original_max_positions=4096, rope_yarn_mscale=0.707,
                         rope_yarn_mscale_all_dim=0.707)),
    "mscale-ratio": (64, 10000.0, {"factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                                   "mscale_all_dim": 0.5},
                     dict(rope_scaling_factor=16.0, rope_original_max_positions=4096, rope_yarn_mscale_all_dim=0.5)),
    "gpt-oss": (64, 150000.0, {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False},
                dict(rope_scaling_factor=32.0, rope_original_max_positions=4096, rope_yarn_truncate=False)),
    "attention-factor": (64, 10000.0, {"factor": 8.0, "original_max_position_embeddings": 64,
                                       "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0},
                         dict(rope_scaling_factor=8.0, rope_original_max_positions=64, rope_attention_factor=1.3,
                              rope_yarn_beta_fast=16.0, rope_yarn_beta_slow=2.0)),
}


def _config(head_dim: int, theta: float, fields: dict) -> GPTConfig:
    return GPTConfig(vocab_size=64, hidden_size=2 * head_dim, num_layers=1, num_heads=2, position="rope",
                     rope_theta=theta, rope_scaling="yarn", **fields).validate()


def _transformers(head_dim: int, theta: float, hf_scaling: dict):
    """transformers' (inv_freq fp32, attention factor) for these parameters, through a Qwen2 config."""
    cfg = transformers.Qwen2Config(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                                   rope_theta=theta, max_position_embeddings=4 * hf_scaling[
                                       "original_max_position_embeddings"],
                                   rope_scaling={"rope_type": "yarn", **hf_scaling})
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


def _reference(d, theta, s, context, beta_fast=32.0, beta_slow=1.0, truncate=True, mscale=1.0, mscale_all_dim=0.0,
               attention_factor=None):
    """float64 frequencies and attention factor from the rules in the module docstring."""
    def index(turns):  # r_i = turns  <=>  i = d ln(L / (2 pi turns)) / (2 ln theta)
        return d * math.log(context / (2 * math.pi * turns)) / (2 * math.log(theta))

    low, high = index(beta_fast), index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if high == low else high
    freqs = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        a = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: divide
        freqs.append(a * f / s + (1 - a) * f)

    def m(k):
        return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0

    factor = attention_factor if attention_factor is not None else m(mscale) / (m(mscale_all_dim)
                                                                               if mscale_all_dim else 1.0)
    return torch.tensor(freqs, dtype=torch.float64), factor, (low, high)


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_attention_factor_match_transformers_and_the_rules(name):
    head_dim, theta, hf_scaling, fields = CASES[name]
    cfg = _config(head_dim, theta, fields)
    got = rope_inv_freq(cfg).double()
    want, want_factor, (low, high) = _reference(
        head_dim, theta, cfg.rope_scaling_factor, cfg.rope_original_max_positions, cfg.rope_yarn_beta_fast,
        cfg.rope_yarn_beta_slow, cfg.rope_yarn_truncate, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim,
        cfg.rope_attention_factor)
    theirs, their_factor = _transformers(head_dim, theta, hf_scaling)
    assert got.shape == want.shape == theirs.shape == (head_dim // 2,)
    assert ((got - want).abs() / want).max().item() <= 8 * EPS32
    assert ((got - theirs.double()).abs() / want).max().item() <= 16 * EPS32
    assert abs(rope_attention_factor(cfg) - want_factor) <= 4 * EPS64 * want_factor
    assert abs(rope_attention_factor(cfg) - their_factor) <= 4 * EPS64 * want_factor
    # each case keeps some frequencies and divides others (the ramp sits inside the head)
    ramp = yarn_ramp(cfg)
    assert (ramp == 0).any() and (ramp == 1).any(), ramp


def test_the_ramp_blends_between_its_ends_and_truncate_moves_them():
    head_dim, theta, _, fields = CASES["gpt-oss"]
    exact = yarn_ramp(_config(head_dim, theta, fields))
    rounded = yarn_ramp(_config(head_dim, theta, dict(fields, rope_yarn_truncate=True)))
    blended = (exact > 0) & (exact < 1)
    assert blended.sum() >= 2 and not torch.equal(exact, rounded)
    # the attention-factor case has a blended stretch too, kept below it and divided above it
    head_dim, theta, _, fields = CASES["attention-factor"]
    ramp = yarn_ramp(_config(head_dim, theta, fields))
    inside = ((ramp > 0) & (ramp < 1)).nonzero().flatten()
    assert len(inside) >= 2 and (ramp[: inside[0]] == 0).all() and (ramp[inside[-1] + 1:] == 1).all()
    assert (ramp[inside].diff() > 0).all()


def test_no_other_scaling_has_an_attention_factor():
    for scaling in ("none", "linear", "llama3"):
        cfg = GPTConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, position="rope",
                        rope_scaling=scaling, rope_scaling_factor=4.0, rope_attention_factor=1.5).validate()
        assert rope_attention_factor(cfg) == 1.0


def test_cos_sin_carry_the_attention_factor_as_transformers_rotary_embedding_does():
    # Qwen2's rotary embedding at positions up to 4x past the original context of 64.
    head_dim, theta, hf_scaling, fields = CASES["attention-factor"]
    hf_scaling, fields = dict(hf_scaling, attention_factor=None), dict(fields, rope_attention_factor=None)
    cfg = _config(head_dim, theta, fields)
    hf_cfg = transformers.Qwen2Config(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                                      rope_theta=theta, max_position_embeddings=512,
                                      rope_scaling={"rope_type": "yarn", **hf_scaling})
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    pos = torch.arange(0, 256).unsqueeze(0)
    x = torch.zeros(1, 2, 256, head_dim)
    their_cos, their_sin = Qwen2RotaryEmbedding(hf_cfg)(x, pos)  # [b, s, d]
    factor = rope_attention_factor(cfg)
    assert factor == pytest.approx(0.1 * math.log(8.0) + 1.0, rel=4 * EPS64)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(cfg), torch.float32, factor)
    assert cos.shape == (1, 1, 256, head_dim)
    # fp32 angles p * f for p < 256: both sides round the same products (a few eps32 of the angle each)
    bound = 4 * 256 * EPS32 * factor
    assert (cos[:, 0] - their_cos).abs().max().item() <= bound
    assert (sin[:, 0] - their_sin).abs().max().item() <= bound
    # the factor scales the rotation: |rotate(x)| = factor |x| for every pair
    q = torch.randn(1, 2, 256, head_dim, generator=torch.Generator().manual_seed(0))
    ratio = apply_rope(q, cos, sin).norm(dim=-1) / q.norm(dim=-1)
    assert (ratio - factor).abs().max().item() <= 64 * EPS32


def test_bad_yarn_settings_are_refused_naming_the_keys():
    base = dict(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, position="rope", rope_scaling="yarn",
                rope_scaling_factor=4.0)
    with pytest.raises(ValueError, match="rope_yarn_beta_slow <= rope_yarn_beta_fast"):
        GPTConfig(**base, rope_yarn_beta_fast=1.0, rope_yarn_beta_slow=32.0).validate()
    # the one pair on which transformers and Megatron-Core would compute different factors
    with pytest.raises(ValueError, match="rope_yarn_mscale=0.707 with rope_yarn_mscale_all_dim=0"):
        GPTConfig(**base, rope_yarn_mscale=0.707).validate()
    with pytest.raises(ValueError, match="rope_attention_factor must be > 0"):
        GPTConfig(**base, rope_attention_factor=0.0).validate()


# ---- a RoPE change on load: a long-context phase continues a pretrained checkpoint ------------------------

def test_rope_settings_load_changed_with_a_note_naming_both_values():
    pretrained = GPTConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, position="rope",
                           seq_length=64, rope_theta=10000.0)
    long = pretrained.replace(seq_length=256, rope_theta=500000.0, rope_scaling="yarn", rope_scaling_factor=4.0,
                              rope_original_max_positions=64)
    assert load_conflicts(pretrained.to_dict(), long.to_dict()) == []
    notes = load_notes(pretrained.to_dict(), long.to_dict())
    assert notes == ["rope_theta: checkpoint 10000.0, now 500000.0", "rope_scaling: checkpoint 'none', now 'yarn'",
                     "rope_scaling_factor: checkpoint 1.0, now 4.0",
                     "rope_original_max_positions: checkpoint 8192, now 64"]
    # a checkpoint of a release before the yarn fields: they have their defaults, so no note
    older = {k: v for k, v in pretrained.to_dict().items() if not k.startswith("rope_yarn")}
    assert load_notes(older, pretrained.to_dict()) == [] and load_conflicts(older, pretrained.to_dict()) == []
    assert load_notes(pretrained.to_dict(), pretrained.to_dict()) == []
    # a shape still refuses; learned positions have no rotary settings to announce
    assert load_conflicts(pretrained.to_dict(), long.replace(hidden_size=64).to_dict()) == [
        "hidden_size: checkpoint 32, current model 64"]
    learned = pretrained.replace(position="learned")
    assert load_notes(learned.to_dict(), learned.replace(rope_theta=500000.0).to_dict()) == []


@pytest.mark.slow  # two trainer runs; load_notes' own test above is the default run's case
def test_the_trainer_continues_a_checkpoint_with_yarn_and_prints_the_change(tmp_path, monkeypatch, capsys):
    from tests.faults.test_seq_length_runtime import ROPE, _ok, _train

    save = tmp_path / "pre"
    _ok(_train(ROPE + ["--seq-length", "32", "--save", save], monkeypatch, capsys))
    code, err = _train(ROPE + ["--seq-length", "128", "--rotary-base", "500000", "--rope-scaling", "yarn",
                               "--rope-scaling-factor", "4", "--rope-original-max-positions", "32",
                               "--yarn-beta-fast", "16", "--load", save, "--finetune",
                               "--save", tmp_path / "long"], monkeypatch, capsys)
    _ok((code, err))
    notes = [line for line in err if "continues with other RoPE settings" in line]
    assert any("rope_theta: checkpoint 10000.0, now 500000.0" in n for n in notes), err[-20:]
    assert any("rope_scaling: checkpoint 'none', now 'yarn'" in n for n in notes)
    assert any("rope_yarn_beta_fast: checkpoint 32.0, now 16.0" in n for n in notes)
    assert (tmp_path / "long" / "latest").read_text().strip() == "iter_0000002"
