"""Hugging Face oracle: exported checkpoints load in ``transformers`` with the same logits; imports match too.

Models are built from configs with random weights (no download). Hybrid's
own logits come from a TP=1 GPTModel holding the same full tensors; TP=2
checkpoints are merged by the converter, whose TP layout arithmetic is what
is under test.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid.convert.consolidate import CheckpointSource, ConversionError
from hybrid.checkpoint import CheckpointReader
from hybrid.convert.hf import export_to_hf, import_from_hf
from tests.convert.common import GPT2_CFG, LLAMA_CFG, LLAMA_GQA_CFG, MISTRAL_CFG, MISTRAL_HEAD_DIM_CFG, QWEN2_CFG, \
    QWEN3_CFG, SEQ, VOCAB, model_from_state, randomized_state, train_tp2_dp2_zero2, write_weights_checkpoint
from tests.data.testkit import train_tokenizer

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# kind -> the hybrid config its HF model converts to, and the HF class
KINDS = {"gpt2": (GPT2_CFG, "GPT2LMHeadModel"), "llama": (LLAMA_CFG, "LlamaForCausalLM"),
         "llama-gqa": (LLAMA_GQA_CFG, "LlamaForCausalLM"), "mistral": (MISTRAL_CFG, "MistralForCausalLM"),
         "qwen2": (QWEN2_CFG, "Qwen2ForCausalLM"), "mistral-head-dim": (MISTRAL_HEAD_DIM_CFG, "MistralForCausalLM"),
         "qwen3": (QWEN3_CFG, "Qwen3ForCausalLM")}


def _llama_family_config(kind: str, tie: bool):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=SEQ, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
                  tie_word_embeddings=False if tie is None else tie)
    if kind == "llama":
        return transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, rope_theta=500.0)
    if kind == "llama-gqa":  # Llama 3 style: grouped-query attention and llama3 RoPE scaling
        return transformers.LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8})
    if kind in ("mistral", "mistral-head-dim"):  # the second with a head dim of its own, as Mistral NeMo
        return transformers.MistralConfig(**common, num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0,
                                          sliding_window=None, head_dim=12 if kind == "mistral-head-dim" else None)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                                        rope_theta=10000.0, use_sliding_window=False)
    return transformers.Qwen2Config(**common, num_attention_heads=8, num_key_value_heads=1, rope_theta=10000.0,
                                    use_sliding_window=False)


def _hf_model(kind: str, tie: bool = None):
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0, tie_word_embeddings=True if tie is None else tie)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        model = getattr(transformers, KINDS[kind][1])(_llama_family_config(kind, tie))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # fresh norms are ones and biases zeros: make a misplaced one visible
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name or name.endswith(".bias"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _hybrid_logits(cfg, state):
    model = model_from_state(cfg, state)
    with torch.no_grad():
        return model.gather_logits(model(_tokens()))


def _checkpoint_state(path):
    with CheckpointSource(CheckpointReader(path)) as src:
        return {name: src.read(name) for name in src.tensors}


def _hf_tensors(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(directory, "model.safetensors"))
    out = {}
    for f in sorted(set(json.load(open(index))["weight_map"].values())):
        out.update(load_file(os.path.join(directory, f)))
    return out


@pytest.mark.parametrize("kind,tp", [("gpt2", 1), ("gpt2", 2), ("llama", 2)])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, kind, tp):
    cfg = GPT2_CFG if kind == "gpt2" else LLAMA_CFG
    state = randomized_state(cfg, seed=4)
    tokenizer = Path(train_tokenizer(tmp_path, vocab_size=100, num_docs=100))
    write_weights_checkpoint(tmp_path / "ck", cfg, state, tp)
    # A small shard limit exercises the sharded layout and its index.
    res = export_to_hf(tmp_path / "ck", tmp_path / "hf", max_shard_bytes=200_000, tokenizer_model=tokenizer)
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    assert res.architecture == cls.__name__ and len(res.files) > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in _hf_tensors(tmp_path / "hf").values())
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    hf = cls.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = hf(input_ids=_tokens()).logits
    assert ref.shape == (2, SEQ, VOCAB)
    assert _rel(_hybrid_logits(cfg, state), ref) < TOL


@pytest.mark.parametrize("kind,tp,fmt", [("gpt2", 1, "safetensors"), ("gpt2", 2, "bin"), ("llama", 1, "bin"),
                                         ("llama", 2, "safetensors"), ("llama-gqa", 1, "safetensors"),
                                         ("llama-gqa", 2, "safetensors"), ("mistral", 1, "safetensors"),
                                         ("mistral", 2, "bin"), ("qwen2", 1, "bin"), ("qwen2", 2, "safetensors"),
                                         ("mistral-head-dim", 2, "safetensors"), ("qwen3", 2, "safetensors")])
def test_import_gives_the_transformers_logits(tmp_path, kind, tp, fmt):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    if fmt == "bin":  # the older pickle-based format, read back with weights_only
        os.remove(tmp_path / "hf" / "model.safetensors")
        torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    out = import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=tp)
    reader = CheckpointReader(tmp_path / "ck")
    assert reader.path == out and reader.layout.tp == tp and not reader.has_optimizer_state
    cfg = KINDS[kind][0]
    from model_zoo import GPTConfig

    imported = GPTConfig.from_dict(reader.model_config)
    switches = ("position", "norm", "mlp", "bias", "attention_bias", "query_groups", "num_heads", "head_dim", "qk_norm",
                "rope_theta",
                "rope_scaling", "rope_scaling_factor", "rope_original_max_positions")
    assert [getattr(imported, k) for k in switches] == [getattr(cfg, k) for k in switches]
    with torch.no_grad():
        ref = hf(input_ids=_tokens()).logits
    assert _rel(_hybrid_logits(imported, _checkpoint_state(out)), ref) < TOL


@pytest.mark.parametrize("kind,tie", [("gpt2", True), ("gpt2", False), ("llama", False), ("llama", True),
                                      ("llama-gqa", False), ("mistral", False), ("qwen2", True),
                                      ("mistral-head-dim", False), ("qwen3", True)])
def test_hf_to_hybrid_to_hf_is_bit_identical(tmp_path, kind, tie):
    hf = _hf_model(kind, tie)
    hf.save_pretrained(tmp_path / "hf")
    import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=2)
    export_to_hf(tmp_path / "ck", tmp_path / "back")
    a, b = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "back")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [type(hf).__name__]
    back = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=_tokens()).logits, back(input_ids=_tokens()).logits)


def test_bf16_export_and_import_keep_the_dtype(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in randomized_state(LLAMA_CFG, seed=2).items()}
    write_weights_checkpoint(tmp_path / "ck", LLAMA_CFG, state, 2, dtype=torch.bfloat16)
    export_to_hf(tmp_path / "ck", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = _hf_tensors(tmp_path / "hf")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    import_from_hf(tmp_path / "hf", tmp_path / "ck2", tp=1)
    assert CheckpointReader(tmp_path / "ck2").layout.precision == "bf16"
    again = _checkpoint_state(tmp_path / "ck2")
    assert all(torch.equal(again[k], state[k]) for k in state)
    export_to_hf(tmp_path / "ck", tmp_path / "hf32", dtype="fp32")
    assert torch.equal(_hf_tensors(tmp_path / "hf32")["model.norm.weight"], state["final_norm.weight"].float())


# ---- errors ----------------------------------------------------------------------------------------
def test_unknown_architecture_is_named(tmp_path):
    _hf_model("gpt2").save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["BertForMaskedLM"], "bert"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="unknown architecture \\['BertForMaskedLM'\\] in .*config.json.*"
                                              "GPT2LMHeadModel.*LlamaForCausalLM"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")


def test_import_refuses_what_hybrid_cannot_reproduce(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    good = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(good, num_key_value_heads=3)))
    with pytest.raises(ConversionError, match="num_key_value_heads=3 is not supported.*must divide "
                                              "num_attention_heads=4"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    cfg_path.write_text(json.dumps(dict(good, rope_parameters={"rope_type": "dynamic", "factor": 4.0})))
    with pytest.raises(ConversionError, match="rope_parameters.rope_type='dynamic' is not supported"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    cfg_path.write_text(json.dumps(dict(good, intermediate_size=128)))  # the config no longer fits the tensors
    with pytest.raises(ConversionError, match=r"gate_proj.weight has shape \[96, 64\], but config.json implies "
                                              r"\[128, 64\]"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    cfg_path.write_text(json.dumps(dict(good, num_hidden_layers=3)))
    with pytest.raises(ConversionError, match="lacks .* tensor.*model.layers.2"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    cfg_path.write_text(json.dumps(good))
    with pytest.raises(ConversionError, match="cannot be split over --tp 3"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck", tp=3)
    os.remove(tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ConversionError, match="holds no weights: expected model.safetensors"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")


def test_a_sliding_window_the_attention_cannot_honour_is_refused(tmp_path):
    _hf_model("mistral").save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    good = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(good, sliding_window=SEQ // 2)))
    with pytest.raises(ConversionError, match=f"sliding_window={SEQ // 2} is not supported.*full causal.*at least "
                                              f"max_position_embeddings={SEQ}"):
        import_from_hf(tmp_path / "hf", tmp_path / "ck")
    cfg_path.write_text(json.dumps(dict(good, sliding_window=SEQ)))  # covers every position: the same attention
    import_from_hf(tmp_path / "hf", tmp_path / "ck")


def test_export_refuses_a_model_of_no_known_family(tmp_path):
    cfg = GPT2_CFG.replace(position="rope")  # GPT-2 in every respect but its positions
    write_weights_checkpoint(tmp_path / "ck", cfg, randomized_state(cfg), 1)
    with pytest.raises(ConversionError, match="not GPT2LMHeadModel: position='rope'.*not LlamaForCausalLM"):
        export_to_hf(tmp_path / "ck", tmp_path / "hf")
    cfg = GPT2_CFG.replace(kv_channels=8)  # GPT-2's config.json has no head dim: n_embd / n_head = 16 it is
    write_weights_checkpoint(tmp_path / "ck2", cfg, randomized_state(cfg), 1)
    with pytest.raises(ConversionError, match="not GPT2LMHeadModel: kv_channels=8 \\(GPT-2's head dim is n_embd / "
                                              "n_head = 64 / 4\\)"):
        export_to_hf(tmp_path / "ck2", tmp_path / "hf2")


def test_the_tokenizer_path_recorded_in_the_checkpoint_is_never_opened(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), 1, tokenizer=str(secret))
    res = export_to_hf(tmp_path / "ck", tmp_path / "hf")
    assert res.tokenizer_files == () and not (tmp_path / "hf" / "tokenizer.model").exists()
    assert res.note.startswith("no tokenizer exported: pass --tokenizer-model PATH") and str(secret) in res.note


def test_a_tokenizer_flag_that_is_not_a_sentencepiece_model_is_refused_before_any_weight(tmp_path):
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), 1)
    for bad, match in ((tmp_path / "passwd", "is not a SentencePiece model"),
                       (tmp_path / "empty.model", "is not a SentencePiece model"),
                       (tmp_path / "gone.model", "No such file")):
        if bad.name != "gone.model":
            bad.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" if bad.name == "passwd" else b"")
        with pytest.raises(ConversionError, match=rf"--tokenizer-model {bad}.*{match}"):
            export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer_model=bad)
        assert not (tmp_path / "hf").exists()
    big = train_tokenizer(tmp_path, vocab_size=VOCAB + 20, num_docs=200)
    with pytest.raises(ConversionError,
                       match=rf"the tokenizer has {VOCAB + 20} tokens but the model.s vocabulary holds {VOCAB}"):
        export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer_model=big)


# ---- export after training in a parallel layout -------------------------------------------------------
TRAINED = ("llama-gqa", "mistral", "qwen2")  # qwen2 is multi-query: TP=2 replicates its key/value head


def test_export_after_zero2_training_at_tp2_dp2_loads_with_from_pretrained_and_reshards_to_tp4_zero3(tmp_path):
    from tests.multiproc import run_distributed

    # The worker lives in common.py, which does not import transformers: each spawned rank imports less.
    results = run_distributed(train_tp2_dp2_zero2, 4, str(tmp_path), {k: KINDS[k][0] for k in TRAINED},
                              _tokens(), timeout=240)[0]
    for kind in TRAINED:
        # Replicated key/value heads count once: the norm a single process computes (fp32 rounding of a
        # sum of ~1e5 squares, far below the share of the key/value rows counted twice).
        assert abs(results[kind]["norm"] - results[kind]["ref_norm"]) <= 1e-5 * results[kind]["ref_norm"], kind
        reader = CheckpointReader(tmp_path / kind)
        assert (reader.layout.tp, reader.layout.dp, int(reader.layout.zero_stage)) == (2, 2, 2)
        assert reader.has_optimizer_state
        cfg, arch = KINDS[kind]
        res = export_to_hf(tmp_path / kind, tmp_path / f"{kind}-hf", architecture=arch)
        assert res.architecture == arch
        hf = getattr(transformers, arch).from_pretrained(tmp_path / f"{kind}-hf").eval()
        assert hf.config.num_key_value_heads == cfg.query_groups
        with torch.no_grad():
            ref = hf(input_ids=_tokens()).logits
        assert _rel(torch.from_numpy(results[kind]["logits"]), ref) < TOL, kind
        # The same checkpoint resharded on load to TP=4 with ZeRO-3, which replicates every key/value head
        # of both models: the saved weights, the same logits, and the next step's norm counts each head once.
        r = results[kind]
        assert r["tp4_weights_exact"], kind
        assert _rel(torch.from_numpy(r["tp4_logits"]), ref) < TOL, kind
        assert abs(r["tp4_norm"] - r["tp4_ref_norm"]) <= 1e-5 * r["tp4_ref_norm"], kind
