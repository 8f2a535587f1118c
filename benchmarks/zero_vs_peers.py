"""hybrid ZeRO stages 0/1/2 (and TP=2 x DP=2) against torch's and DeepSpeed's data-parallel trainers.

Every contender trains the same small GPT (the model_zoo GPT for hybrid, an
equivalent plain-PyTorch twin loaded with the same weights for the peers) on
the same global batches from the same seed, with AdamW, on 4 gloo ranks of
this machine. Each contender runs in fresh processes so its peak RSS is its own.

Matching peers (the "vs peer" ratio is hybrid's median step time over the peer's):

====================  ======================================================
hybrid zero-0         torch DDP                       (DeepSpeed ZeRO-0)
hybrid zero-1         torch ZeroRedundancyOptimizer   (DeepSpeed ZeRO-1)
hybrid zero-2         FSDP2 fully_shard, no reshard   (DeepSpeed ZeRO-2)
hybrid tp2 x dp2      DTensor TP + FSDP2
====================  ======================================================

DeepSpeed rows appear when ``deepspeed`` is importable (install it with
``DS_ACCELERATOR=cpu pip install --no-build-isolation deepspeed``).

Reproduce (from the repository root)::

    python benchmarks/zero_vs_peers.py                 # defaults: 2 rounds, ~12 min on 2 cores with DeepSpeed
    python benchmarks/zero_vs_peers.py --repeat 1 --steps 4 --hidden 128 --layers 2   # a quick look
    python benchmarks/zero_vs_peers.py --only "zero-1,Redundancy"                      # some rows only

Wall time on a shared 2-core machine is noisy; the rounds are interleaved and
each contender keeps its best median, and the CPU-time column (all threads of
all ranks) is the steadier measure of work per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.multiproc import run_distributed  # noqa: E402  (the repository's gloo process harness)

WORLD = 4


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # hybrid | ddp | zero_redundancy | fsdp2 | dtensor_tp_fsdp2 | deepspeed
    stage: int = 0
    tp: int = 1
    peer: Optional[str] = None  # the torch contender this one is measured against
    ds_peer: Optional[str] = None  # the DeepSpeed contender this one is measured against


CONTENDERS = [
    Contender("hybrid zero-0", "hybrid", 0, peer="torch DDP", ds_peer="DeepSpeed zero-0"),
    Contender("hybrid zero-1", "hybrid", 1, peer="torch ZeroRedundancyOpt", ds_peer="DeepSpeed zero-1"),
    Contender("hybrid zero-2", "hybrid", 2, peer="torch FSDP2 (zero-2)", ds_peer="DeepSpeed zero-2"),
    Contender("hybrid tp2 x dp2 zero-2", "hybrid", 2, tp=2, peer="torch DTensor TP2 + FSDP2"),
    Contender("torch DDP", "ddp"),
    Contender("torch ZeroRedundancyOpt", "zero_redundancy"),
    Contender("torch FSDP2 (zero-2)", "fsdp2"),
    Contender("torch DTensor TP2 + FSDP2", "dtensor_tp_fsdp2", tp=2),
    Contender("DeepSpeed zero-0", "deepspeed", 0),
    Contender("DeepSpeed zero-1", "deepspeed", 1),
    Contender("DeepSpeed zero-2", "deepspeed", 2),
]


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
    """Global batch ``step`` [global_batch, seq] (a copy task, so the loss moves)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=g)
    return x, x.clone()


def param_groups(named, wd: float) -> List[dict]:
    """Decay matrices only, as the hybrid runs do (no_weight_decay = 1-D parameters)."""
    named = list(named)
    return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": wd},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]


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


# ---- one contender on one rank -----------------------------------------------------------------------
def _build_hybrid(c: Contender, args):
    from hybrid import Topology
    from hybrid.config import OptimizerConfig, ZeroConfig
    from hybrid.zero import build_zero_optimizer
    from model_zoo import GPTModel

    topo = Topology(tp=c.tp)
    model = GPTModel(gpt_config(args), topo)
    model.check_inputs = False
    opt = build_zero_optimizer(model, topo, ZeroConfig(stage=c.stage, bucket_size=args.bucket),
                               OptimizerConfig(lr=args.lr, weight_decay=args.wd),
                               no_weight_decay=lambda n, p: p.ndim < 2)

    def step(x, y):
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    elements = lambda: opt.inner.state_bytes() // 4 + sum(p.master_bytes() for p in opt.partitions) // 4  # noqa: E731
    return step, topo.dp_rank, topo.tp_rank, elements


def _build_torch(c: Contender, args):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = gpt_config(args)
    model = PlainGPT.from_zoo(cfg)
    dp_rank, tp_rank = rank, 0
    if c.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
        opt = torch.optim.AdamW(param_groups(model.module.named_parameters(), args.wd), lr=args.lr, fused=True)
        count = lambda: _state_elements(opt)  # noqa: E731
    elif c.kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
        opt = ZeroRedundancyOptimizer(param_groups(model.module.named_parameters(), args.wd),
                                      optimizer_class=torch.optim.AdamW, lr=args.lr, fused=True)
        count = lambda: _state_elements(opt.optim)  # noqa: E731
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dp_mesh = None
        if c.kind == "dtensor_tp_fsdp2":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world // c.tp, c.tp), mesh_dim_names=("dp", "tp"))
            dp_mesh = mesh["dp"]
            dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                    "fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()}
            for blk in model.blocks:
                parallelize_module(blk, mesh["tp"], plan)
        for blk in model.blocks:
            fully_shard(blk, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
        opt = torch.optim.AdamW(param_groups(model.named_parameters(), args.wd), lr=args.lr, foreach=True)
        count = lambda: _state_elements(opt)  # noqa: E731

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, dp_rank, tp_rank, count


def _build_deepspeed(c: Contender, args):
    import deepspeed
    import torch.distributed as dist

    model = PlainGPT.from_zoo(gpt_config(args))
    micro = args.global_batch // dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.wd}},
              "zero_optimization": {"stage": c.stage, "reduce_bucket_size": args.bucket, "overlap_comm": True},
              "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips to 1.0 when the key is absent; no one else clips
              "steps_per_print": 10**9}
    engine, opt, _, _ = deepspeed.initialize(model=model, config=config,
                                             model_parameters=param_groups(model.named_parameters(), args.wd))

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    def count():
        inner = opt
        while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
            inner = inner.optimizer
        n = _state_elements(inner if isinstance(inner, torch.optim.Optimizer) else opt.optimizer)
        masters = getattr(opt, "single_partition_of_fp32_groups", [])
        return n + sum(t.numel() for t in masters)

    return step, dist.get_rank(), 0, count


def bench_child(c: Contender, args) -> Dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    _reset_peak_rss()
    base = _status_mb("VmRSS")
    build = {"hybrid": _build_hybrid, "deepspeed": _build_deepspeed}.get(c.kind, _build_torch)
    step, dp_rank, tp_rank, count = build(c, args)
    dp = dist.get_world_size() // c.tp
    micro = args.global_batch // dp
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
    return {"times": times[args.warmup:], "cpu": cpu[args.warmup:], "losses": losses, "dp_rank": dp_rank, "tp_rank": tp_rank,
            "peak_mb": peak, "base_mb": base, "state_elements": count()}


def reference_losses(args) -> List[float]:
    """One process, whole global batches, torch.optim.AdamW: the loss every contender should reproduce."""
    torch.manual_seed(0)
    model = PlainGPT.from_zoo(gpt_config(args))
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), args.wd), lr=args.lr)
    out = []
    for s in range(args.warmup + args.steps):
        loss = model(*batch(s, args))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


# ---- driver ------------------------------------------------------------------------------------------
def summarise(c: Contender, per_rank: List[Dict], ref: List[float]) -> Dict:
    steps = len(per_rank[0]["times"])
    slowest = [max(r["times"][i] for r in per_rank) for i in range(steps)]  # a step ends when every rank is done
    tp0 = [r for r in per_rank if r["tp_rank"] == 0]
    losses = [sum(r["losses"][i] for r in tp0) / len(tp0) for i in range(len(ref))]
    cpu = [sum(r["cpu"][i] for r in per_rank) for i in range(steps)]  # CPU seconds of all ranks together
    return {"name": c.name, "median_ms": 1e3 * statistics.median(slowest), "cpu_ms": 1e3 * statistics.median(cpu),
            "peak_mb": max(r["peak_mb"] for r in per_rank),
            "train_mb": max(r["peak_mb"] - r["base_mb"] for r in per_rank),
            "state_elements": max(r["state_elements"] for r in per_rank),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref))}


def print_table(rows: Dict[str, Dict], contenders: List[Contender], psi: int) -> None:
    head = (f"{'contender':28s} {'median step':>12s} {'vs peer':>8s} {'vs DS':>7s} {'CPU/step':>9s} "
            f"{'peak RSS/rank':>14s} "
            f"{'RSS growth':>11s} {'opt-state elems/rank':>21s} {'max |dloss|':>12s}")
    print(head)
    print("-" * len(head))
    for c in contenders:
        if c.name not in rows:
            continue
        r = rows[c.name]
        ratio = lambda peer: (f"{r['median_ms'] / rows[peer]['median_ms']:.2f}x"  # noqa: E731
                              if peer in rows else "")
        print(f"{c.name:28s} {r['median_ms']:10.1f}ms {ratio(c.peer):>8s} {ratio(c.ds_peer):>7s} "
              f"{r['cpu_ms'] / 1e3:8.2f}s "
              f"{r['peak_mb']:11.0f} MB {r['train_mb']:8.0f} MB {r['state_elements']:>14,d} "
              f"({r['state_elements'] / psi:4.2f}Ψ) {r['loss_diff']:12.2e}")
    print(f"\nΨ = {psi:,} parameters. 'vs peer' / 'vs DS' = hybrid's median step time over the matching torch / "
          f"DeepSpeed contender's (below 1 = hybrid faster). CPU/step = CPU time of all 4 ranks (every thread) "
          f"per step, which a busy machine disturbs less than wall time. RSS growth = peak RSS minus RSS before the model "
          f"was built. max |dloss| = largest gap, over all steps, between the DP-averaged loss and one process "
          f"training on the same global batches.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bucket", type=int, default=1_000_000, help="gradient bucket, elements (4 MB in fp32)")
    ap.add_argument("--only", default="", help="comma-separated substrings of contender names to run")
    ap.add_argument("--repeat", type=int, default=2, help="rounds over all contenders; the best median counts")
    args = ap.parse_args(argv)
    if args.global_batch % WORLD:
        ap.error(f"--global-batch must be divisible by the world size {WORLD}")
    have_ds = importlib.util.find_spec("deepspeed") is not None
    chosen = [c for c in CONTENDERS if (c.kind != "deepspeed" or have_ds)
              and (not args.only or any(s.strip() in c.name for s in args.only.split(",")))]
    ref = reference_losses(args)
    psi = sum(p.numel() for p in PlainGPT.from_zoo(gpt_config(args)).parameters())
    rows: Dict[str, Dict] = {}
    for round_ in range(args.repeat):  # interleaved rounds: a busy spell hits every contender alike
        for c in chosen:
            env = {"DS_ACCELERATOR": "cpu"} if c.kind == "deepspeed" else None
            t0 = time.time()
            row = summarise(c, run_distributed(bench_child, WORLD, c, args, timeout=1800, env=env), ref)
            print(f"[round {round_ + 1}, {time.time() - t0:5.1f}s] {c.name}: {row['median_ms']:.1f} ms/step",
                  flush=True)
            if c.name not in rows or row["median_ms"] < rows[c.name]["median_ms"]:
                rows[c.name] = row
    if not have_ds:
        print("\ndeepspeed is not installed: its rows are left out "
              "(DS_ACCELERATOR=cpu pip install --no-build-isolation deepspeed).")
    print(f"\nworld {WORLD} (gloo, {os.cpu_count()} CPU cores), GPT h={args.hidden} L={args.layers} "
          f"seq={args.seq} vocab={args.vocab}, global batch {args.global_batch}, fp32 AdamW, "
          f"{args.steps} measured steps after {args.warmup} warm-up, best median of {args.repeat} rounds\n")
    print_table(rows, chosen, psi)
    if not math.isfinite(sum(r["loss_diff"] for r in rows.values())):
        raise SystemExit("a contender produced a non-finite loss")


if __name__ == "__main__":
    main()
