"""The GPT-2 and Llama switches compute exactly what Hugging Face's reference models compute.

Each test builds a small random Hugging Face model (no download), copies its
weights into a TP=1 GPTModel by name, and compares against Hugging Face run in
float64: our fp32 logits and loss within the rounding bound of
:func:`tests.numerics.transformer_bound`, and our float64 logits within the
float64 bound. For GPT-2 that bound is ~1e-12, so it pins the semantics far
below fp32 noise; Llama's RMSNorm computes in fp32 on both sides (its
definition), which keeps Llama's float64 bound near the fp32 one.
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid import param_meta
from hybrid.topology import Topology
from model_zoo import GPTConfig, GPTModel
from tests.numerics import cross_entropy_bounds, masked_mean_bound, record, transformer_bound

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 300, 64, 2, 4, 16, 2


def _load(model: GPTModel, tensors: dict) -> None:
    """Copy full tensors into the TP=1 model (padding the vocabulary as its metadata says)."""
    params = dict(model.named_parameters())
    assert set(tensors) == set(params), set(tensors) ^ set(params)
    with torch.no_grad():
        for name, full in tensors.items():
            p = params[name]
            p.copy_(param_meta.shard(full.float(), param_meta.get_tp_meta(p), 1, 0))


def _gpt2_weights(hf) -> dict:
    sd = {k: v for k, v in hf.state_dict().items()}
    out = {"embedding.word_embeddings.weight": sd["transformer.wte.weight"],
           "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
           "final_norm.weight": sd["transformer.ln_f.weight"], "final_norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(LAYERS):
        src, dst = f"transformer.h.{i}.", f"layers.{i}."
        for a, b in (("ln_1", "input_norm"), ("ln_2", "post_attention_norm")):
            out[dst + b + ".weight"] = sd[src + a + ".weight"]
            out[dst + b + ".bias"] = sd[src + a + ".bias"]
        # Conv1D keeps [in, out]; our linear layers keep [out, in].
        for a, b in (("attn.c_attn", "attention.qkv_proj"), ("attn.c_proj", "attention.out_proj"),
                     ("mlp.c_fc", "mlp.in_proj"), ("mlp.c_proj", "mlp.out_proj")):
            out[dst + b + ".weight"] = sd[src + a + ".weight"].t()
            out[dst + b + ".bias"] = sd[src + a + ".bias"]
    return out


def _llama_weights(hf, bias: bool = False) -> dict:
    sd = hf.state_dict()
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "final_norm.weight": sd["model.norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "input_norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
        out[dst + "attention.qkv_proj.weight"] = torch.cat(
            [sd[src + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0)
        if bias:  # Qwen2's q/k/v bias
            out[dst + "attention.qkv_proj.bias"] = torch.cat(
                [sd[src + f"self_attn.{x}_proj.bias"] for x in "qkv"], dim=0)
        for x in "qk":  # Qwen3's query/key norms
            if src + f"self_attn.{x}_norm.weight" in sd:
                out[dst + f"attention.{x}_norm.weight"] = sd[src + f"self_attn.{x}_norm.weight"]
        out[dst + "attention.out_proj.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "mlp.in_proj.weight"] = torch.cat(
            [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]], dim=0)
        out[dst + "mlp.out_proj.weight"] = sd[src + "mlp.down_proj.weight"]
    return out


def _randomise_norms(hf) -> None:
    # Fresh norms are ones/zeros; random ones make a wrong eps, bias or weight placement visible.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name or "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def _compare(ours: GPTModel, hf) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    cfg, tokens = ours.config, BATCH * SEQ
    with torch.no_grad():
        ref = hf.double()(input_ids=ids).logits
        got = ours.gather_logits(ours(ids))
        loss = ours(ids, labels=labels)
        raw = ours(ids)
        ours.double()
        got64 = ours.gather_logits(ours(ids))
    assert got.shape == got64.shape == ref.shape == (BATCH, SEQ, VOCAB)
    # fp32 against float64: each run within its own bound of the exact logits.
    bound = sum(transformer_bound(cfg, tokens, part="logits", dtype=dt) for dt in (torch.float32, torch.float64))
    rel = _rel(got, ref)
    assert record(rel / bound) <= 1, f"fp32 logits differ from Hugging Face: relative error {rel:.2e} > {bound:.2e}"
    bound64 = 2 * transformer_bound(cfg, tokens, part="logits", dtype=torch.float64)
    rel64 = _rel(got64, ref)
    assert record(rel64 / bound64) <= 1, f"float64 logits differ from Hugging Face: {rel64:.2e} > {bound64:.2e}"
    # The loss: each token's cross entropy moves by at most sum_j |p_j - y_j| <= 2 times the largest
    # logit error, and our fp32 cross entropy adds its own rounding.
    per_token = F.cross_entropy(ref.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    token_bound, _ = cross_entropy_bounds(got.reshape(-1, VOCAB), labels.reshape(-1), VOCAB)
    loss_bound = 2 * bound * ref.abs().max().item() + masked_mean_bound(per_token, token_bound)
    assert record(abs(loss.item() - per_token.mean().item()) / loss_bound) <= 1
    # The vocab-parallel logits mark the padding as never predicted.
    assert raw.shape[-1] == ours.padded_vocab_size and torch.isinf(raw[..., VOCAB:]).all()


def test_gpt2_switches_match_gpt2lmheadmodel():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    _randomise_norms(hf)
    ours = GPTModel(GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                              seq_length=SEQ), Topology.local()).eval()
    _load(ours, _gpt2_weights(hf))
    _compare(ours, hf)


# (HF class, HF extras, hybrid extras): plain multi-head; grouped-query with llama3 RoPE scaling; Qwen2's
# multi-query attention with a q/k/v bias; a head dim of its own.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
LLAMA_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=HEADS, num_key_value_heads=HEADS),
              dict(num_heads=HEADS)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(num_attention_heads=8, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
                  dict(num_heads=8, num_query_groups=2, rope_scaling="llama3", rope_scaling_factor=8.0,
                       rope_original_max_positions=8)),
    "qwen2-mqa": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=1),
                  dict(num_heads=8, num_query_groups=1, qkv_bias=True)),
    # head dims other than hidden / heads (kv_channels): wider than it (24 > 64 / 4), and narrower (6 < 64 / 8)
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_attention_heads=HEADS, num_key_value_heads=2, head_dim=24),
                       dict(num_heads=HEADS, num_query_groups=2, kv_channels=24)),
    "mistral-head-dim": ("MistralConfig", "MistralForCausalLM",
                         dict(num_attention_heads=8, num_key_value_heads=2, head_dim=6, sliding_window=None),
                         dict(num_heads=8, num_query_groups=2, kv_channels=6)),
    # Qwen3: query/key norms over each head, a head dim of its own
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=12),
              dict(num_heads=8, num_query_groups=2, kv_channels=12, qk_norm=True)),
}


@pytest.mark.parametrize("kind", list(LLAMA_FAMILY))
def test_llama_switches_match_llamaforcausallm(kind):
    config_cls, model_cls, hf_extra, extra = LLAMA_FAMILY[kind]
    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                                            num_hidden_layers=LAYERS, max_position_embeddings=SEQ,
                                            rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                            **hf_extra)
    hf = getattr(transformers, model_cls)(cfg).eval()
    _randomise_norms(hf)
    with torch.no_grad():  # fresh biases are zeros: random ones make a misplaced q, k or v bias visible
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    ours = GPTModel(GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, ffn_hidden_size=96,
                              seq_length=SEQ, position="rope", rope_theta=500.0, norm="rmsnorm", norm_eps=1e-6,
                              mlp="swiglu", bias=False, tie_embeddings=False, **extra),
                    Topology.local()).eval()
    _load(ours, _llama_weights(hf, bias="qkv_bias" in extra))
    _compare(ours, hf)
