"""Hugging Face mixtures of experts: ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM``.

Tiny random models built from configs in ``transformers`` (no download):
HF -> hybrid (TP=2) -> HF is bit-identical in every tensor and the export
loads with the original's logits; transformers 5's fused expert tensors
import as the per-expert ones; the imported GPTModel's fp32 and float64
logits match ``transformers`` in float64 within the rounding bound
(:func:`_moe_logits_bound`), with every token's top-k choice checked to be
far from a tie; config.json <-> GPTConfig, including the presets.
"""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.consolidate import CheckpointSource, ConversionError
from hybrid.convert.hf import export_to_hf, import_from_hf, map_for_config
from hybrid.convert.hf_io import HFDirectory
from hybrid.convert.hf_moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from model_zoo import GPTConfig
from model_zoo.presets import get_preset
from tests.convert.common import SEQ, VOCAB, make_engine, model_from_state, randomized_state, train, \
    write_weights_checkpoint
from tests.numerics import ELEMENTARY, U64, record, transformer_bound, unit_roundoff

transformers = pytest.importorskip("transformers")

HIDDEN, EXPERTS, TOPK, BATCH = 64, 4, 2, 2
SEED = 0  # its smallest routing margin is 2.3e-3 of the largest router logit (_route_margin)
KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _hf_config(kind: str, **changes):
    """Mixtral: 2 layers of 4 experts of 48 (its intermediate_size), grouped-query attention. Qwen2-MoE: 2 MoE
    layers of 4 experts of 32 plus a gated shared expert of 80, q/k/v bias, multi-query, top-k weights as they
    are (norm_topk_prob false). Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers), heads of 12 with
    query/key norms, renormalised weights."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, num_experts_per_tok=TOPK,
                  router_aux_loss_coef=0.02, experts_implementation="eager")  # the plain loop (float64 too)
    if kind == "mixtral":
        kw = dict(common, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  num_local_experts=EXPERTS, rope_theta=1000000.0, sliding_window=None)
        return transformers.MixtralConfig(**dict(kw, **changes))
    qwen = dict(common, intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS, rope_theta=10000.0,
                use_sliding_window=False)
    if kind == "qwen2_moe":
        kw = dict(qwen, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  shared_expert_intermediate_size=80, norm_topk_prob=False)
        return transformers.Qwen2MoeConfig(**dict(kw, **changes))
    kw = dict(qwen, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
              norm_topk_prob=True, mlp_only_layers=[1])
    return transformers.Qwen3MoeConfig(**dict(kw, **changes))


def _hf_model(kind: str, seed: int = SEED, **changes):
    with torch.random.fork_rng():  # the same weights in every run: the routing margins are checked for these
        torch.manual_seed(seed)
        model = getattr(transformers, CLASSES[kind])(_hf_config(kind, **changes))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # fresh ones and zeros would hide a misplaced one
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                # Routers start at zero (Qwen) or small: scale them up so that the top-k choice is decided by
                # wide margins (checked in _route_margin), and a swapped expert changes the logits.
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def _tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _files(directory):
    from tests.convert.test_hf import _hf_tensors

    return _hf_tensors(directory)


def _checkpoint_state(path):
    with CheckpointSource(CheckpointReader(path)) as src:
        return {name: src.read(name) for name in src.tensors}


def _imported_config(path) -> GPTConfig:
    return GPTConfig.from_dict(CheckpointReader(path).model_config)


# ---- tensors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_hybrid_to_hf_is_bit_identical(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=2)
    cfg = _imported_config(tmp_path / "ck")
    assert cfg.num_experts == EXPERTS and cfg.moe_router_topk == TOPK and cfg.sequence_parallel
    export_to_hf(tmp_path / "ck", tmp_path / "back")
    a, b = _files(tmp_path / "hf"), _files(tmp_path / "back")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back_cfg["architectures"] == [CLASSES[kind]]
    back = type(hf).from_pretrained(tmp_path / "back", experts_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=_tokens()).logits, back(input_ids=_tokens()).logits)


def _expected_hybrid_names(kind: str):
    """The MoE tensors of layer 0 a hybrid checkpoint of ``kind`` holds, and the HF name each comes from."""
    prefix = "model.layers.0." + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {"layers.0.mlp.router.weight": [prefix + "gate.weight"]}
    for e in range(EXPERTS):
        out[f"layers.0.mlp.experts.{e}.in_proj.weight"] = [f"{prefix}experts.{e}.{gate}.weight",
                                                           f"{prefix}experts.{e}.{up}.weight"]
        out[f"layers.0.mlp.experts.{e}.out_proj.weight"] = [f"{prefix}experts.{e}.{down}.weight"]
    if kind == "qwen2_moe":
        out["layers.0.mlp.shared_expert.in_proj.weight"] = [prefix + "shared_expert.gate_proj.weight",
                                                            prefix + "shared_expert.up_proj.weight"]
        out["layers.0.mlp.shared_expert.out_proj.weight"] = [prefix + "shared_expert.down_proj.weight"]
        out["layers.0.mlp.shared_expert_gate.weight"] = [prefix + "shared_expert_gate.weight"]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_each_expert_lands_under_its_own_name(tmp_path, kind):
    # Written out by hand, so that a map that swaps two experts (or gate and up) in both directions is caught.
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=1)
    state, saved = _checkpoint_state(tmp_path / "ck"), _files(tmp_path / "hf")
    for name, sources in _expected_hybrid_names(kind).items():
        assert torch.equal(state[name], torch.cat([saved[s] for s in sources])), name
    if kind == "qwen3_moe":  # the dense middle layer keeps the dense MLP's names
        assert torch.equal(state["layers.1.mlp.out_proj.weight"], saved["model.layers.1.mlp.down_proj.weight"])
        assert not any(n.startswith("layers.1.mlp.experts") for n in state)


@pytest.mark.parametrize("kind,fmt", [("mixtral", "safetensors"), ("qwen2_moe", "bin"), ("qwen3_moe", "safetensors")])
def test_transformers5_fused_experts_import_as_the_per_expert_tensors(tmp_path, kind, fmt):
    """transformers 5 holds experts fused (experts.gate_up_proj [E, 2f, h], experts.down_proj [E, h, f]; Mixtral
    under mlp.): a directory of that state dict loads in transformers and imports to the very checkpoint the
    per-expert save_pretrained directory gives."""
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)  # the fused layout, as this transformers holds it
    if fmt == "bin":
        torch.save(sd, fused / "pytorch_model.bin")
    else:
        save_file(sd, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        assert torch.equal(type(hf).from_pretrained(fused, experts_implementation="eager").eval()(
            input_ids=_tokens()).logits,
                           hf(input_ids=_tokens()).logits)
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=2)
    import_from_hf(fused, tmp_path / "ck_fused", tp=2)
    a, b = _checkpoint_state(tmp_path / "ck"), _checkpoint_state(tmp_path / "ck_fused")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_fused_experts_read_only_their_rows(tmp_path):
    # Expert e's gate, up and down rows of the fused tensors, read straight from the file.
    E, f, h = 3, 4, 5
    gate_up, down = torch.randn(E, 2 * f, h), torch.randn(E, h, f)
    save_file({"a.gate_up_proj": gate_up, "a.down_proj": down}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    d = HFDirectory(tmp_path)
    for e in range(E):
        d.alias(f"e{e}.gate", "a.gate_up_proj", e * 2 * f, (f, h))
        d.alias(f"e{e}.up", "a.gate_up_proj", e * 2 * f + f, (f, h))
        d.alias(f"e{e}.down", "a.down_proj", e * h, (h, f))
    assert sorted(d.names()) == sorted(f"e{e}.{x}" for e in range(E) for x in ("gate", "up", "down"))
    for e in range(E):
        assert torch.equal(d.get(f"e{e}.gate"), gate_up[e, :f]) and torch.equal(d.get(f"e{e}.up"), gate_up[e, f:])
        assert torch.equal(d.get(f"e{e}.down"), down[e])
        rows = torch.empty(2, f, dtype=torch.float64)  # rows 1:3 of expert e's down, converted on the way
        d.read_rows_into(f"e{e}.down", 1, 3, rows)
        assert torch.equal(rows, down[e, 1:3].double())


# ---- logits -------------------------------------------------------------------------------------------------
def _moe_logits_bound(cfg: GPTConfig, tokens: int, dtype: torch.dtype) -> float:
    """:func:`tests.numerics.transformer_bound` for the logits, with each MoE layer's extra reductions.

    An expert computes what a dense MLP of its width does (the dense bound is taken at the widest MLP of the
    model); besides, per MoE layer: the router logits (h terms), their softmax over E (exp, then an E-term sum
    and a division), the top-k renormalisation (k terms and a division), each expert output times its weight
    and the k-term sum of them, and the shared expert (another MLP of its width: h, SiLU, fs terms) under its
    sigmoid gate (h terms and the function) added on. The dense model's own MLP terms stay counted once.
    """
    u = unit_roundoff(dtype) + U64
    h, e = cfg.hidden_size, ELEMENTARY
    shared = cfg.moe_shared_expert_intermediate_size or 0
    widest = cfg.replace(ffn_hidden_size=max(cfg.ffn_size, cfg.expert_ffn_size, shared), num_experts=None,
                         moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    k, E = cfg.moe_router_topk, cfg.num_experts
    router = (h + 1) + (e + E + 1) + (k + 1)
    combine = 1 + k
    shared_mlp = ((h + 1) + (e + 1) + (shared + 1) + (h + 1) + (e + 1) + 2) if shared else 0
    per_layer = (router + combine + shared_mlp) * u
    return transformer_bound(widest, tokens, part="logits", dtype=dtype) + sum(cfg.moe_layer_pattern()) * per_layer


def _route_margin(hf, tokens) -> float:
    """The smallest gap, over every token of every MoE layer, between the k-th and the (k+1)-th router logit of
    the float64 ``hf``, relative to the largest logit: the top-k choice is that far from a tie."""
    with torch.no_grad():
        out = hf(input_ids=tokens, output_router_logits=True)
    gaps = []
    for logits in out.router_logits:
        top = torch.topk(logits.double(), TOPK + 1, dim=-1).values
        gaps.append(((top[:, TOPK - 1] - top[:, TOPK]) / logits.abs().max()).min().item())
    return min(gaps)


@pytest.mark.parametrize("kind,tp", [("mixtral", 1), ("qwen2_moe", 2), ("qwen3_moe", 2)])
def test_imported_model_gives_the_transformers_logits(tmp_path, kind, tp):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=tp)
    cfg = _imported_config(tmp_path / "ck")
    state = _checkpoint_state(tmp_path / "ck")
    biases = {n: state.pop(n) for n in list(state) if n.endswith("router.expert_bias")}  # buffers, not weights
    assert len(biases) == sum(cfg.moe_layer_pattern()) and all(not b.any() for b in biases.values())
    ours = model_from_state(cfg.replace(sequence_parallel=False), state)
    ids = _tokens()
    with torch.no_grad():
        ref = hf.double()(input_ids=ids).logits
        got = ours.gather_logits(ours(ids))
        ours.double()
        got64 = ours.gather_logits(ours(ids))
    tokens = BATCH * SEQ
    bound = sum(_moe_logits_bound(cfg, tokens, dt) for dt in (torch.float32, torch.float64))
    bound64 = 2 * _moe_logits_bound(cfg, tokens, torch.float64)
    # Rounding moves each router logit by at most `bound` times the largest (the same first-order analysis, up
    # to that layer): when the k-th and (k+1)-th are more than twice that apart, both runs choose the same
    # experts, and the comparison measures the arithmetic, not a flipped expert.
    margin = _route_margin(hf, ids)
    assert margin > 2 * bound, f"a top-{TOPK} choice is within {margin:.1e} of a tie: pick another SEED"

    def rel(a):
        return ((a.double() - ref).abs().max() / ref.abs().max()).item()

    assert record(rel(got) / bound) <= 1, f"fp32 logits differ from transformers: {rel(got):.2e} > {bound:.2e}"
    assert record(rel(got64) / bound64) <= 1, \
        f"float64 logits differ from transformers: {rel(got64):.2e} > {bound64:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_export_of_a_hybrid_checkpoint_loads_with_its_logits(tmp_path, kind):
    # The other direction: a hybrid checkpoint written at TP=2 (not one imported), exported and loaded.
    cfg = _imported_config_of(tmp_path, kind)
    state = randomized_state(cfg, seed=4)
    write_weights_checkpoint(tmp_path / "ck", cfg, state, 2)
    res = export_to_hf(tmp_path / "ck", tmp_path / "out", max_shard_bytes=200_000)
    assert res.architecture == CLASSES[kind] and len(res.files) > 1
    hf = getattr(transformers, CLASSES[kind]).from_pretrained(tmp_path / "out", experts_implementation="eager").eval()
    ours = model_from_state(cfg.replace(sequence_parallel=False), state).double()
    ids = _tokens()
    with torch.no_grad():
        ref = ours.gather_logits(ours(ids))
        got = hf(input_ids=ids).logits
    bound = sum(_moe_logits_bound(cfg, BATCH * SEQ, dt) for dt in (torch.float32, torch.float64))
    rel = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert record(rel / bound) <= 1, f"transformers' logits differ from hybrid's: {rel:.2e} > {bound:.2e}"


@pytest.mark.parametrize("kind", ["qwen2_moe"])
def test_an_import_fine_tunes_and_exports_what_it_trained(tmp_path, kind):
    """from-hf's checkpoint loads into an engine for fine-tuning (the routers' expert_bias buffers included),
    trains, saves, and exports to a directory transformers loads with the trained model's logits."""
    _hf_model(kind).save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck")
    cfg = _imported_config(tmp_path / "ck")
    engine = make_engine(cfg)
    engine.load_checkpoint(tmp_path / "ck", load_optimizer=False)
    assert torch.equal(dict(engine.module.named_buffers())["layers.0.mlp.router.expert_bias"], torch.zeros(EXPERTS))
    losses = train(engine, 2)
    assert all(math.isfinite(v) for v in losses)
    engine.save_checkpoint(tmp_path / "trained")
    engine.wait_checkpoint()
    export_to_hf(tmp_path / "trained", tmp_path / "out")
    hf = getattr(transformers, CLASSES[kind]).from_pretrained(tmp_path / "out", experts_implementation="eager")
    model = engine.module.eval().double()
    ids = _tokens()
    with torch.no_grad():
        ref = model.gather_logits(model(ids))
        got = hf.eval()(input_ids=ids).logits
    bound = sum(_moe_logits_bound(cfg, BATCH * SEQ, dt) for dt in (torch.float32, torch.float64))
    rel = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert record(rel / bound) <= 1, f"the export's logits differ from the trained model's: {rel:.2e} > {bound:.2e}"


def _imported_config_of(tmp_path, kind) -> GPTConfig:
    """The hybrid config of ``kind``'s test model (what from-hf makes of its config.json), at TP=2."""
    _hf_model(kind).save_pretrained(tmp_path / "cfg")
    import_from_hf(tmp_path / "cfg", tmp_path / "cfg_ck", tp=2)
    return _imported_config(tmp_path / "cfg_ck")


# ---- configs ------------------------------------------------------------------------------------------------
def test_config_keys_map_to_the_moe_fields():
    qwen3 = QWEN3_MOE.config_from_hf(_hf_config("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[]).to_dict(),
                                     "c")
    assert qwen3.moe_layer_freq == (0, 1, 0)  # HF: layer l is MoE when (l + 1) % step == 0
    assert (qwen3.moe_ffn_hidden_size, qwen3.ffn_hidden_size, qwen3.moe_router_pre_softmax) == (32, 96, False)
    assert qwen3.moe_aux_loss_coeff == 0.02 and qwen3.kv_channels == 12 and qwen3.qk_norm
    out = QWEN3_MOE.hf_config(qwen3, "float32")
    assert (out["decoder_sparse_step"], out["mlp_only_layers"], out["norm_topk_prob"]) == (1, [0, 2], True)
    assert out["num_experts"] == EXPERTS and out["moe_intermediate_size"] == 32 and out["intermediate_size"] == 96
    qwen2 = QWEN2_MOE.config_from_hf(_hf_config("qwen2_moe").to_dict(), "c")
    assert qwen2.moe_router_pre_softmax and qwen2.moe_layer_freq == 1 and qwen2.qkv_bias
    assert (qwen2.moe_shared_expert_intermediate_size, qwen2.moe_shared_expert_gate) == (80, True)
    mixtral = MIXTRAL.config_from_hf(_hf_config("mixtral").to_dict(), "c")
    assert (mixtral.ffn_hidden_size, mixtral.moe_ffn_hidden_size, mixtral.expert_ffn_size) == (48, None, 48)
    assert not mixtral.moe_router_pre_softmax and mixtral.moe_shared_expert_intermediate_size is None
    # transformers 5 writes Qwen3-MoE's count as num_local_experts, the Hub's configs as num_experts
    saved = _hf_config("qwen3_moe").to_dict()
    assert QWEN3_MOE.config_from_hf(dict(saved, num_local_experts=6, num_experts=None), "c").num_experts == 6
    with pytest.raises(ConversionError, match="num_local_experts=6 and num_experts=4 disagree|num_experts=4 and "
                                              "num_local_experts=6 disagree"):
        QWEN3_MOE.config_from_hf(dict(saved, num_local_experts=6, num_experts=4), "c")


# The published config.json of each release, as far as the model is concerned.
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
                "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
                "rope_theta": 1000000.0, "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "hidden_act": "silu"}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "sliding_window": None,
                 "use_sliding_window": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
                 "attention_bias": False, "hidden_act": "silu"}


@pytest.mark.parametrize("preset,published,arch", [("mixtral-8x7b", MIXTRAL_8X7B, MIXTRAL),
                                                   ("qwen3-30b-a3b", QWEN3_30B_A3B, QWEN3_MOE)])
def test_presets_are_the_published_models(preset, published, arch):
    cfg = get_preset(preset)
    assert map_for_config(cfg) is arch
    imported = arch.config_from_hf(published, "config.json")
    # the same model: every setting the weights or their function depend on (the sequence length is the run's)
    assert imported.replace(seq_length=cfg.seq_length, init_std=cfg.init_std, hidden_dropout=cfg.hidden_dropout,
                            scaled_output_init=cfg.scaled_output_init) == cfg
    out = arch.hf_config(cfg, "bfloat16")
    assert {k: out[k] for k in published if k not in ("max_position_embeddings", "rope_theta")} == \
        {k: v for k, v in published.items() if k not in ("max_position_embeddings", "rope_theta")}
    assert out["rope_parameters"]["rope_theta"] == published["rope_theta"]


# ---- refusals -----------------------------------------------------------------------------------------------
def test_export_refuses_what_no_moe_class_computes(tmp_path):
    cfg = _imported_config_of(tmp_path, "mixtral")
    for change, reason in ((dict(moe_router_score_function="sigmoid"), "router is a softmax"),
                           (dict(moe_router_enable_expert_bias=True), "no expert bias"),
                           (dict(moe_router_pre_softmax=True), "renormalises the top-k weights"),
                           (dict(moe_layer_freq=2), "experts in every layer"),
                           (dict(moe_router_num_groups=2, moe_router_group_topk=1), "not within groups")):
        bad = cfg.replace(**change)
        with pytest.raises(ConversionError, match=f"not MixtralForCausalLM: .*{reason}"):
            map_for_config(bad)
    with pytest.raises(ConversionError, match=r"not LlamaForCausalLM: num_experts=4 \(LlamaForCausalLM is dense\)"):
        map_for_config(cfg, "LlamaForCausalLM")


def test_import_refuses_what_hybrid_cannot_reproduce(tmp_path):
    hf = _hf_model("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    good = json.loads(path.read_text())
    path.write_text(json.dumps(dict(good, router_jitter_noise=0.1)))
    with pytest.raises(ConversionError, match="router_jitter_noise=0.1 is not supported.*adds no noise"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    path.write_text(json.dumps(dict(good, num_experts_per_tok=5)))
    with pytest.raises(ConversionError, match="num_experts_per_tok=5 is not supported"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    path.write_text(json.dumps(dict(good, num_local_experts=3)))  # the config no longer fits the tensors
    with pytest.raises(ConversionError, match="has no place for: model.layers.0.block_sparse_moe.experts.3.w1.weight"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    path.write_text(json.dumps(dict(good, intermediate_size=40)))
    with pytest.raises(ConversionError, match=r"experts.0.w1.weight has shape \[48, 64\], but config.json implies "
                                              r"\[40, 64\]"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    # fused experts of the wrong width are named
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text(json.dumps(dict(good, intermediate_size=40)))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"mlp.experts.gate_up_proj has shape \[4, 96, 64\], but config.json "
                                              r"implies \[4, 80, 64\]"):
        import_from_hf(fused, tmp_path / "ck2")
