"""YaRN configs through the Hugging Face converters (issue 50, item 6).

Acceptance: a Qwen2/Llama config with YaRN scaling imports, and its logits match ``transformers`` at positions
past the original context. Tiny models from configs (no download): original context 16, sequences of 64, so
three quarters of the positions lie past it; head dim 32, so the ramp keeps pair 0, blends pair 1 and divides
the rest. Logits are compared as tests/model_zoo/test_hf_parity.py does: ours in fp32 against transformers in
float64, within :func:`tests.numerics.transformer_bound` of the exact logits each. Then the export: config.json
carries the yarn parameters transformers reads back to the same logits, and they import again unchanged.
"""

import json

import pytest
import torch

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.consolidate import CheckpointSource
from hybrid.convert.hf import export_to_hf, import_from_hf
from hybrid.convert.hf_llama import LLAMA, QWEN2
from model_zoo import GPTConfig
from model_zoo.rope import rope_attention_factor
from tests.convert.common import model_from_state
from tests.numerics import record, transformer_bound

transformers = pytest.importorskip("transformers")

VOCAB, ORIGINAL, SEQ = 300, 16, 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# Qwen2 as Qwen2.5 ships it (factor and original context, the rest transformers' defaults, the old "type" key);
# Llama with DeepSeek's attention-factor ratio and explicit betas.
KINDS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1, rope_theta=10000.0,
                                                       rope_scaling={"type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": ORIGINAL})),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=10000.0,
                                                       rope_scaling=dict(YARN, beta_fast=16.0, beta_slow=2.0,
                                                                         mscale=1.0, mscale_all_dim=0.5))),
}


def _hf_model(kind: str):
    config_cls, model_cls, extra = KINDS[kind]
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=SEQ,
                                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
                                            eos_token_id=0, **extra)
    model = getattr(transformers, model_cls)(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # fresh norms are ones and biases zeros: make a misplaced one visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _imported(path):
    reader = CheckpointReader(path)
    with CheckpointSource(reader) as src:
        state = {name: src.read(name) for name in src.tensors}
    return GPTConfig.from_dict(reader.model_config), state


def _logits(cfg: GPTConfig, state) -> torch.Tensor:
    model = model_from_state(cfg, state)
    with torch.no_grad():
        return model.gather_logits(model(_tokens()))


def _error_past_context(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| over the positions past the original context."""
    got, ref = got[:, ORIGINAL:].double(), ref[:, ORIGINAL:]
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_yarn_config_imports_and_matches_transformers_past_the_original_context(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=1)
    cfg, state = _imported(tmp_path / "ck")
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions, cfg.seq_length) == \
        ("yarn", 4.0, ORIGINAL, SEQ)
    if kind == "llama":
        assert (cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow, cfg.rope_yarn_mscale,
                cfg.rope_yarn_mscale_all_dim) == (16.0, 2.0, 1.0, 0.5)
    assert rope_attention_factor(cfg) == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-15)
    with torch.no_grad():
        ref = hf.double()(input_ids=_tokens()).logits
    got = _logits(cfg, state)
    # fp32 against float64: each within its own bound of the exact logits
    bound = sum(transformer_bound(cfg, got.shape[0] * SEQ, part="logits", dtype=dt)
                for dt in (torch.float32, torch.float64))
    err = _error_past_context(got, ref)
    assert record(err / bound) <= 1, f"logits past the original context differ: {err:.2e} > {bound:.2e}"
    # the check can fail: without the scaling, or without the attention factor, the same weights miss by more
    # than 10 bounds (random weights attend almost uniformly, which hides positions: 13 to 69 bounds measured,
    # the import's own error 2e-3 of one)
    for wrong in (cfg.replace(rope_scaling="none"), cfg.replace(rope_attention_factor=1.0)):
        assert _error_past_context(_logits(wrong, state), ref) > 10 * bound


def test_the_export_writes_yarn_that_transformers_reads_and_imports_back(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=2)
    export_to_hf(tmp_path / "ck", tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                                       "original_max_position_embeddings": ORIGINAL, "mscale": 1.0,
                                       "mscale_all_dim": 0.5}
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.model.rotary_emb.attention_scaling == hf.model.rotary_emb.attention_scaling
    assert torch.equal(back.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=_tokens()).logits, back(input_ids=_tokens()).logits)
    import_from_hf(tmp_path / "back", tmp_path / "ck2", tp=1)
    assert _imported(tmp_path / "ck2")[0] == _imported(tmp_path / "ck")[0]


# config.json rope parameters -> the GPTConfig fields they import as -> the rope_scaling they export as (what
# transformers reads the same way)
BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 4096, "rope_theta": 10000.0}
CONFIGS = [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 1024,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}},
     dict(rope_scaling_factor=40.0, rope_original_max_positions=1024, rope_yarn_mscale=0.707,
          rope_yarn_mscale_all_dim=0.707),
     {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
      "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # truncate false and an explicit attention factor (newer transformers' rope_parameters)
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "truncate": False,
                          "original_max_position_embeddings": 128, "attention_factor": 1.25}},
     dict(rope_theta=150000.0, rope_scaling_factor=32.0, rope_original_max_positions=128,
          rope_yarn_truncate=False, rope_attention_factor=1.25),
     {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
      "beta_slow": 1.0, "attention_factor": 1.25, "truncate": False}),
    # mscale without mscale_all_dim counts for nothing in transformers (the attention factor is 0.1 ln(factor) +
    # 1), and so it imports
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                       "mscale": 0.707}},
     dict(rope_scaling_factor=4.0, rope_original_max_positions=1024),
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
      "beta_slow": 1.0}),
    # a top-level original context (as Phi-3 writes it) wins over the parameters'
    ({"original_max_position_embeddings": 512,
      "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}},
     dict(rope_scaling_factor=8.0, rope_original_max_positions=512),
     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
      "beta_slow": 1.0}),
]


@pytest.mark.parametrize("extra,fields,exported", CONFIGS)
def test_yarn_parameters_import_as_transformers_reads_them_and_export_back(extra, fields, exported):
    hf = dict(BASE, **extra)
    cfg = LLAMA.config_from_hf(hf, "config.json").validate()
    for key, value in fields.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rope_scaling == "yarn"
    # transformers computes the same frequencies and attention factor from the same dict
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from model_zoo.rope import rope_inv_freq

    theirs = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    assert factor == pytest.approx(rope_attention_factor(cfg), rel=1e-15)
    assert ((rope_inv_freq(cfg) - inv_freq).abs() / inv_freq).max().item() <= 16 * torch.finfo(torch.float32).eps
    out = LLAMA.hf_config(cfg, "float32")
    assert out["rope_scaling"] == exported
    assert out["rope_parameters"] == dict(exported, rope_theta=cfg.rope_theta)
    assert LLAMA.config_from_hf(out, "exported config.json") == cfg
