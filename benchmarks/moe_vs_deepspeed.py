"""hybrid's MoE layer against DeepSpeed-MoE (``deepspeed.moe.layer.MoE``): forward + backward, EP 2 and 4.

Both layers get the same problem: hidden size ``--hidden``, ``--experts``
routed SwiGLU experts of ``--expert-ffn`` channels without biases (the
Mixtral shape; DeepSpeed is handed that expert as its ``expert`` module),
top-2 softmax routing renormalised over the two chosen experts, fp32, expert
parallel over all ranks (EP = world size: ``hybrid.Topology(tp=1, ep=world)``,
DeepSpeed's ``ep_size=world``), each rank feeding its own ``[s, b, h]`` input.
The balancing loss joins the backward pass in both (coefficient ``--aux``).
Two settings, each its own contender pair:

* **capacity**: hybrid's ``moe_expert_capacity_factor = --capacity-factor``
  against DeepSpeed's ``drop_tokens=True, capacity_factor=`` the same. Each
  counts capacity its own way (hybrid: ``ceil(c*s*k/E)`` per sequence;
  DeepSpeed: ``ceil(c*k*T/E)`` over the rank's ``T = s*b`` tokens), so the two
  keep the same number of tokens per expert and rank when routing is even.
* **dropless**: hybrid's default (no capacity factor) against DeepSpeed's
  ``drop_tokens=False`` (its capacity becomes the largest expert load over
  the EP group, and every expert's buffer is padded to it).

DeepSpeed's other switches are set so that both compute the same function:
``top2_2nd_expert_sampling=False`` (its default draws the second expert with
Gumbel noise), ``use_rts=False`` (random token selection is top-1 only
anyway), no noisy gate, no residual MoE. The timing run copies hybrid's
weights into DeepSpeed's layer and prints how far the dropless outputs and
input gradients are apart (they must agree to fp32 rounding).

Run under torchrun, one process per rank (EP = world), both libraries in ONE
interpreter (a virtual environment with DeepSpeed and ``pip install -e`` of
this repository: see ``benchmarks/moe.md``)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 benchmarks/moe_vs_deepspeed.py --out /tmp/ep2.json
    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 4 benchmarks/moe_vs_deepspeed.py --out /tmp/ep4.json

Timing: rounds are interleaved in the same processes (round r runs every
contender once, in reversed order on odd rounds); a contender's round is
``--warmup`` steps then ``--steps`` timed steps, each step opened by a
barrier, its time the slowest rank's. Per contender: the median over rounds
of the per-round medians, and the min-max of the per-round medians; the
ratio is PAIRED (hybrid / DeepSpeed within each round; median and min-max
over rounds, ``benchmarks/paired.py``). Beside the wall time, each step's CPU
time (``time.process_time``: every thread of the process, so gloo's too, and
no time spent blocked) summed over the ranks: on a machine whose cores other
jobs share, wall time swings with their load, while the CPU work a step does
moves much less, so its paired ratio is the steadier comparison of the two
implementations' own cost.

Peak RSS cannot be told apart in one process that built both layers, so
``--contenders NAME`` runs one contender alone in its own process group
(fresh interpreters: one torchrun per contender) and reports each rank's
``VmHWM`` (peak resident set). A DeepSpeed-only run never imports hybrid's
model code and a hybrid-only run never imports DeepSpeed.

``python benchmarks/moe_vs_deepspeed.py`` (no torchrun) is the driver: for
every ``--worlds`` size it launches the timing run, then one RSS run per
contender, and prints the tables and every command it ran. Results go to
``--json`` (default ``benchmarks/results/moe_vs_deepspeed.json``).

``--profile`` (default on in the timing run) profiles ``--steps`` extra
steps of each contender on every rank after the timed rounds with
``torch.profiler`` and prints rank 0's operators by self CPU time, grouped
into routing, dispatch/combine data movement, all-to-all (which includes
waiting for the slowest peer), expert matmuls and the rest.

DeepSpeed's processes abort (SIGABRT) at interpreter exit after the results
(its own teardown); every result is written before that, and the driver
accepts a run whose JSON is complete.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.paired import paired_ratio  # noqa: E402

LIBS = ("hybrid", "deepspeed")
MODES = ("capacity", "dropless")
CONTENDERS = [f"{lib} {mode}" for mode in MODES for lib in LIBS]


# ---- process-local measurements ----------------------------------------------------------------------------
def status_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (``clear_refs`` 5), so a later VmHWM is this process's peak from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---- the expert both libraries run -------------------------------------------------------------------------
class SwiGLUExpert(nn.Module):
    """One routed expert as hybrid lays it out: ``in_proj`` ``[2f, h]`` = ``[gate; up]``, ``out_proj`` ``[h, f]``,
    no biases. ``[n, h] -> [n, h]`` (DeepSpeed calls it on ``[ep, C, h]`` slot buffers; any leading dims work)."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.in_proj = nn.Linear(h, 2 * f, bias=False)
        self.out_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.in_proj(x).chunk(2, dim=-1)
        return self.out_proj(F.silu(gate) * up)


# ---- the two contenders: build -> (forward+backward step, description, counters) ------------------------------
class Layer:
    """One built contender on this rank. ``step(x, g)``: forward ``x`` ``[s, b, h]``, backward with upstream
    gradient ``g`` (plus the balancing loss); returns the output (detached). ``a2a_bytes()``: bytes this rank
    sent to other ranks in all-to-alls since the last ``reset()``; ``dropped()``: (dropped, assignments)."""

    def __init__(self, name: str, module: nn.Module, step: Callable, desc: dict, a2a_bytes: Callable,
                 dropped: Callable, reset: Callable):
        self.name, self.module, self.step, self.desc = name, module, step, desc
        self.a2a_bytes, self.dropped, self.reset = a2a_bytes, dropped, reset


def hybrid_config(args, mode: str):
    from model_zoo import GPTConfig

    return GPTConfig(vocab_size=128, hidden_size=args.hidden, num_layers=1, num_heads=args.heads,
                     seq_length=args.seq, mlp="swiglu", bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                     num_experts=args.experts, moe_ffn_hidden_size=args.expert_ffn, moe_router_topk=args.topk,
                     moe_aux_loss_coeff=args.aux,
                     moe_expert_capacity_factor=args.capacity_factor if mode == "capacity" else None,
                     moe_grouped_gemm=args.grouped_gemm).validate()


def build_hybrid(args, mode: str, topo) -> Layer:
    from hybrid.tensor_parallel.random import RNGTracker
    from model_zoo import moe as zmoe
    from model_zoo.transformer import output_init

    cfg = hybrid_config(args, mode)
    aux_scale = zmoe.AuxLossScale()  # 1.0: no loss scale, no accumulation (the balancing loss's gradient as is)
    layer = zmoe.MoELayer(cfg, topo, RNGTracker(1234, topo), aux_scale, output_init(cfg), device=torch.device("cpu"),
                          dtype=torch.float32)
    with torch.no_grad():  # N(0, init_std) drawn per global name: the same weights at every EP size
        for name, p in layer.named_parameters():
            g = torch.Generator().manual_seed(sum(ord(c) * 131 ** i for i, c in enumerate(name)) % 2**31)
            p.normal_(0.0, cfg.init_std, generator=g)
    layer.train()

    def step(x, g, with_aux=True):
        aux_scale.value = 1.0 if with_aux else 0.0  # the balancing loss's gradient factor
        out = layer(x)
        out.backward(g)
        return out.detach()

    def a2a():
        rep = topo.comm.report()
        # moe_dispatch, moe_combine and their backward twins (moe_*_grad); the per-expert count exchange is
        # E integers and not counted (DeepSpeed's dropless capacity all-reduce is not either)
        return sum(v["wire_bytes"] for k, v in rep.items() if k.startswith("moe_"))

    def reset():
        topo.comm.reset_stats()
        layer.stats.reset()

    def dropped():
        return int(layer.stats.dropped), int(layer.stats.assignments)

    desc = {"model_zoo.moe.MoELayer config": {k: v for k, v in cfg.to_dict().items()
                                              if k.startswith("moe_") or k in ("num_experts", "hidden_size", "mlp",
                                                                               "bias")},
            "Topology": f"Topology(tp=1, ep={topo.grid.size('ep')})"}
    return Layer(f"hybrid {mode}", layer, step, desc, a2a, dropped, reset)


class _CountingAllToAll:
    """Stands in for ``deepspeed.moe.sharded_moe._AllToAll`` and counts what each call sends to other ranks
    (DeepSpeed's all-to-all splits its ``[E, C, h]`` buffer equally over the EP group); the backward
    all-to-all calls ``_AllToAll.apply`` again, so it is counted here too)."""

    def __init__(self, original, ep: int):
        self.original, self.ep, self.sent = original, ep, 0

    def apply(self, group, x):
        self.sent += x.numel() * x.element_size() * (self.ep - 1) // self.ep
        return self.original.apply(group, x)


def build_deepspeed(args, mode: str, ep: int) -> Layer:
    import deepspeed
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.layer import MoE

    torch.manual_seed(1234)
    kwargs = dict(hidden_size=args.hidden, num_experts=args.experts, ep_size=ep, k=args.topk,
                  capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                  drop_tokens=mode == "capacity", use_rts=False, top2_2nd_expert_sampling=False)
    layer = MoE(expert=SwiGLUExpert(args.hidden, args.expert_ffn), **kwargs)
    layer.set_deepspeed_parallelism()
    layer.train()
    counter = sharded_moe._AllToAll
    if not isinstance(counter, _CountingAllToAll):
        counter = sharded_moe._AllToAll = _CountingAllToAll(sharded_moe._AllToAll, ep)
    gate = layer.deepspeed_moe.gate
    state = {"dropped": 0, "assignments": 0}

    def step(x, g, with_aux=True):
        out, l_aux, counts = layer(x)
        if args.aux and with_aux:
            torch.autograd.backward([out, l_aux * args.aux], [g, None])
        else:
            out.backward(g)
        # exp_counts: this rank's assignments per expert before dropping; DeepSpeed keeps the first C of each.
        counts = counts.to(torch.long)
        if mode == "capacity":
            tokens = x.numel() // x.shape[-1]
            cap = max(math.ceil(tokens / args.experts * args.capacity_factor * args.topk), gate.min_capacity)
            state["dropped"] += int((counts - cap).clamp(min=0).sum())
        state["assignments"] += int(counts.sum())
        return out.detach()

    def a2a():
        return counter.sent  # _AllToAll's backward calls _AllToAll.apply too: both directions are counted

    def reset():
        counter.sent = 0
        state.update(dropped=0, assignments=0)

    desc = {"deepspeed.moe.layer.MoE": {**kwargs, "expert": f"SwiGLUExpert({args.hidden}, {args.expert_ffn})"},
            "deepspeed": deepspeed.__version__,
            "gate (effective)": {"k": gate.k, "capacity_factor": gate.capacity_factor, "min_capacity":
                                 gate.min_capacity, "drop_tokens": gate.drop_tokens, "use_rts": gate.use_rts,
                                 "top2_2nd_expert_sampling": gate.top2_2nd_expert_sampling,
                                 "noisy_gate_policy": gate.noisy_gate_policy},
            "use_tutel": layer.deepspeed_moe.use_tutel}
    return Layer(f"deepspeed {mode}", layer, step, desc, a2a, lambda: (state["dropped"], state["assignments"]),
                 reset)


def copy_hybrid_into_deepspeed(hy: nn.Module, ds: nn.Module, ep_rank: int, local: int) -> None:
    """DeepSpeed's router and this rank's experts get hybrid's weights (DeepSpeed's local expert i on ep rank r
    is global expert r*local + i, as hybrid places them)."""
    hp = dict(hy.named_parameters())
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(hp["router.weight"])
        for i, ex in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            e = ep_rank * local + i
            ex.in_proj.weight.copy_(hp[f"experts.{e}.in_proj.weight"])
            ex.out_proj.weight.copy_(hp[f"experts.{e}.out_proj.weight"])


# ---- data ---------------------------------------------------------------------------------------------------
def inputs(args, rank: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``--distinct`` (x, upstream gradient) pairs for this rank, each ``[s, b, h]``; steps cycle through them."""
    out = []
    for i in range(args.distinct):
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randn(args.seq, args.micro_batch, args.hidden, generator=g)
        dy = torch.randn(args.seq, args.micro_batch, args.hidden, generator=g) / math.sqrt(x.numel())
        out.append((x, dy))
    return out


def run_steps(layer: Layer, data, n: int, cpu: Optional[List[float]] = None) -> List[float]:
    """``n`` forward+backward steps of ``layer``, each opened by a barrier; this rank's seconds per step (and
    its CPU seconds per step, every thread of the process, appended to ``cpu``)."""
    import torch.distributed as dist

    times = []
    for i in range(n):
        x, g = data[i % len(data)]
        x = x.clone().requires_grad_(True)  # the input gradient is part of the work (the layer below needs it)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        layer.step(x, g)
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
        layer.module.zero_grad(set_to_none=True)
    return times


def slowest(times: List[float]) -> List[float]:
    """Per step, the slowest rank's time (a step is done when every rank is)."""
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---- profile ------------------------------------------------------------------------------------------------
CATEGORIES = (  # first match wins: (category, substrings of an operator's name)
    # hybrid's communicator names each wait after its operation ("moe_dispatch/ep", "all_to_all/ep": the count
    # exchange); DeepSpeed's is its _AllToAll function
    ("all-to-all (incl. waiting)", ("all_to_all", "alltoall", "gloo:", "moe_dispatch", "moe_combine")),
    ("other collectives", ("all_reduce", "allreduce", "broadcast", "barrier", "all_gather")),
    ("expert matmuls", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::matmul",
                        "aten::linear")),
    ("routing (softmax/topk/sort/cumsum)", ("softmax", "topk", "sort", "cumsum", "argmax", "one_hot", "argsort",
                                           "bincount", "histc", "logsumexp")),
    ("data movement (index/scatter/gather/copy/cat)", ("index", "scatter", "gather", "copy_", "cat", "clone",
                                                       "contiguous", "masked", "where", "zeros", "empty", "fill_",
                                                       "_combine")),  # hybrid's weighted sum over the k choices
)


def categorise(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_layer(layer: Layer, data, n: int) -> dict:
    """Profile ``n`` steps; rank 0's operators by self CPU time, and those times summed by category (ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(layer, data, n)
    rows = []
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            rows.append({"op": ev.key, "calls": ev.count // n, "self_ms_per_step": ev.self_cpu_time_total / 1e3 / n})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    cats: Dict[str, float] = {}
    for r in rows:
        c = categorise(r["op"])
        cats[c] = cats.get(c, 0.0) + r["self_ms_per_step"]
    return {"top": rows[:15], "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]))}


# ---- the worker (under torchrun) ---------------------------------------------------------------------------
def worker(args) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share the cores: more intra-op threads only contend
    names = [c.strip() for c in args.contenders.split(",")] if args.contenders else list(CONTENDERS)
    for n in names:
        if n not in CONTENDERS:
            raise SystemExit(f"--contenders: unknown {n!r}; choose from {', '.join(CONTENDERS)}")
    want_hybrid = any(n.startswith("hybrid") for n in names)
    want_ds = any(n.startswith("deepspeed") for n in names)
    rss_start = status_mb("VmRSS")
    topo = None
    if want_hybrid:
        import hybrid

        hybrid.init_distributed(backend="gloo")
    if want_ds:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # wraps the group hybrid made, if any
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be divisible by the world size {world} (EP = world)")
    if want_hybrid:
        from hybrid import Topology

        topo = Topology(tp=1, ep=world)
    data = inputs(args, rank)
    gc.collect()
    reset_peak_rss()
    rss_built_from = status_mb("VmRSS")
    layers: Dict[str, Layer] = {}
    for n in names:
        lib, mode = n.split()
        layers[n] = build_hybrid(args, mode, topo) if lib == "hybrid" else build_deepspeed(args, mode, world)

    parity = {}
    for mode in MODES:
        h, d = layers.get(f"hybrid {mode}"), layers.get(f"deepspeed {mode}")
        if h is None or d is None:
            continue
        copy_hybrid_into_deepspeed(h.module, d.module, rank, args.experts // world)
        x, g = data[0]
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        # without the balancing losses' gradients: the two define them differently (hybrid: Switch's
        # E * sum f_e P_e over all k choices; DeepSpeed: E^2 * mean(P_e * f_e) over the first choice only)
        outs = [lay.step(xi, g, with_aux=False) for lay, xi in ((h, xs[0]), (d, xs[1]))]
        scale = float(outs[0].abs().max())
        gscale = float(xs[0].grad.abs().max())
        diff = torch.tensor([float((outs[0] - outs[1]).abs().max()) / scale,
                             float((xs[0].grad - xs[1].grad).abs().max()) / gscale], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        parity[mode] = {"max_rel_out_diff": diff[0].item(), "max_rel_input_grad_diff": diff[1].item()}
        for lay in (h, d):
            lay.module.zero_grad(set_to_none=True)

    result = {"world": world, "ep": world, "contenders": names, "args": vars(args), "parity": parity,
              "rounds": {n: [] for n in names}, "desc": {n: layers[n].desc for n in names},
              "torch_threads": torch.get_num_threads(), "started": datetime.datetime.now().astimezone().isoformat(
                  timespec="seconds"), "loadavg_start": os.getloadavg()}

    def write():
        if rank == 0 and args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1, default=str)
            os.replace(args.out + ".tmp", args.out)

    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for n in order:
            lay = layers[n]
            run_steps(lay, data, args.warmup)
            lay.reset()
            cpu: List[float] = []
            t = slowest(run_steps(lay, data, args.steps, cpu))
            cpu_t = torch.tensor(cpu, dtype=torch.float64)
            dist.all_reduce(cpu_t)  # summed over ranks: the CPU work of the step, waiting excluded
            sent = torch.tensor([float(lay.a2a_bytes()) / args.steps], dtype=torch.float64)
            dist.all_reduce(sent)  # summed over ranks
            drop = torch.tensor(lay.dropped(), dtype=torch.float64)
            dist.all_reduce(drop)
            result["rounds"][n].append({"median_ms": 1e3 * statistics.median(t), "step_ms": [1e3 * v for v in t],
                                        "cpu_ms": 1e3 * statistics.median(cpu_t.tolist()),
                                        "a2a_bytes_per_step_all_ranks": sent.item(),
                                        "dropped_fraction": drop[0].item() / max(drop[1].item(), 1.0)})
            if rank == 0:
                print(f"[round {r + 1}] {n}: {1e3 * statistics.median(t):.2f} ms/step", flush=True)
        write()

    peaks = [None] * world
    dist.all_gather_object(peaks, {"peak_mb": status_mb("VmHWM"), "start_mb": rss_start,
                                   "before_build_mb": rss_built_from})
    result["rss"] = peaks
    write()
    if args.profile:
        result["profile"] = {}
        for n in names:
            prof = profile_layer(layers[n], data, args.steps)
            result["profile"][n] = prof
        write()
    result["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    result["complete"] = True
    write()
    dist.barrier()
    return 0


# ---- the driver ---------------------------------------------------------------------------------------------
def summarise(res: dict) -> dict:
    """Per contender: median over rounds of the per-round medians, their min-max; paired ratios per mode."""
    out = {"contenders": {}, "ratios": {}, "cpu_ratios": {}}
    for n, rounds in res["rounds"].items():
        if not rounds:
            continue
        med = [r["median_ms"] for r in rounds]
        cpu = [r["cpu_ms"] for r in rounds]
        out["contenders"][n] = {"median_ms": statistics.median(med), "min_ms": min(med), "max_ms": max(med),
                                "cpu_ms": statistics.median(cpu), "cpu_min_ms": min(cpu), "cpu_max_ms": max(cpu),
                                "a2a_MB_per_step": statistics.median(r["a2a_bytes_per_step_all_ranks"]
                                                                     for r in rounds) / 1e6,
                                "dropped_fraction": statistics.median(r["dropped_fraction"] for r in rounds)}
    for mode in MODES:
        h, d = res["rounds"].get(f"hybrid {mode}"), res["rounds"].get(f"deepspeed {mode}")
        if h and d:
            pr = paired_ratio({i: r["median_ms"] for i, r in enumerate(h)},
                              {i: r["median_ms"] for i, r in enumerate(d)})
            out["ratios"][mode] = pr.as_dict() | {"text": pr.format()}
            pc = paired_ratio({i: r["cpu_ms"] for i, r in enumerate(h)}, {i: r["cpu_ms"] for i, r in enumerate(d)})
            out["cpu_ratios"][mode] = pc.as_dict() | {"text": pc.format()}
    return out


def torchrun_cmd(world: int, extra: List[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            os.path.relpath(os.path.abspath(__file__), REPO), *extra]


def launch(world: int, extra: List[str], out: str, timeout: float) -> Tuple[Optional[dict], str, str]:
    """Run one torchrun; (its JSON if complete, the command as text, the tail of its output)."""
    cmd = torchrun_cmd(world, extra + ["--out", out])
    text = "DS_ACCELERATOR=cpu torchrun " + shlex.join(cmd[3:])  # as typed in the DeepSpeed environment
    if os.path.exists(out):
        os.remove(out)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (p.stdout + p.stderr)[-3000:]
    res = None
    if os.path.exists(out):
        with open(out) as f:
            res = json.load(f)
        if not res.get("complete"):
            res = None
    return res, text, tail


def worker_flags(args) -> List[str]:
    keys = ("hidden", "heads", "experts", "expert_ffn", "topk", "capacity_factor", "aux", "seq", "micro_batch",
            "distinct", "steps", "warmup")
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    if args.grouped_gemm:
        flags.append("--grouped-gemm")
    return flags


def fmt_table(world: int, timing: dict, summ: dict, rss: Dict[str, dict]) -> List[str]:
    lines = [f"EP {world} (world {world}, one rank per EP position, 1 torch thread per rank)", "",
             "| contender | fwd+bwd ms/step, median (min-max over rounds) | hybrid/DeepSpeed paired ratio | "
             "CPU ms/step, all ranks | paired CPU ratio | all-to-all MB/step (all ranks) | dropped | "
             "peak RSS/rank, own process group (growth from build) |",
             "|---|---|---|---|---|---|---|---|"]
    for n in CONTENDERS:
        c = summ["contenders"].get(n)
        if c is None:
            continue
        mode = n.split()[1]
        ratio = summ["ratios"].get(mode, {}).get("text", "") if n.startswith("hybrid") else ""
        cratio = summ["cpu_ratios"].get(mode, {}).get("text", "") if n.startswith("hybrid") else ""
        r = rss.get(n)
        rtxt = (f"{max(p['peak_mb'] for p in r):.0f} MB ({max(p['peak_mb'] - p['before_build_mb'] for p in r):.0f} MB)"
                if r else "n/a")
        lines.append(f"| {n} | {c['median_ms']:.2f} ({c['min_ms']:.2f}-{c['max_ms']:.2f}) | {ratio} | "
                     f"{c['cpu_ms']:.1f} ({c['cpu_min_ms']:.1f}-{c['cpu_max_ms']:.1f}) | {cratio} | "
                     f"{c['a2a_MB_per_step']:.2f} | {100 * c['dropped_fraction']:.1f}% | {rtxt} |")
    par = timing.get("parity", {})
    if par:
        lines.append("")
        lines.append("same weights, same input, first step: max |hybrid - DeepSpeed| / max |hybrid| "
                     + "; ".join(f"{m}: output {v['max_rel_out_diff']:.1e}, input grad "
                                 f"{v['max_rel_input_grad_diff']:.1e}" for m, v in par.items()))
    return lines


def fmt_profile(world: int, timing: dict) -> List[str]:
    prof = timing.get("profile")
    if not prof:
        return []
    lines = [f"", f"Profile, EP {world}, rank 0, self CPU ms per step by category "
                  f"(torch.profiler over {timing['args']['steps']} steps after the timed rounds):", ""]
    cats = sorted({c for p in prof.values() for c in p["categories"]})
    names = [n for n in CONTENDERS if n in prof]
    lines.append("| category | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(f"{prof[n]['categories'].get(c, 0.0):.2f}" for n in names) + " |")
    lines.append("| total | " + " | ".join(f"{sum(prof[n]['categories'].values()):.2f}" for n in names) + " |")
    for n in names:
        lines.append("")
        lines.append(f"top operators, {n}: " + "; ".join(f"{r['op']} {r['self_ms_per_step']:.2f} ms x{r['calls']}"
                                                           for r in prof[n]["top"][:10]))
    return lines


def driver(args) -> int:
    worlds = [int(w) for w in args.worlds.split(",")]
    started = datetime.datetime.now().astimezone()
    results = {"command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
               "started": started.isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
               "loadavg_start": os.getloadavg(), "worlds": {}}
    text: List[str] = []
    tmp = args.tmp
    os.makedirs(tmp, exist_ok=True)
    ok = True
    for w in worlds:
        entry = {"commands": []}
        out = os.path.join(tmp, f"moe_vs_ds_ep{w}_timing.json")
        timing, cmd, tail = launch(w, worker_flags(args) + [f"--rounds={args.rounds}", "--profile"], out,
                                   args.timeout)
        entry["commands"].append(cmd)
        print(f"EP {w} timing: {cmd}", flush=True)
        if timing is None:
            print(f"EP {w} timing run FAILED:\n{tail}", flush=True)
            ok = False
            continue
        entry["timing"] = timing
        rss = {}
        if not args.no_rss:
            for n in timing["contenders"]:
                o = os.path.join(tmp, f"moe_vs_ds_ep{w}_rss_{n.replace(' ', '_')}.json")
                r, cmd, tail = launch(w, worker_flags(args) + ["--rounds=1", f"--contenders={n}"], o, args.timeout)
                entry["commands"].append(cmd)
                print(f"EP {w} RSS {n}: {cmd}", flush=True)
                if r is None:
                    print(f"  FAILED:\n{tail}", flush=True)
                    ok = False
                    continue
                rss[n] = r["rss"]
        entry["rss"] = rss
        entry["summary"] = summarise(timing)
        results["worlds"][str(w)] = entry
        text += fmt_table(w, timing, entry["summary"], rss) + fmt_profile(w, timing) + [""]
        text.append("commands:")
        text += [f"    {c}" for c in entry["commands"]]
        text.append("")
        results["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        results["loadavg_end"] = os.getloadavg()  # the machine is shared: the load at both ends says how quiet
        results["text"] = "\n".join(text)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    results.setdefault("loadavg_end", os.getloadavg())
    head = (f"{started:%Y-%m-%d %H:%M}-{datetime.datetime.now().astimezone():%H:%M} {started.tzname()}, "
            f"{os.cpu_count()} CPU cores, load average at start "
            f"{' '.join(f'{v:.2f}' for v in results['loadavg_start'])}, at the end "
            f"{' '.join(f'{v:.2f}' for v in results['loadavg_end'])}"
            f"; h={args.hidden}, {args.experts} SwiGLU experts of {args.expert_ffn}, top-{args.topk}, "
            f"[s, b] = [{args.seq}, {args.micro_batch}] tokens per rank, capacity factor {args.capacity_factor}, "
            f"aux coeff {args.aux}, fp32; {args.rounds} interleaved rounds x {args.steps} steps after "
            f"{args.warmup} warm-up")
    print("\n" + head + "\n\n" + "\n".join(text))
    if args.json:
        print(f"results: {args.json}")
    return 0 if ok else 1


def parse(argv=None) -> argparse.Namespace:
    from hybrid.argument_parser import ArgumentParser

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4, help="only to make a valid model config (no attention runs)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=512, help="each expert's SwiGLU width f")
    ap.add_argument("--topk", type=int, default=2, help="DeepSpeed-MoE's layer offers k=1 or 2 (k>2: topkgating)")
    ap.add_argument("--capacity-factor", type=float, default=1.0)
    ap.add_argument("--aux", type=float, default=1e-2, help="balancing-loss coefficient, both")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--distinct", type=int, default=4, help="distinct inputs per rank that the steps cycle through")
    ap.add_argument("--grouped-gemm", action="store_true", help="hybrid's --moe-grouped-gemm")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default="", help="worker: comma-separated subset of " + ", ".join(CONTENDERS))
    ap.add_argument("--profile", action="store_true", help="worker: profile each contender after the rounds")
    ap.add_argument("--out", default="", help="worker: rank 0 writes its JSON here")
    ap.add_argument("--worlds", default="2,4", help="driver: the world (= EP) sizes")
    ap.add_argument("--no-rss", action="store_true", help="driver: skip the one-contender RSS runs")
    ap.add_argument("--timeout", type=float, default=1200.0, help="driver: seconds per torchrun")
    ap.add_argument("--tmp", default="/tmp/moe_vs_deepspeed", help="driver: where the runs' JSON files go")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "moe_vs_deepspeed.json"),
                    help="driver: the results file ('' for none)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    _args = parse()
    if "LOCAL_RANK" in os.environ:  # under torchrun
        rc = worker(_args)
        sys.stdout.flush()
        # DeepSpeed's teardown aborts at interpreter exit; everything is written, so leave without it.
        os._exit(rc)
    sys.exit(driver(_args))
