"""Shared builders for the conversion tests: tiny GPT configs, engines, checkpoints written by hand."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

import torch

import hybrid
from hybrid import param_meta
from hybrid.checkpoint import CheckpointWriter
from hybrid.convert.hf import gpt_param_layout
from hybrid.layout import ParallelLayout
from hybrid.tensor_parallel.gather import full_state
from hybrid.topology import Topology
from model_zoo import GPTConfig, GPTModel

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 300, 64, 2, 4, 16

GPT2_CFG = GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, seq_length=SEQ)
LLAMA_CFG = GPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, ffn_hidden_size=96,
                      seq_length=SEQ, position="rope", rope_theta=500.0, norm="rmsnorm", norm_eps=1e-6, mlp="swiglu",
                      bias=False, tie_embeddings=False)
# Grouped-query Llama 3 style (8 query heads, 2 key/value groups, llama3 RoPE scaling), Mistral (GQA, no
# window) and Qwen2 (multi-query, q/k/v bias): the hybrid side of the configs tests/convert/test_hf.py builds.
_LLAMA_GQA = dict(num_heads=8, num_query_groups=2)
LLAMA_GQA_CFG = LLAMA_CFG.replace(**_LLAMA_GQA, rope_scaling="llama3", rope_scaling_factor=8.0,
                                  rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8)
MISTRAL_CFG = LLAMA_CFG.replace(**_LLAMA_GQA)
MISTRAL_HEAD_DIM_CFG = MISTRAL_CFG.replace(kv_channels=12)  # 8 heads of 12: 96 attention channels on hidden 64
QWEN2_CFG = LLAMA_CFG.replace(num_heads=8, num_query_groups=1, qkv_bias=True, rope_theta=10000.0)
QWEN3_CFG = MISTRAL_HEAD_DIM_CFG.replace(qk_norm=True, rope_theta=10000.0)  # Qwen3: query/key norms, head dim 12


def randomized_state(cfg: GPTConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Full fp32 tensors of a GPTModel(cfg) whose norms and biases are random too.

    Fresh norms are ones and biases zeros: random ones make a misplaced or
    mis-transposed tensor change the logits.
    """
    model = GPTModel(cfg, Topology.local(), seed=seed)
    state = full_state(model, Topology.local())
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in state.items():
        if "norm" in name or name.endswith(".bias"):
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            state[name] = base + 0.1 * torch.randn(t.shape, generator=g)
    return state


def model_from_state(cfg: GPTConfig, state: Dict[str, torch.Tensor]) -> GPTModel:
    """A TP=1 GPTModel holding ``state`` (full tensors), in eval mode."""
    model = GPTModel(cfg, Topology.local(), seed=0).eval()
    params = dict(model.named_parameters())
    assert set(params) == set(state), set(params) ^ set(state)
    with torch.no_grad():
        for name, full in state.items():
            params[name].copy_(param_meta.shard(full.float(), param_meta.get_tp_meta(params[name]), 1, 0))
    return model


def write_weights_checkpoint(save_dir, cfg: GPTConfig, state: Dict[str, torch.Tensor], tp: int, *,
                             dtype: torch.dtype = torch.float32, tokenizer: Optional[str] = None,
                             iteration: int = 5) -> Path:
    """A weights-only hybrid checkpoint of ``state`` at TP size ``tp`` (what an inference save holds)."""
    layout = gpt_param_layout(cfg)
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    writer = CheckpointWriter(save_dir, iteration, ParallelLayout(tp=tp, dp=1, precision=precision))
    writer.prepare()
    records, index = [], []
    for rank in range(tp):
        pieces = {name: param_meta.shard(state[name].to(dtype), meta, tp, rank) for name, (_, meta) in layout.items()}
        records.append(writer.write_model_shard(pieces, rank))
        if rank == 0:
            index = [{"name": n, "shape": list(p.shape), "dtype": str(dtype).replace("torch.", ""),
                      "tp_meta": layout[n][1].to_json()} for n, p in pieces.items()]
    client = {"args": {"tokenizer_model": tokenizer}} if tokenizer else {}
    writer.commit(records, model_config=cfg.to_dict(), param_index=index, trainer_state={"client": client})
    return writer.iter_dir


def make_engine(cfg: GPTConfig, *, precision: str = "fp32", stage: int = 1, seed: int = 1, lr: float = 1e-3,
                topology: Optional[Topology] = None):
    """An engine over a fresh GPTModel(cfg): one process (TP=1, DP=1), or ``topology``'s layout."""
    topo = topology or Topology.local()
    model = GPTModel(cfg, topo, seed=seed)
    return hybrid.initialize(model, {"precision": precision, "zero": {"stage": stage},
                                     "optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.1},
                                     "clip_grad": 1.0, "micro_batch_size": 2,
                                     "global_batch_size": 2 * topo.dp_size,
                                     "steps_per_print": 0}, topology=topo)


def train(engine, steps: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    losses = []
    vocab = engine.module.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, engine.module.config.seq_length + 1), generator=g)
        loss = engine(ids[:, :-1], labels=ids[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def optimizer_tensors(engine) -> Dict[str, torch.Tensor]:
    """Every tensor of the engine's optimizer state, keyed ``group/key``."""
    sd = engine.optimizer.state_dict()
    return {f"{i}/{k}": v.clone() for i, g in enumerate(sd["groups"]) for k, v in g.items()
            if isinstance(v, torch.Tensor)}


def train_tp2_dp2_zero2(root: str, configs: Dict[str, GPTConfig], tokens: torch.Tensor) -> Optional[dict]:
    """Per config: 3 steps at TP=2 x DP=2 with ZeRO-2, saved to ``root/<name>``, then loaded at TP=4 x DP=1
    with ZeRO-3. Rank 0 returns, per name, the trained model's logits on ``tokens``, the first step's
    gradient norm beside a one-process float64 reference's, and for the TP=4 load its logits, whether its
    weights equal the saved ones and its next step's gradient norm beside a reference's (None on other
    ranks). Run on 4 ranks (tests.multiproc)."""
    import torch.distributed as dist

    topo = Topology(tp=2)
    out = {}
    for kind, cfg in configs.items():
        engine = make_engine(cfg, stage=2, topology=topo)
        train(engine, 1)
        norm = engine.get_grad_norm()
        train(engine, 2, seed=1)
        engine.save_checkpoint(os.path.join(root, kind))
        engine.module.eval()
        with torch.no_grad():
            logits = engine.module.gather_logits(engine.module(tokens))
        # The reference: the same initial model and first batch (every DP rank drew the same one), one process.
        ref = GPTModel(cfg, Topology.local(), seed=1).double()
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
        ref(ids[:, :-1], labels=ids[:, 1:]).backward()
        ref_norm = torch.sqrt(sum(p.grad.square().sum() for p in ref.parameters())).item()
        out[kind] = {"logits": logits.numpy(), "norm": norm, "ref_norm": ref_norm}
    # Resharded on load to TP=4 x DP=1 under ZeRO-3 (optimizer state included): a model whose key/value
    # heads are fewer than 4 is replicated on more ranks than it was saved from. Its weights must be the
    # saved ones exactly, its logits the TP=2 model's, and its next gradient norm a one-process reference's.
    from hybrid.checkpoint import CheckpointReader
    from hybrid.convert.consolidate import CheckpointSource

    topo4 = Topology(tp=4)
    for kind, cfg in configs.items():
        engine = make_engine(cfg, stage=3, topology=topo4, seed=2)
        engine.load_checkpoint(os.path.join(root, kind))
        with engine.gathered_parameters():
            weights = full_state(engine.module, topo4)
            engine.module.eval()
            with torch.no_grad():
                logits = engine.module.gather_logits(engine.module(tokens))
        engine.module.train()
        train(engine, 1, seed=2)
        norm = engine.get_grad_norm()
        with CheckpointSource(CheckpointReader(os.path.join(root, kind))) as src:
            saved = {n: src.read(n) for n in src.tensors}
        ref = model_from_state(cfg, saved).train().double()
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(2))
        ref(ids[:, :-1], labels=ids[:, 1:]).backward()
        out[kind].update(tp4_weights_exact=all(torch.equal(weights[n], saved[n]) for n in saved),
                         tp4_logits=logits.numpy(), tp4_norm=norm,
                         tp4_ref_norm=torch.sqrt(sum(p.grad.square().sum() for p in ref.parameters())).item())
    return out if dist.get_rank() == 0 else None
