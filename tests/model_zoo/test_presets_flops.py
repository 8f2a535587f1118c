"""Presets, parameter counts and model FLOPs."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hybrid.topology import Topology
from model_zoo import (GPTConfig, GPTModel, count_model_parameters, count_parameters, flops_per_token, get_preset,
                       list_presets, matmul_parameters)
from model_zoo.presets import NOMINAL_PARAMS, PUBLISHED_PARAMS, ROUNDED_PARAMS

REQUIRED = ("tiny", "llama-tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "megatron-8.3b",
            "turing-nlg-17b", "gpt3-175b", "llama-7b", "tiny-gqa", "llama3-8b", "llama3-70b", "mistral-7b",
            "qwen2-7b", "mistral-nemo-12b", "qwen3-0.6b")


def test_every_required_preset_exists():
    assert set(REQUIRED) <= set(list_presets())


@pytest.mark.parametrize("name", REQUIRED)
def test_count_formula_matches_meta_model_and_publication(name):
    cfg = get_preset(name)
    model = GPTModel(cfg, Topology.local(), device="meta")
    assert all(p.is_meta for p in model.parameters())
    built = count_model_parameters(model, 1)
    assert built == count_parameters(cfg)
    if name in PUBLISHED_PARAMS:
        assert built == PUBLISHED_PARAMS[name]
    if name in ROUNDED_PARAMS:  # "8.03" (billions): the exact count rounds to it at its precision
        published = ROUNDED_PARAMS[name]
        assert f"{built / 1e9:.{len(published.split('.')[1])}f}" == published, built
    if name in NOMINAL_PARAMS:
        assert abs(built / NOMINAL_PARAMS[name] - 1) < 0.02, built


def test_preset_shapes():
    tnlg = get_preset("turing-nlg-17b")
    assert (tnlg.num_layers, tnlg.hidden_size, tnlg.num_heads, tnlg.seq_length) == (78, 4256, 28, 1024)
    mega = get_preset("megatron-8.3b")
    assert (mega.num_layers, mega.hidden_size, mega.num_heads) == (72, 3072, 24)
    llama = get_preset("llama-7b")
    assert (llama.position, llama.norm, llama.mlp, llama.bias, llama.tie_embeddings) == (
        "rope", "rmsnorm", "swiglu", False, False)
    for name, groups in (("llama3-8b", 8), ("llama3-70b", 8), ("mistral-7b", 8), ("qwen2-7b", 4), ("tiny-gqa", 2),
                         ("mistral-nemo-12b", 8), ("qwen3-0.6b", 8)):
        cfg = get_preset(name)
        assert (cfg.query_groups, cfg.attention_bias) == (groups, name == "qwen2-7b"), name
    nemo = get_preset("mistral-nemo-12b")
    assert (nemo.head_dim, nemo.attention_width, nemo.hidden_size) == (128, 4096, 5120)
    qwen3 = get_preset("qwen3-0.6b")
    assert (qwen3.head_dim, qwen3.attention_width, qwen3.qk_norm, qwen3.tie_embeddings) == (128, 2048, True, True)
    tiny = get_preset("tiny")
    assert count_parameters(tiny) < 5_000_000 and tiny.seq_length <= 128


def test_get_preset_overrides_and_errors():
    assert get_preset("tiny", num_layers=2).num_layers == 2
    a, b = get_preset("tiny"), get_preset("tiny")
    a.num_layers = 1
    assert b.num_layers != 1
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*tiny"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="unknown GPTConfig keys \\['n_layer'\\]"):
        get_preset("tiny", n_layer=3)
    with pytest.raises(ValueError, match="num_heads=8 must be divisible by the tensor-parallel size tp=3"):
        get_preset("tiny").validate(3)


# Hand count for h=8, L=2, f=32, V=10, s=4:
#   per layer: qkv 8*24 = 192, out 8*8 = 64, MLP (GELU) 8*32 + 32*8 = 512   -> 768
#   (SwiGLU) 2*32*8 + 32*8 = 768                                             -> 1024
#   LM head 10*8 = 80
#   GELU:   N = 2*768 + 80 = 1616,  6N = 9696,  attention 12*L*s*h = 12*2*4*8 = 768  -> 10464
#   SwiGLU: N = 2*1024 + 80 = 2128, 6N = 12768, attention 768                       -> 13536
# Multi-query (1 key/value head of d=4): qkv 8*(8 + 2*4) = 128 instead of 192 -> per layer 960,
#   N = 2*960 + 80 = 2000, 6N = 12000, attention 768 (the query side is unchanged)  -> 12768
# Head dim 6 (kv_channels): 2 heads of 6 = 12 attention channels, not 8: qkv 8*(12 + 2*12) = 288 (k and v
#   have 2 heads of 6 too), out 12*8 = 96, MLP 512 -> per layer 896,
#   N = 2*896 + 80 = 1872, 6N = 11232, attention 12*L*s*12 = 1152                   -> 12384
# (N_matmul, flops per token, the attention term at s = 4)
HAND = {"gelu": (1616, 10464, 768), "swiglu": (2128, 13536, 768), "swiglu-mqa": (2000, 12768, 768),
        "gelu-head-dim": (1872, 12384, 1152)}


@pytest.mark.parametrize("variant", list(HAND))
def test_flops_per_token_matches_hand_count_and_measured_matmuls(variant):
    mlp = variant.split("-")[0]
    extra = {} if mlp == "gelu" else dict(position="rope", norm="rmsnorm", bias=False, tie_embeddings=False)
    if variant == "swiglu-mqa":
        extra["num_query_groups"] = 1
    if variant == "gelu-head-dim":
        extra["kv_channels"] = 6
    cfg = GPTConfig(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, ffn_hidden_size=32, seq_length=4,
                    vocab_pad_multiple=1, mlp=mlp, **extra)
    n_matmul, total, attention = HAND[variant]
    assert matmul_parameters(cfg) == n_matmul
    assert flops_per_token(cfg) == total
    assert flops_per_token(cfg, seq_length=8) == total + attention  # the attention term doubles with s

    # torch's FLOP counter sees every linear (not the CPU attention kernel): 6N per token.
    model = GPTModel(cfg, Topology.local())
    ids = torch.randint(0, 10, (3, 4), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).backward()
    assert counter.get_total_flops() == 6 * n_matmul * ids.numel()


def test_docs_preset_table_lists_every_preset_with_the_computed_count():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "model_zoo.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0].startswith("`") and cells[0].strip("`") in list_presets():
            rows[cells[0].strip("`")] = cells[8]
    assert set(rows) == set(list_presets())
    for name, cell in rows.items():
        total, _, active = cell.partition(" (")  # an MoE preset: "total (active, rounded or exact)"
        config = get_preset(name)
        assert int(total.replace(",", "")) == count_parameters(config), name
        if config.is_moe:
            from model_zoo.flops import active_parameters

            figure = active.split(" ")[0]
            want = active_parameters(config)
            if figure.endswith("B"):
                digits = len(figure[:-1].split(".")[1])
                assert figure[:-1] == f"{want / 1e9:.{digits}f}", name
            else:
                assert int(figure.replace(",", "")) == want, name
