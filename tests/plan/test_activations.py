"""The activation formula against what autograd really saves (single process, TP = 1).

Multi-rank cases (TP = 2, sequence parallelism) are checked in ``test_truth.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid import Topology
from hybrid.plan.activations import CPU, CUDA, activation_bytes
from hybrid.plan.measure import SavedActivations, storage_keys
from model_zoo import GPTModel, get_preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _measure(config, precision: str, micro: int) -> int:
    torch.manual_seed(0)
    model = GPTModel(config, Topology.local()).to(DTYPES[precision])
    model.check_inputs = False
    ids = torch.randint(0, config.vocab_size, (micro, config.seq_length))
    with SavedActivations(storage_keys(model.parameters())) as saved:
        model(ids, ids)
    return saved.bytes


# (preset, its overrides): "tiny-gqa" once more with a head dim twice hidden / heads (kv_channels), so that the
# attention terms count a * d channels, not h, and with query/key norms (Qwen3); "tiny" with query/key LayerNorms
MODELS = {"tiny": ("tiny", {}), "llama-tiny": ("llama-tiny", {}), "tiny-gqa": ("tiny-gqa", {}),
          "tiny-gqa-head-dim": ("tiny-gqa", {"kv_channels": 32}),
          "tiny-qwen3": ("tiny-gqa", {"kv_channels": 32, "qk_norm": True}), "tiny-qk-norm": ("tiny", {"qk_norm": True})}
CASES = list(itertools.product(MODELS, ["fp32", "bf16"], ["none", "selective", "full"]))


@pytest.mark.parametrize("model,precision,recompute", CASES)
def test_formula_matches_saved_tensors(model, precision, recompute):
    dropout = 0.1 if precision == "fp32" else 0.0  # dropout masks and the math attention kernel in half the cases
    preset, overrides = MODELS[model]
    config = get_preset(preset, num_layers=2, seq_length=32, vocab_size=500, recompute=recompute,
                        hidden_dropout=dropout, attention_dropout=dropout, **overrides)
    for micro in (1, 3):
        measured = _measure(config, precision, micro)
        predicted = activation_bytes(config, micro, precision=precision, profile=CPU)
        expected = predicted.total - predicted.by_reference
        assert abs(measured - expected) <= 0.05 * expected, (model, precision, recompute, micro, measured, expected)


def test_recompute_and_sequence_parallel_shrink_activations_as_documented():
    config = get_preset("gpt2-medium")
    none = activation_bytes(config, 4, tp=4, recompute="none")
    full = activation_bytes(config, 4, tp=4, recompute="full")
    sp = activation_bytes(config, 4, tp=4, recompute="none", sequence_parallel=True)
    n_h = 4 * config.seq_length * config.hidden_size
    assert full.per_layer == 2 * n_h  # only the bf16 layer input survives
    # Under SP the residual-stream terms (norm inputs and statistics, dropout masks) split over the 4 ranks.
    saved_by_sp = none.per_layer - sp.per_layer
    assert saved_by_sp == 2 * (2 * n_h + 2 * 4 * n_h // config.hidden_size + n_h) * 3 // 4


def test_cuda_profile_keeps_one_byte_dropout_masks():
    with_drop = get_preset("tiny", hidden_dropout=0.1, attention_dropout=0.1)
    without = with_drop.replace(hidden_dropout=0.0, attention_dropout=0.0)
    n_h = 2 * with_drop.seq_length * with_drop.hidden_size
    masks = 2 * with_drop.num_layers + 1  # two per layer and one on the embeddings
    delta = activation_bytes(with_drop, 2, profile=CUDA).total - activation_bytes(without, 2, profile=CUDA).total
    assert delta == masks * n_h  # bool masks; attention dropout costs nothing extra in flash attention


def test_bad_arguments_are_named():
    config = get_preset("tiny")
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes(config, 1, recompute="sometimes")
    with pytest.raises(ValueError, match="micro batch"):
        activation_bytes(config, 0)
    with pytest.raises(ValueError, match="num_heads"):
        activation_bytes(config, 1, tp=3)


def test_gpu_layer_matches_the_published_34_sbh_without_the_attention_scores():
    """16-bit activations with dropout keep 34·s·b·h bytes per layer (the usual figure, whose 5·a·s²·b
    attention term flash attention removes), plus the log-sum-exp and the norm statistics."""
    config = get_preset("gpt2-medium")  # dropout 0.1, GELU, LayerNorm
    s, b, h, a = config.seq_length, 4, config.hidden_size, config.num_heads
    layer = activation_bytes(config, b, precision="bf16", profile=CUDA).per_layer
    assert layer == 34 * s * b * h + 4 * s * b * a + 2 * 2 * 4 * s * b
