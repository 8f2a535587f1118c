"""hybrid ZeRO stages 0-3 (and TP=2 x DP=2) against torch's and DeepSpeed's data-parallel trainers.

Every contender trains the same small GPT (the model_zoo GPT driven through
``hybrid.initialize`` for hybrid, an equivalent plain-PyTorch twin loaded with
the same weights for the peers) on the same global batches, with AdamW at the
same learning rate and weight decay on the same parameters (matrices decay;
biases and norm weights, hybrid's default exemption, do not), on 4 gloo ranks
of this machine. Each contender runs in fresh processes so its peak RSS is its
own. The final loss of every contender is printed and checked against one
process training the same model (see ``loss_tolerance``).

Two tables, from the same runs of hybrid:

* **defaults**: hybrid at its defaults, every peer at ITS OWN defaults (torch
  DDP's 25 MB buckets, DeepSpeed's 5e8-element buckets and ``overlap_comm``
  off below stage 3, FSDP2's per-unit communication).
* **matched**: the peers' bucket size and overlap set to hybrid's
  (``zero.bucket_size`` and ``zero.overlap_comm``; for DeepSpeed ZeRO-3 also
  prefetch bucket, persistence threshold and live-parameter limit). FSDP2 has
  no such settings: its rows repeat the defaults runs.

Only training arithmetic is set alike everywhere (AdamW hyper-parameters,
weight-decay groups, no gradient clipping -- DeepSpeed would clip at 1.0 by
default). torch peers get ``fused=True`` AdamW, their fastest CPU update, as
hybrid uses a fused one. Every contender's configuration is printed with the
tables.

Rounds are interleaved (round r runs every contender once, in reversed order
on odd rounds, before round r+1). A ratio is PAIRED: per round, hybrid's
median step time over the peer's median step time in that same round; the
table shows the median of those ratios and their min-max over rounds.

Pairs: DDP against hybrid stages 0-3; ZeroRedundancyOptimizer against stage 1;
FSDP2 ``reshard_after_forward=False`` (ZeRO-2-like) against stage 2 and
``=True`` (ZeRO-3-like, FSDP2's default) against stage 3; DTensor TP2 x FSDP2
against hybrid TP2 x DP2 ZeRO-1; DeepSpeed ZeRO-1/2/3 against stages 1/2/3
(when ``deepspeed`` is importable; ``DS_ACCELERATOR=cpu pip install
--no-build-isolation deepspeed``).

Reproduce (from the repository root)::

    python benchmarks/zero_vs_peers.py                    # 3 rounds x 12 steps: 21 min on 2 shared cores
    python benchmarks/zero_vs_peers.py --quick            # the machinery end to end, ~3 min (not a measurement)
    python benchmarks/zero_vs_peers.py --only "zero-1,DDP"   # some contenders only

Writes every figure, each round's raw medians and every configuration to
``--json`` (default ``benchmarks/results/zero_vs_peers.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.paired import paired_ratio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402  (the repository's gloo process harness)

WORLD = 4
TP = 2  # the tensor-parallel contenders' TP size


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # hybrid | ddp | zero_redundancy | fsdp2 | dtensor_tp_fsdp2 | deepspeed
    stage: int = 0
    tp: int = 1
    matched: bool = False  # a peer with hybrid's bucket size and overlap instead of its own defaults
    reshard: bool = True  # fsdp2 / dtensor_tp_fsdp2: reshard_after_forward (FSDP2's default: True)


def _matched(c: Contender) -> Contender:
    return dataclasses.replace(c, name=c.name + " [matched]", matched=True)


DDP = Contender("torch DDP", "ddp")
ZRO = Contender("torch ZeroRedundancyOptimizer", "zero_redundancy")
FSDP2_R0 = Contender("torch FSDP2 reshard=False", "fsdp2", reshard=False)
FSDP2_R1 = Contender("torch FSDP2 reshard=True", "fsdp2", reshard=True)
DTENSOR = Contender(f"torch DTensor TP{TP} x FSDP2", "dtensor_tp_fsdp2", tp=TP)
DEEPSPEED = {s: Contender(f"DeepSpeed ZeRO-{s}", "deepspeed", s) for s in (1, 2, 3)}
HYBRID = {s: Contender(f"hybrid zero-{s}", "hybrid", s) for s in range(4)}
HYBRID_TP = Contender(f"hybrid tp{TP} x dp{WORLD // TP} zero-1", "hybrid", 1, tp=TP)

# (hybrid contender, peer contender) rows of each table.
DEFAULT_PAIRS: List[Tuple[Contender, Contender]] = (
    [(HYBRID[s], DDP) for s in range(4)]
    + [(HYBRID[1], ZRO), (HYBRID[2], FSDP2_R0), (HYBRID[3], FSDP2_R1), (HYBRID_TP, DTENSOR)]
    + [(HYBRID[s], DEEPSPEED[s]) for s in (1, 2, 3)])


def _matched_peer(peer: Contender) -> Contender:
    # FSDP2 has neither a bucket size nor an overlap switch (it communicates one fully_shard unit at a time and
    # always prefetches the next): its matched row is its defaults run.
    return peer if peer.kind in ("fsdp2", "dtensor_tp_fsdp2") else _matched(peer)


MATCHED_PAIRS = [(h, _matched_peer(p)) for h, p in DEFAULT_PAIRS]
TABLES = {"defaults": DEFAULT_PAIRS, "matched": MATCHED_PAIRS}


def all_contenders() -> List[Contender]:
    """Every contender once, hybrid's interleaved with the peers (the order of one round)."""
    out: List[Contender] = []
    for pairs in TABLES.values():
        for pair in pairs:
            for c in pair:
                if c not in out:
                    out.append(c)
    return out


# ---- the model: model_zoo's GPT, and a plain-PyTorch twin for the peers ----------------------------
def gpt_config(args):
    from model_zoo import GPTConfig

    return GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                     seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0)


class PlainBlock(nn.Module):
    """One pre-LN block in plain nn modules (separate q/k/v so DTensor column sharding splits heads)."""

    def __init__(self, h: int, f: int, heads: int, eps: float):
        super().__init__()
        self.head_dim = h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.fc_in, self.fc_out = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, _ = x.shape
        a = self.ln1(x)
        q, k, v = (proj(a).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(ctx)
        return x + self.fc_out(F.gelu(self.fc_in(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """The model_zoo GPT-2 architecture (learned positions, tied head) in plain PyTorch."""

    def __init__(self, cfg):
        super().__init__()
        self.vocab = cfg.vocab_size
        self.wte = nn.Embedding(cfg.padded_vocab_size(1), cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.num_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(PlainBlock(cfg.hidden_size, cfg.ffn_size, cfg.num_heads, cfg.norm_eps)
                                    for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """ids, labels: [b, s] -> the mean token cross-entropy (a scalar)."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., : self.vocab]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    @classmethod
    def from_zoo(cls, cfg) -> "PlainGPT":
        """Built with the weights of ``GPTModel(cfg, Topology.local())`` (same seed: same model)."""
        from hybrid import Topology
        from model_zoo import GPTModel

        zoo = dict(GPTModel(cfg, Topology.local()).named_parameters())
        model = cls(cfg)
        with torch.no_grad():
            model.wte.weight.copy_(zoo["embedding.word_embeddings.weight"])
            model.wpe.weight.copy_(zoo["embedding.position_embeddings.weight"])
            for i, blk in enumerate(model.blocks):
                p = f"layers.{i}."
                pairs = [(blk.ln1, "input_norm"), (blk.ln2, "post_attention_norm"), (blk.o, "attention.out_proj"),
                         (blk.fc_in, "mlp.in_proj"), (blk.fc_out, "mlp.out_proj")]
                for mod, name in pairs:
                    mod.weight.copy_(zoo[p + name + ".weight"])
                    mod.bias.copy_(zoo[p + name + ".bias"])
                for mod, w, b in zip((blk.q, blk.k, blk.v), zoo[p + "attention.qkv_proj.weight"].chunk(3),
                                     zoo[p + "attention.qkv_proj.bias"].chunk(3)):
                    mod.weight.copy_(w)
                    mod.bias.copy_(b)
            model.ln_f.weight.copy_(zoo["final_norm.weight"])
            model.ln_f.bias.copy_(zoo["final_norm.bias"])
        return model


def batch(step: int, args) -> tuple:
    """Global batch ``step``: (ids, labels), each [global_batch, seq] (a copy task, so the loss moves)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g)
    return x, x.clone()


def param_groups(named, wd: float, decay_1d: bool = False) -> List[dict]:
    """hybrid's default weight-decay rule as torch param groups: [decayed, exempt (biases, norm weights)]."""
    from hybrid.engine.builders import decay_everything, exclude_1d_params

    exempt = decay_everything if decay_1d else exclude_1d_params
    named = list(named)
    return [{"params": [p for n, p in named if not exempt(n, p)], "weight_decay": wd},
            {"params": [p for n, p in named if exempt(n, p)], "weight_decay": 0.0}]


def hybrid_zero_defaults():
    """hybrid's ZeroConfig and OptimizerConfig defaults (what 'matched' copies)."""
    from hybrid.config import OptimizerConfig, ZeroConfig

    return ZeroConfig(), OptimizerConfig()


def _adam_hparams(args) -> dict:
    opt = hybrid_zero_defaults()[1]
    return {"lr": args.lr, "betas": tuple(opt.betas), "eps": opt.eps}


def bucket_elements(args) -> int:
    return args.bucket if args.bucket else hybrid_zero_defaults()[0].bucket_size


def _status_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> None:
    # getrusage's ru_maxrss survives exec, so a spawned child would report its parent's peak;
    # VmHWM belongs to this process image and "5" resets it to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _state_elements(opt) -> int:
    """Tensor elements held in a torch optimizer's state on this rank (DTensors: the local shard)."""
    n = 0
    for state in opt.state.values():
        for key, t in state.items():
            if key != "step" and torch.is_tensor(t):
                n += (t.to_local() if hasattr(t, "to_local") else t).numel()
    return n


def _optimizer_desc(opt) -> dict:
    d = opt.defaults
    return {"class": f"{type(opt).__module__}.{type(opt).__name__}",
            **{k: d[k] for k in ("lr", "betas", "eps", "fused", "foreach") if k in d},
            "weight_decay_by_group": [g["weight_decay"] for g in opt.param_groups]}


# ---- one contender on one rank -----------------------------------------------------------------------
# Each builder returns (step(x, y) -> loss, dp_rank, tp_rank, state_elements() -> int, configuration dict).
def hybrid_config(c: Contender, args) -> dict:
    """The config dict handed to hybrid.initialize: defaults except the training arithmetic (and --bucket)."""
    zero = {"stage": c.stage}
    if args.bucket:
        zero["bucket_size"] = args.bucket
    return {"zero": zero, "micro_batch_size": args.global_batch // (WORLD // c.tp),
            "optimizer": {"lr": args.lr, "weight_decay": args.wd}}


def _build_hybrid(c: Contender, args):
    import hybrid
    from hybrid import Topology
    from model_zoo import GPTModel

    topo = Topology(tp=c.tp)
    model = GPTModel(gpt_config(args), topo)
    engine = hybrid.initialize(model, hybrid_config(c, args), topology=topo)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    def elements():
        rep = engine.optimizer.memory_report()
        return (rep["master"] + rep["optimizer_states"]) // 4

    opt = engine.optimizer
    desc = {"hybrid.initialize": hybrid_config(c, args), "zero (effective)": dataclasses.asdict(engine.config.zero),
            "optimizer (effective)": {k: getattr(engine.config.optimizer, k)
                                      for k in ("type", "lr", "betas", "eps", "weight_decay", "decay_1d_params")},
            "zero optimizer": type(opt).__name__,
            "inner update": "hybrid.kernels cpu_adam" if opt.inner.compiled else "torch._fused_adamw_"}
    return step, topo.dp_rank, topo.tp_rank, elements, desc


def ddp_kwargs(c: Contender, args) -> dict:
    """DDP's arguments: none at defaults (bucket_cap_mb 25); matched: hybrid's bucket, in MB of fp32."""
    return {"bucket_cap_mb": bucket_elements(args) * 4 / 2**20} if c.matched else {}


def _ddp_desc(model) -> dict:
    return {"bucket_bytes_cap": model.bucket_bytes_cap, "gradient_as_bucket_view": model.gradient_as_bucket_view,
            "static_graph": model.static_graph, "find_unused_parameters": model.find_unused_parameters,
            "broadcast_buffers": model.broadcast_buffers}


def _build_torch(c: Contender, args):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = PlainGPT.from_zoo(gpt_config(args))
    dp_rank, tp_rank = rank, 0
    hp = _adam_hparams(args)
    if c.kind in ("ddp", "zero_redundancy"):
        from torch.nn.parallel import DistributedDataParallel

        kwargs = ddp_kwargs(c, args)
        model = DistributedDataParallel(model, **kwargs)
        groups = param_groups(model.module.named_parameters(), args.wd)
        desc = {"DistributedDataParallel kwargs": kwargs, "DDP (effective)": _ddp_desc(model)}
        if c.kind == "ddp":
            opt = torch.optim.AdamW(groups, **hp, fused=True)
            inner = opt
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **hp, fused=True)
            inner = opt.optim
            desc["ZeroRedundancyOptimizer (effective)"] = {
                "overlap_with_ddp": opt._overlap_with_ddp, "parameters_as_bucket_view": opt.parameters_as_bucket_view}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dp_mesh = None
        desc = {}
        if c.kind == "dtensor_tp_fsdp2":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world // c.tp, c.tp), mesh_dim_names=("dp", "tp"))
            dp_mesh = mesh["dp"]
            dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                    "fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()}
            for blk in model.blocks:
                parallelize_module(blk, mesh["tp"], plan)
            desc["parallelize_module plan (each block)"] = {k: type(v).__name__ for k, v in plan.items()}
        kwargs = {"mesh": "dp" if dp_mesh is not None else "default (world)", "reshard_after_forward": c.reshard}
        for blk in model.blocks:
            fully_shard(blk, mesh=dp_mesh, reshard_after_forward=c.reshard)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=c.reshard)
        desc["fully_shard"] = {"units": f"each of {len(model.blocks)} blocks, then the root", **kwargs,
                               "other arguments": "defaults (mp_policy fp32, offload none)"}
        opt = torch.optim.AdamW(param_groups(model.named_parameters(), args.wd), **hp, fused=True)
        inner = opt
    desc["optimizer"] = _optimizer_desc(inner)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, dp_rank, tp_rank, lambda: _state_elements(inner), desc


def deepspeed_config(c: Contender, args) -> dict:
    """The JSON config handed to deepspeed.initialize (defaults: only the training arithmetic is set)."""
    hp = _adam_hparams(args)
    zero: Dict[str, object] = {"stage": c.stage}
    if c.matched:
        zc = hybrid_zero_defaults()[0]
        zero.update(reduce_bucket_size=bucket_elements(args), allgather_bucket_size=bucket_elements(args),
                    overlap_comm=zc.overlap_comm)
        if c.stage == 3:
            zero.update(stage3_prefetch_bucket_size=zc.prefetch_bucket_size,
                        stage3_param_persistence_threshold=zc.persistence_threshold,
                        stage3_max_live_parameters=zc.max_live_parameters)
    return {"train_micro_batch_size_per_gpu": args.global_batch // WORLD, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": hp["lr"], "betas": list(hp["betas"]), "eps": hp["eps"],
                                                      "weight_decay": args.wd}},
            "zero_optimization": zero,
            "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 when the key is absent; no other contender clips
            "steps_per_print": 10**9}


DS_EFFECTIVE_KEYS = ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                     "reduce_scatter", "allgather_partitions", "round_robin_gradients")
DS_STAGE3_KEYS = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                  "max_reuse_distance", "model_persistence_threshold")


def _build_deepspeed(c: Contender, args):
    import deepspeed
    import torch.distributed as dist

    model = PlainGPT.from_zoo(gpt_config(args))
    config = deepspeed_config(c, args)
    engine, opt, _, _ = deepspeed.initialize(model=model, config=config,
                                             model_parameters=param_groups(model.named_parameters(), args.wd))

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    inner = opt
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer

    def count():
        masters = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat",
                                                                                   [])
        return _state_elements(inner) + sum(t.numel() for t in masters)

    zc = engine._config.zero_config
    keys = DS_EFFECTIVE_KEYS + (DS_STAGE3_KEYS if c.stage == 3 else ())
    desc = {"deepspeed.initialize config": config,
            "zero_optimization (effective)": {k: getattr(zc, k) for k in keys},
            "ZeRO optimizer": type(opt).__name__, "optimizer": _optimizer_desc(inner),
            "gradient_clipping (effective)": engine.gradient_clipping()}
    return step, dist.get_rank(), 0, count, desc


def bench_child(c: Contender, args) -> Dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    _reset_peak_rss()
    base = _status_mb("VmRSS")
    build = {"hybrid": _build_hybrid, "deepspeed": _build_deepspeed}.get(c.kind, _build_torch)
    step, dp_rank, tp_rank, count, desc = build(c, args)
    micro = args.global_batch // (dist.get_world_size() // c.tp)
    times, cpu, losses = [], [], []
    for s in range(args.warmup + args.steps):
        x, y = batch(s, args)
        x, y = x[dp_rank * micro:(dp_rank + 1) * micro], y[dp_rank * micro:(dp_rank + 1) * micro]
        t0, c0 = time.perf_counter(), time.process_time()  # process time: every thread, gloo's included
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
    peak = _status_mb("VmHWM")
    return {"times": times[args.warmup:], "cpu": cpu[args.warmup:], "losses": losses, "dp_rank": dp_rank,
            "tp_rank": tp_rank, "peak_mb": peak, "base_mb": base, "state_elements": count(),
            "config": desc if dist.get_rank() == 0 else None}


# ---- the reference, and how far from it a contender may land -----------------------------------------
def reference_losses(args, dtype: torch.dtype = torch.float32, decay_1d: bool = False) -> List[float]:
    """One process, whole global batches, torch.optim.AdamW: the losses every contender should reproduce."""
    torch.manual_seed(0)
    model = PlainGPT.from_zoo(gpt_config(args)).to(dtype)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), args.wd, decay_1d), **_adam_hparams(args))
    out = []
    for s in range(args.warmup + args.steps):
        loss = model(*batch(s, args))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def loss_tolerance(ref64: Sequence[float], ref32: Sequence[float]) -> float:
    """How far a contender's loss may be from the float64 reference at any step.

    Every contender computes the same function in fp32 in its own reduction
    order (gloo's ring sums, TP's split matmuls, a fused qkv, DeepSpeed's
    buckets). The fp32 reference's distance to float64 is the rounding this
    training accumulates in one order; another order rounds differently but by
    the same law, so two fp32 runs may land up to twice that apart, and we
    allow 4x. A short run can be luckily close to float64, so the floor is one
    fp32 rounding of the loss value itself (eps * |loss|), again 4x.
    """
    eps = torch.finfo(torch.float32).eps
    observed = max(abs(a - b) for a, b in zip(ref32, ref64))
    return 4 * max(observed, eps * max(abs(v) for v in ref64))


# ---- driver ------------------------------------------------------------------------------------------
def summarise(per_rank: List[Dict], ref64: List[float]) -> Dict:
    """One run of one contender: per-step slowest-rank times -> its median, peak RSS, DP-averaged losses."""
    steps = len(per_rank[0]["times"])
    slowest = [max(r["times"][i] for r in per_rank) for i in range(steps)]  # a step ends when every rank is done
    tp0 = [r for r in per_rank if r["tp_rank"] == 0]
    losses = [sum(r["losses"][i] for r in tp0) / len(tp0) for i in range(len(ref64))]
    cpu = [sum(r["cpu"][i] for r in per_rank) for i in range(steps)]  # CPU seconds of all ranks together
    return {"median_ms": 1e3 * statistics.median(slowest), "cpu_ms": 1e3 * statistics.median(cpu),
            "peak_mb": max(r["peak_mb"] for r in per_rank),
            "train_mb": max(r["peak_mb"] - r["base_mb"] for r in per_rank),
            "state_elements": max(r["state_elements"] for r in per_rank),
            "losses": losses, "max_dloss": max(abs(a - b) for a, b in zip(losses, ref64)),
            "config": next(r["config"] for r in per_rank if r["config"] is not None)}


def round_order(contenders: Sequence[Contender], round_: int) -> List[Contender]:
    """Round r's order: as listed on even rounds, reversed on odd ones (a drifting load hits both ends alike)."""
    return list(contenders) if round_ % 2 == 0 else list(reversed(contenders))


def pair_rows(runs: Mapping[str, Mapping[int, Dict]], pairs: Sequence[Tuple[Contender, Contender]]) -> List[Dict]:
    """One row per (hybrid, peer) pair that has rounds in common: medians over rounds and the paired ratio.

    ``runs[name][round]``: that contender's summary in that round (rounds where it failed are absent).
    """
    rows = []
    for h, p in pairs:
        hr, pr = runs.get(h.name, {}), runs.get(p.name, {})
        ratio = paired_ratio({r: v["median_ms"] for r, v in hr.items()}, {r: v["median_ms"] for r, v in pr.items()})
        if ratio is None:
            continue
        med = lambda rs, key: statistics.median(rs[r][key] for r in ratio.rounds)  # noqa: E731
        rows.append({"hybrid": h.name, "peer": p.name, "hybrid_ms": med(hr, "median_ms"),
                     "peer_ms": med(pr, "median_ms"), "ratio": ratio,
                     "hybrid_peak_mb": max(hr[r]["peak_mb"] for r in ratio.rounds),
                     "peer_peak_mb": max(pr[r]["peak_mb"] for r in ratio.rounds),
                     "hybrid_loss": hr[ratio.rounds[-1]]["losses"][-1], "peer_loss": pr[ratio.rounds[-1]]["losses"][-1]})
    return rows


def format_pair_table(rows: Sequence[Dict]) -> List[str]:
    head = (f"{'hybrid':24s} {'peer':40s} {'hybrid':>9s} {'peer':>9s} {'paired ratio (min-max)':>23s} "
            f"{'peak RSS/rank hybrid':>20s} {'peer':>7s} {'final loss hybrid':>17s} {'peer':>9s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['hybrid']:24s} {r['peer']:40s} {r['hybrid_ms']:7.1f}ms {r['peer_ms']:7.1f}ms "
                     f"{r['ratio'].format():>23s} {r['hybrid_peak_mb']:17.0f} MB {r['peer_peak_mb']:4.0f} MB "
                     f"{r['hybrid_loss']:17.5f} {r['peer_loss']:9.5f}")
    return lines


def format_contender_table(runs: Mapping[str, Mapping[int, Dict]], contenders: Sequence[Contender], psi: int,
                           tol: float) -> List[str]:
    head = (f"{'contender':40s} {'median per round (ms)':>24s} {'CPU/step':>9s} {'peak RSS/rank':>14s} "
            f"{'RSS growth':>11s} {'opt-state elems/rank':>21s} {'final loss':>11s} {'max |dloss|':>12s}")
    lines = [head, "-" * len(head)]
    for c in contenders:
        rs = runs.get(c.name, {})
        if not rs:
            continue
        last = rs[max(rs)]
        per_round = " ".join(f"{rs[r]['median_ms']:.0f}" for r in sorted(rs))
        cpu = statistics.median(v["cpu_ms"] for v in rs.values())
        worst = _worst_dloss(rs)
        lines.append(f"{c.name:40s} {per_round:>24s} {cpu / 1e3:8.2f}s {max(v['peak_mb'] for v in rs.values()):11.0f}"
                     f" MB {max(v['train_mb'] for v in rs.values()):8.0f} MB {last['state_elements']:>14,d} "
                     f"({last['state_elements'] / psi:4.2f}Ψ) {last['losses'][-1]:11.5f} {worst:10.2e}"
                     f"{'' if worst <= tol else ' !'}")
    return lines


def _worst_dloss(rs: Mapping[int, Dict]) -> float:
    """The largest loss gap over a contender's rounds; NaN if any was not finite (max() would skip a NaN)."""
    gaps = [v["max_dloss"] for v in rs.values()]
    return max(gaps) if all(math.isfinite(g) for g in gaps) else float("nan")


def loss_problems(runs: Mapping[str, Mapping[int, Dict]], tol: float) -> List[str]:
    """Contenders whose loss left the tolerance at some step of some round (or went non-finite)."""
    bad = []
    for name, rs in runs.items():
        worst = _worst_dloss(rs)
        if not worst <= tol:
            bad.append(f"{name}: max |loss - float64 reference| {worst:.2e} > {tol:.2e}")
    return bad


QUICK = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 1024, "seq": 32, "global_batch": 8, "steps": 3,
         "warmup": 1, "rounds": 2}
QUICK_ONLY = "hybrid zero-1,torch DDP"  # both tables' rows for one pair (each launch costs ~10 s of imports)


def parse(argv=None) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all contenders")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.1, help="weight decay of >=2-D parameters, every contender")
    ap.add_argument("--bucket", type=int, default=0,
                    help="hybrid's zero.bucket_size (elements), and the matched peers'; 0: hybrid's default")
    ap.add_argument("--only", default="", help="comma-separated substrings of contender names to run")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model, 2 rounds of 3 steps, --only '" + QUICK_ONLY + "' unless given: the "
                         "machinery end to end in ~2-3 minutes on 2 shared cores, not a measurement ("
                         + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ")")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "zero_vs_peers.json"),
                    help="where to write the results ('' for nowhere)")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.only = args.only or QUICK_ONLY
    for what, size in (("--global-batch", WORLD), ("--hidden", args.heads)):
        if getattr(args, what[2:].replace("-", "_")) % size:
            ap.error(f"{what} must be divisible by {size}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    have_ds = importlib.util.find_spec("deepspeed") is not None
    chosen = [c for c in all_contenders() if (c.kind != "deepspeed" or have_ds)
              and (not args.only or any(s.strip() in c.name for s in args.only.split(",")))]
    ref64 = reference_losses(args, torch.float64)
    ref32 = reference_losses(args)
    psi = sum(p.numel() for p in PlainGPT.from_zoo(gpt_config(args)).parameters())
    tol = loss_tolerance(ref64, ref32)
    decay_all_gap = max(abs(a - b) for a, b in zip(reference_losses(args, torch.float64, decay_1d=True), ref64))
    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    runs: Dict[str, Dict[int, Dict]] = {}
    failures: Dict[str, Dict[int, str]] = {}
    loads: List[List[float]] = []

    def report() -> Tuple[List[str], List[str]]:
        finished = datetime.datetime.now().astimezone()

        zc = hybrid_zero_defaults()[0]
        out: List[str] = []
        out.append(f"\n{started:%Y-%m-%d %H:%M}-{finished:%H:%M} {started.tzname()}; world {WORLD} (gloo, "
                   f"{os.cpu_count()} CPU cores, 1 torch thread per rank), GPT h={args.hidden} L={args.layers} "
                   f"heads={args.heads} seq={args.seq} vocab={args.vocab} (Ψ = {psi:,} parameters), global batch "
                   f"{args.global_batch}, fp32 AdamW lr {args.lr} weight decay {args.wd} on >=2-D parameters only; "
                   f"{args.rounds} interleaved rounds x {args.steps} measured steps after {args.warmup} warm-up")
        out.append(f"load average (1/5/15 min) at start {' '.join(f'{v:.2f}' for v in load_start)}; after each round "
                   + "; ".join(" ".join(f"{v:.2f}" for v in ld) for ld in loads))
        out.append(f"hybrid's bucket {bucket_elements(args):,} elements, overlap_comm {zc.overlap_comm}"
                   f"{' (--bucket)' if args.bucket else ' (its defaults)'}\n")
        tables = {}
        for title, pairs in TABLES.items():
            rows = pair_rows(runs, pairs)
            tables[title] = rows
            label = ("DEFAULTS: every peer at its own defaults" if title == "defaults" else
                     "MATCHED: peers' bucket size and overlap set to hybrid's (FSDP2 has neither: same runs as defaults)")
            out += [label, *format_pair_table(rows), ""]
        out.append("paired ratio = per round, hybrid's median step time / the peer's in the same round; median over "
                   "rounds (min-max). Below 1: hybrid faster. A step's time is the slowest rank's.\n")
        out += format_contender_table(runs, chosen, psi, tol)
        out.append(f"\nfinal loss: DP-averaged loss of the last step (last round). max |dloss| = largest gap, over every "
                   f"step and round, to one float64 process training the same model on the same global batches; "
                   f"tolerance {tol:.2e} (see loss_tolerance; the fp32 single process is "
                   f"{max(abs(a - b) for a, b in zip(ref32, ref64)):.2e} away). For scale, decaying biases and norm "
                   f"weights too would move the loss by {decay_all_gap:.2e}"
                   + (" (the tolerance is below it: the check tells the two trainings apart)." if tol < decay_all_gap
                      else "; the tolerance is NOT below it: this check cannot tell the two apart at this size."))
        out.append("\nconfigurations (rank 0's, as used):")
        for c in chosen:
            if c.name in runs:
                cfg = runs[c.name][max(runs[c.name])]["config"]
                out.append(f"  {c.name}: {json.dumps(cfg, default=str)}")
        if not have_ds:
            out.append("\ndeepspeed is not installed: its rows are left out "
                       "(DS_ACCELERATOR=cpu pip install --no-build-isolation deepspeed).")
        for name, fails in failures.items():
            out.append(f"FAILED {name}: " + "; ".join(f"round {r + 1}: {m}" for r, m in fails.items()))
        problems = loss_problems(runs, tol)
        out += [f"LOSS MISMATCH {p}" for p in problems]

        if args.json:  # after every round, so a run cut short keeps the rounds it finished
            result = {"command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
                      "started": started.isoformat(timespec="seconds"), "finished": finished.isoformat(timespec="seconds"),
                      "args": vars(args), "cpu_count": os.cpu_count(), "loadavg_start": load_start, "loadavg_rounds": loads,
                      "psi": psi, "loss_tolerance": tol, "reference_losses_fp64": ref64, "reference_losses_fp32": ref32,
                      "decay_all_gap": decay_all_gap,
                      "tables": {t: [{**r, "ratio": r["ratio"].as_dict()} for r in rows] for t, rows in tables.items()},
                      "runs": {n: {str(r + 1): v for r, v in rs.items()} for n, rs in runs.items()},
                      "failures": {n: {str(r + 1): m for r, m in fs.items()} for n, fs in failures.items()},
                      "rounds_done": len(loads), "text": "\n".join(out)}
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return out, problems

    for round_ in range(args.rounds):
        for c in round_order(chosen, round_):
            env = {"DS_ACCELERATOR": "cpu"} if c.kind == "deepspeed" else None
            t0 = time.time()
            try:
                row = summarise(run_distributed(bench_child, WORLD, c, args, timeout=1800, env=env, start="spawn"), ref64)
            except Exception as err:  # noqa: BLE001 - one failed contender must not lose the others' figures
                first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                failures.setdefault(c.name, {})[round_] = first
                print(f"[round {round_ + 1}, {time.time() - t0:5.1f}s] {c.name}: FAILED: {first}", flush=True)
                continue
            runs.setdefault(c.name, {})[round_] = row
            print(f"[round {round_ + 1}, {time.time() - t0:5.1f}s] {c.name}: {row['median_ms']:.1f} ms/step, "
                  f"final loss {row['losses'][-1]:.5f}", flush=True)
        loads.append(list(os.getloadavg()))
        report()
    out, problems = report()
    print("\n".join(out))
    if args.json:
        print(f"\nresults: {args.json}")
    if failures or problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
