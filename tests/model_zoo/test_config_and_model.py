"""GPTConfig validation, model input checks and single-process model behaviour."""

import pytest
import torch

from hybrid.topology import Topology
from model_zoo import GPTConfig, GPTModel, get_preset
from tests.numerics import cross_entropy_bounds, masked_mean_bound, record


def _cfg(**kw):
    base = dict(vocab_size=100, hidden_size=32, num_layers=1, num_heads=4, seq_length=16)
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize("kw, tp, message", [
    (dict(num_heads=6, hidden_size=36), 4, "num_heads=6 must be divisible by the tensor-parallel size tp=4"),
    (dict(ffn_hidden_size=66), 4, "ffn_hidden_size=66 must be divisible by the tensor-parallel size tp=4"),
    (dict(seq_length=18, sequence_parallel=True), 4,
     "seq_length=18 must be divisible by the tensor-parallel size tp=4 when sequence_parallel=True"),
    (dict(position="alibi"), 1, "position='alibi' is not one of learned, rope"),
    (dict(norm="batchnorm"), 1, "norm='batchnorm' is not one of layernorm, rmsnorm"),
    (dict(recompute="some"), 1, "recompute='some' is not one of none, full, selective"),
    (dict(hidden_dropout=1.0), 1, "hidden_dropout must be in \\[0, 1\\)"),
    (dict(vocab_size=0), 1, "vocab_size must be a positive integer"),
    (dict(max_position_embeddings=8), 1, "max_position_embeddings=8 is smaller than seq_length=16"),
    (dict(hidden_size=36, num_heads=12, position="rope"), 1, "even head dim"),
    (dict(hidden_size=30), 1, "hidden_size=30 must be divisible by num_heads=4, or kv_channels must give"),
    (dict(kv_channels=0), 1, "kv_channels must be a positive integer or None, got 0"),
    (dict(kv_channels=True), 1, "kv_channels must be a positive integer or None, got True"),
    (dict(kv_channels=7, position="rope"), 1, "rotary positions need an even head dim, but kv_channels = 7"),
])
def test_config_errors_name_the_key_and_rule(kw, tp, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw).validate(tp)


def test_kv_channels_sets_a_head_dim_apart_from_hidden_over_heads():
    cfg = _cfg(hidden_size=30, kv_channels=6).validate(2)  # 30 does not divide by 4 heads: kv_channels decides
    assert (cfg.head_dim, cfg.attention_width) == (6, 24)
    model = GPTModel(cfg, Topology.local())
    attention = model.layers[0].attention
    assert attention.qkv_proj.weight.shape == (3 * 24, 30) and attention.out_proj.weight.shape == (30, 24)
    assert model(torch.randint(0, 100, (2, 16))).shape[:2] == (2, 16)
    assert (_cfg().head_dim, _cfg().attention_width) == (8, 32)  # unset: hidden_size / num_heads


def test_config_round_trips_and_rejects_unknown_keys():
    cfg = get_preset("llama-tiny")
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GPTConfig keys \\['hidden'\\]"):
        GPTConfig.from_dict({**cfg.to_dict(), "hidden": 3})


def test_ffn_defaults():
    assert _cfg().ffn_size == 128
    assert _cfg(hidden_size=4096, num_heads=32, mlp="swiglu").ffn_size == 11008  # the Llama-7B width


def test_forward_input_errors():
    model = GPTModel(_cfg(), Topology.local())
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have the shape of input_ids"):
        model(ids, labels=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must lie in \\[0, vocab_size=100\\)"):
        model(ids + 100)
    with pytest.raises(ValueError, match="integer tensor"):
        model(ids.float())
    with pytest.raises(ValueError, match="target ids must lie in \\[0, vocab_size=100\\)"):
        model(ids, labels=ids - 1)


def test_loss_mask_and_mean():
    model = GPTModel(_cfg(init_std=0.2), Topology.local())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=g)
    labels = torch.randint(0, 100, (2, 8), generator=g)
    # The loss path sees these very logits (same forward, same kernels); only the cross entropy
    # and the mean differ from torch's float64 ones, within their fp32 rounding bound.
    logits = model.gather_logits(model(ids)).reshape(-1, 100)
    per_token = torch.nn.functional.cross_entropy(logits.double(), labels.reshape(-1), reduction="none")
    token_bound, _ = cross_entropy_bounds(logits, labels.reshape(-1), 100)
    mask = torch.zeros(2, 8)
    mask[0, :3] = 1
    plain = abs(model(ids, labels=labels).item() - per_token.mean().item())
    assert record(plain / masked_mean_bound(per_token, token_bound)) <= 1
    masked = abs(model(ids, labels=labels, loss_mask=mask).item() - per_token.view(2, 8)[0, :3].mean().item())
    assert record(masked / masked_mean_bound(per_token, token_bound, mask)) <= 1
    assert model(ids, labels=labels, loss_mask=torch.zeros(2, 8)).item() == 0.0


def test_meta_build_then_materialize_equals_direct_build():
    cfg = get_preset("llama-tiny", num_layers=2)
    direct = GPTModel(cfg, Topology.local(), seed=5)
    lazy = GPTModel(cfg, Topology.local(), device="meta", seed=5)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.materialize(device="cpu")
    assert not any(p.is_meta for p in lazy.parameters())
    a, b = dict(direct.named_parameters()), dict(lazy.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    assert torch.equal(direct(ids), lazy(ids))


def test_tied_model_materialized_from_meta_keeps_the_tie():
    cfg = get_preset("tiny", num_layers=1)
    model = GPTModel(cfg, Topology.local(), device="meta").materialize(device="cpu")
    assert model.lm_head is None and model.head_weight() is model.embedding.word_embeddings.weight


def test_initial_values_follow_the_recorded_initializers():
    cfg = _cfg(hidden_size=128, num_heads=4, num_layers=2, vocab_size=1000)
    model = GPTModel(cfg, Topology.local(), seed=1)
    params = dict(model.named_parameters())
    std = params["layers.0.attention.qkv_proj.weight"].std().item()
    out_std = params["layers.0.mlp.out_proj.weight"].std().item()
    assert abs(std / 0.02 - 1) < 0.02
    assert abs(out_std / (0.02 / 2.0) - 1) < 0.03  # std / sqrt(2 * 2 layers)
    assert torch.equal(params["layers.0.input_norm.weight"], torch.ones(128))
    assert torch.equal(params["layers.0.attention.qkv_proj.bias"], torch.zeros(384))
    emb = params["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 1024 and torch.equal(emb[1000:], torch.zeros(24, 128))  # padded rows
    # Distinct names give distinct draws; a different seed changes them.
    assert not torch.equal(params["layers.0.attention.qkv_proj.weight"], params["layers.1.attention.qkv_proj.weight"])
    other = GPTModel(cfg, Topology.local(), seed=2)
    assert not torch.equal(other.embedding.word_embeddings.weight, emb)


def test_eval_mode_is_deterministic_and_train_mode_drops():
    cfg = _cfg(hidden_dropout=0.3, attention_dropout=0.3)
    model = GPTModel(cfg, Topology.local())
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval()
    assert torch.equal(model(ids, labels=ids), model(ids, labels=ids))
    model.train()
    first, second = model(ids, labels=ids), model(ids, labels=ids)
    assert not torch.equal(first, second)  # the streams advance between steps
    before = torch.get_rng_state()
    model(ids, labels=ids)
    assert torch.equal(before, torch.get_rng_state())  # the model's dropout never touches the global stream


def test_query_groups_must_divide_the_heads_and_meet_tp_either_way():
    base = dict(vocab_size=64, hidden_size=96, num_layers=1, num_heads=12)
    for tp in (1, 2, 3, 6, 12):  # 3 groups: split over tp 1, 3; replicated over tp 6, 12
        if tp in (1, 3, 6, 12):
            GPTConfig(**base, num_query_groups=3).validate(tp)
    with pytest.raises(ValueError, match="GPTConfig.num_query_groups=3 and the tensor-parallel size tp=2 must "
                                         "divide one another"):
        GPTConfig(**base, num_query_groups=3).validate(2)
    with pytest.raises(ValueError, match="num_query_groups=5 must be a positive integer that divides num_heads=12"):
        GPTConfig(**base, num_query_groups=5).validate(1)


def test_trainer_flags_set_grouped_query_attention_rope_scaling_and_the_qkv_bias():
    from hybrid.training import parse_args
    from hybrid.training.model import model_config

    args = parse_args(["--model", "llama-tiny", "--num-query-groups", "2", "--rope-scaling", "llama3",
                       "--rope-scaling-factor", "8", "--rope-original-max-positions", "64", "--add-qkv-bias",
                       "--mock-data", "--micro-batch-size", "1", "--train-iters", "1"])
    cfg = model_config(args, 4096).validate(2)
    assert (cfg.query_groups, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions) == \
        (2, "llama3", 8.0, 64)
    assert cfg.attention_bias and not cfg.bias
