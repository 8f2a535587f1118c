"""A tiny MoE GPT against the dense GPT of the same active parameters, and expert parallelism 4 against 1.

World 4 (gloo, one torch thread per rank), hybrid's engine (``hybrid.initialize``, its defaults but the
learning rate), mock data (random token copies), fp32. Contenders:

==============  ==============================================================================
name            model and layout
==============  ==============================================================================
dense           the dense twin: ``--ffn = topk x --expert-ffn`` (a SwiGLU MLP of width k f' has
                exactly the weights of k experts of width f'), DP 4
moe-ep1         the MoE model, every expert on every rank (replicated, DP 4 over all of them)
moe-ep2         EP 2: each rank holds E/2 experts, their gradients reduced over edp = 2
moe-ep4         EP 4: each rank holds E/4 experts (= k of them at the defaults), edp = 1
==============  ==============================================================================

The MoE model is ``tiny-moe`` with ``--experts`` (default 8) experts, top-2, every layer MoE.
Active parameters per token: the dense twin's plus the router (``E h`` per layer). The ideal
MoE/dense step-time ratio is the ratio of model FLOPs per token (``model_zoo.flops``), which the
table prints beside the measured one: the router's matmul is all the extra arithmetic; the rest
of the gap is the MoE machinery (routing, sorting, the all-to-all, the per-expert loop) and the
optimizer's extra parameters (at EP 1 every rank updates all E experts; at EP 4 with E/4 = k it
updates as many MLP weights as the dense twin).

Bytes are the engine's ``comm_report()`` of the last measured step (each rank's wire bytes
summed over the 4 ranks, by ``op/axis``: ``moe_dispatch/ep`` and ``moe_combine/ep`` with their
``_grad`` twins are the token all-to-alls; the gradient reduction is under ``dp`` for dense
parameters and ``edp`` for expert ones). Rounds are interleaved (round r runs every contender
once, in reversed order on odd rounds), each contender in fresh processes (so its peak RSS is its
own); ratios are paired per round (``benchmarks/paired.py``): median (min-max over rounds).

Reproduce (from the repository root)::

    python benchmarks/moe_speed.py                  # 3 rounds x 8 steps
    python benchmarks/moe_speed.py --quick          # the machinery end to end (not a measurement)
    python benchmarks/moe_speed.py --cluster-only --cluster 200mbit,50mbit --cluster-rounds 2 \
        --cluster-steps 4 --warmup 1                 # the emulated 2-node cluster (root; ~15 min)

The cluster part runs every contender as one torchrun agent per emulated node
(``tools/emulated_cluster.py``: 2 nodes x 2 ranks, the link shaped with ``tc
tbf``; this file with ``--worker NAME`` is the per-rank program). Ranks 0 and 1
are node 0: EP 2 keeps the token all-to-all inside a node and sends the expert
gradients (``edp``) across; EP 4 sends tokens across and reduces no expert
gradient. It reports the communicator's inter-node bytes by op and what the
veth counters saw.

Results: ``--json`` (default ``benchmarks/results/moe_speed.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.cluster_ranks import print_on_rank0, read_ranks  # noqa: E402
from benchmarks.paired import paired_ratio  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402  (the repository's gloo process harness)

WORLD = 4


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    moe: bool
    ep: int = 1


CONTENDERS = [Contender("dense", False), Contender("moe-ep1", True, 1), Contender("moe-ep2", True, 2),
              Contender("moe-ep4", True, 4)]


def moe_config(args):
    from model_zoo.presets import get_preset

    return get_preset("tiny-moe", num_experts=args.experts, moe_ffn_hidden_size=args.expert_ffn,
                      moe_router_topk=args.topk, hidden_size=args.hidden, num_layers=args.layers,
                      seq_length=args.seq)


def dense_config(args):
    """The dense twin: the same model with one SwiGLU MLP of width k f' in place of each MoE layer."""
    return moe_config(args).replace(num_experts=None, ffn_hidden_size=args.topk * args.expert_ffn).validate(1)


def config_of(c: Contender, args):
    return moe_config(args) if c.moe else dense_config(args)


def batch(step: int, args) -> torch.Tensor:
    """Global batch ``step``: token ids ``[global_batch, seq]`` (a copy task: labels = ids)."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, args.vocab_cap, (args.micro_batch * WORLD, args.seq), generator=g)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def bench_child(c: Contender, args) -> Dict:
    import hybrid
    from hybrid import Topology
    from model_zoo import GPTModel

    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on is this contender's peak
        f.write("5")
    torch.manual_seed(0)
    cfg = config_of(c, args)
    topo = Topology(tp=1, ep=c.ep)
    model = GPTModel(cfg, topo)
    config = {"micro_batch_size": args.micro_batch, "optimizer": {"lr": args.lr}}
    engine = hybrid.initialize(model, config, topology=topo)
    rank = topo.dp_rank
    times, cpu, blocked, losses = [], [], [], []
    comm = None
    for s in range(args.warmup + args.steps):
        ids = batch(s, args)[rank * args.micro_batch:(rank + 1) * args.micro_batch]
        b0 = topo.comm.blocked_seconds()
        t0, c0 = time.perf_counter(), time.process_time()  # process time: every thread, gloo's included
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        blocked.append(topo.comm.blocked_seconds() - b0)
        losses.append(float(loss.detach()))
        comm = engine.comm_report()
    return {"times": times[args.warmup:], "cpu": cpu[args.warmup:], "blocked": blocked[args.warmup:], "losses": losses,
            "peak_mb": _status_mb("VmHWM"), "comm": comm,
            "params_local": sum(p.numel() for p in model.parameters()),
            "zero_stage": engine.config.zero.stage}


def summarise(per_rank: List[Dict]) -> Dict:
    steps = len(per_rank[0]["times"])
    slowest = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    blocked = [statistics.mean(r["blocked"][i] for r in per_rank) for i in range(steps)]
    comm: Dict[str, float] = {}
    inter: Dict[str, float] = {}
    for r in per_rank:
        for k, v in (r["comm"] or {}).items():
            comm[k] = comm.get(k, 0.0) + v["wire_bytes"]
            inter[k] = inter.get(k, 0.0) + v.get("inter_node_bytes", 0.0)
    cpu = [sum(r["cpu"][i] for r in per_rank) for i in range(steps)]  # CPU seconds of all ranks together
    return {"comm_inter_node_bytes": inter, "cpu_ms": 1e3 * statistics.median(cpu),
            "median_ms": 1e3 * statistics.median(slowest), "blocked_ms": 1e3 * statistics.median(blocked),
            "peak_mb": max(r["peak_mb"] for r in per_rank), "comm_wire_bytes": comm,
            "losses": [statistics.mean(r["losses"][i] for r in per_rank) for i in range(len(per_rank[0]["losses"]))],
            "params_local": max(r["params_local"] for r in per_rank), "zero_stage": per_rank[0]["zero_stage"]}


# ---- the emulated 2-node cluster (tools/emulated_cluster.py) ---------------------------------------------------
WORKER_PREFIX = "moe_speed worker: "


def worker(args) -> int:
    """Under torchrun (one agent per emulated node): run contender ``--worker`` and print every rank's figures
    from rank 0 as one ``moe_speed worker: {json}`` line."""
    import torch.distributed as dist

    import hybrid

    torch.set_num_threads(1)
    hybrid.init_distributed(backend="gloo")
    c = next(c for c in CONTENDERS if c.name == args.worker)
    mine = bench_child(c, args)
    print_on_rank0(WORKER_PREFIX, mine)
    dist.barrier()
    return 0


def worker_argv(c: Contender, args) -> List[str]:
    keys = ("experts", "expert_ffn", "topk", "hidden", "layers", "seq", "micro_batch", "vocab_cap", "lr")
    return [os.path.abspath(__file__), f"--worker={c.name}", f"--steps={args.cluster_steps}",
            f"--warmup={args.warmup}", *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]]


def cluster_main(args, chosen: List[Contender]) -> List[str]:
    """Every contender on 2 emulated nodes x 2 ranks at each ``--cluster`` rate, interleaved rounds; its lines."""
    from tools import emulated_cluster as tool

    try:
        tool.check_available()
    except tool.ClusterUnavailable as e:
        return [f"emulated cluster: skipped, not available here: {e}"]
    out = []
    for rate in [r.strip() for r in args.cluster.split(",") if r.strip()]:
        runs: Dict[str, Dict[int, Dict]] = {}
        link: Dict[str, List[float]] = {}
        with tool.EmulatedCluster(nodes=2, ranks_per_node=2, rate=rate) as cluster:
            for r in range(args.cluster_rounds):
                for c in (chosen if r % 2 == 0 else list(reversed(chosen))):
                    res = cluster.run(worker_argv(c, args), timeout_s=args.cluster_timeout, cwd=REPO)
                    every = read_ranks(res.nodes[0].output, WORKER_PREFIX)
                    if not res.ok or every is None:
                        print(f"[{rate}, round {r + 1}] {c.name}: FAILED {res.describe()[-400:]}", flush=True)
                        continue
                    row = summarise(every)
                    runs.setdefault(c.name, {})[r] = row
                    tx = sum(v["tx_bytes"] for v in res.link_bytes.values())
                    link.setdefault(c.name, []).append(tx / (args.warmup + args.cluster_steps))
                    print(f"[{rate}, round {r + 1}, {res.wall_s:.0f}s] {c.name}: {row['median_ms']:.0f} ms/step, "
                          f"link {tx / 1e6:.1f} MB", flush=True)
        out += [f"", f"Emulated 2 nodes x 2 ranks, link {rate} (tc tbf, both directions), {args.cluster_rounds} "
                     f"interleaved rounds x {args.cluster_steps} steps after {args.warmup}; ranks 0,1 on node 0, "
                     f"2,3 on node 1: EP 2 groups stay inside a node, EP 4 spans both",
                "",
                "| contender | ms/step median (min-max) | paired ratio | exposed comm ms | inter-node MB/step "
                "(comm model, by op) | link MB/step (veth tx, both nodes, incl. start-up / steps) |",
                "|---|---|---|---|---|---|"]
        for c in chosen:
            rs = runs.get(c.name)
            if not rs:
                continue
            meds = [v["median_ms"] for v in rs.values()]
            ratio_txt = ""
            for den in (["dense"] if c.moe else []) + (["moe-ep1"] if c.ep > 1 else []):
                pr = paired_ratio({k: v["median_ms"] for k, v in rs.items()},
                                  {k: v["median_ms"] for k, v in runs.get(den, {}).items()})
                if pr is not None:
                    ratio_txt += f"vs {den} {pr.format()} "
            last = rs[max(rs)]
            inter = last["comm_inter_node_bytes"]
            itxt = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(inter.items()) if v > 0)
            out.append(f"| {c.name} | {statistics.median(meds):.0f} ({min(meds):.0f}-{max(meds):.0f}) | "
                       f"{ratio_txt.strip()} | {statistics.median(v['blocked_ms'] for v in rs.values()):.0f} | "
                       f"total {sum(inter.values()) / 1e6:.2f}: {itxt} | {statistics.median(link[c.name]) / 1e6:.2f} |")
        args.cluster_results = getattr(args, "cluster_results", {})
        args.cluster_results[rate] = {n: {str(k + 1): v for k, v in rs.items()} for n, rs in runs.items()}
    return out


QUICK = {"steps": 2, "warmup": 1, "rounds": 1, "layers": 2}


def parse(argv=None) -> argparse.Namespace:
    from hybrid.argument_parser import ArgumentParser

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=256, help="each expert's SwiGLU width f' (tiny-moe's)")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--vocab-cap", type=int, default=4096, help="token ids drawn below this")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated contender names")
    ap.add_argument("--quick", action="store_true", help="tiny run of the machinery: " + str(QUICK))
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "moe_speed.json"))
    ap.add_argument("--cluster", default="", help="also run every contender on 2 emulated nodes x 2 ranks at these "
                                                  "link rates (comma-separated, e.g. 200mbit,50mbit; needs root)")
    ap.add_argument("--cluster-only", action="store_true", help="skip the local (unshaped) runs")
    ap.add_argument("--cluster-steps", type=int, default=4)
    ap.add_argument("--cluster-rounds", type=int, default=2)
    ap.add_argument("--cluster-timeout", type=float, default=600.0, help="seconds per emulated-cluster run")
    ap.add_argument("--worker", default="", help="internal: run this contender under torchrun")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    from model_zoo import flops

    args = parse(argv)
    chosen = [c for c in CONTENDERS if not args.only or c.name in [s.strip() for s in args.only.split(",")]]
    started = datetime.datetime.now().astimezone()
    load_start = os.getloadavg()
    runs: Dict[str, Dict[int, Dict]] = {}
    failures: Dict[str, Dict[int, str]] = {}
    mcfg, dcfg = moe_config(args), dense_config(args)
    counts = {"moe_total": flops.count_parameters(mcfg), "moe_active": flops.active_parameters(mcfg),
              "dense": flops.count_parameters(dcfg), "moe_flops_per_token": flops.flops_per_token(mcfg),
              "dense_flops_per_token": flops.flops_per_token(dcfg)}
    ideal = counts["moe_flops_per_token"] / counts["dense_flops_per_token"]
    for r in range(0 if args.cluster_only else args.rounds):
        order = chosen if r % 2 == 0 else list(reversed(chosen))
        for c in order:
            t0 = time.time()
            try:
                row = summarise(run_distributed(bench_child, WORLD, c, args, timeout=900, start="spawn"))
            except Exception as err:  # noqa: BLE001 - one failure must not lose the others' figures
                msg = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                failures.setdefault(c.name, {})[r] = msg
                print(f"[round {r + 1}] {c.name}: FAILED {msg}", flush=True)
                continue
            runs.setdefault(c.name, {})[r] = row
            print(f"[round {r + 1}, {time.time() - t0:.0f}s] {c.name}: {row['median_ms']:.0f} ms/step, "
                  f"loss {row['losses'][-1]:.4f}", flush=True)

    out = [f"{started:%Y-%m-%d %H:%M}-{datetime.datetime.now().astimezone():%H:%M} {started.tzname()}; world "
           f"{WORLD} (gloo, {os.cpu_count()} CPU cores, 1 torch thread per rank); tiny-moe with {args.experts} "
           f"experts of {args.expert_ffn}, top-{args.topk}, h={args.hidden}, L={args.layers}, seq {args.seq}, "
           f"micro batch {args.micro_batch}/rank; {args.rounds} interleaved rounds x {args.steps} steps after "
           f"{args.warmup}; load average at start {' '.join(f'{v:.2f}' for v in load_start)}",
           f"parameters: MoE total {counts['moe_total']:,}, MoE active {counts['moe_active']:,}, dense twin "
           f"{counts['dense']:,} (active difference: the routers, {counts['moe_active'] - counts['dense']:,}); "
           f"model FLOPs/token MoE {counts['moe_flops_per_token']:,} dense {counts['dense_flops_per_token']:,}: "
           f"ideal MoE/dense step ratio {ideal:.3f}", ""]
    head = ("| contender | ms/step median (min-max over rounds) | paired ratio | CPU ms/step, 4 ranks | paired CPU "
            "ratio | exposed comm ms | comm MB/step (4 ranks) by op/axis | params/rank | peak RSS/rank | final loss |")
    out += [head, "|---|---|---|---|---|---|---|---|---|---|"]
    table = {}
    for c in chosen:
        rs = runs.get(c.name)
        if not rs:
            continue
        meds = [v["median_ms"] for v in rs.values()]
        cpus = [v["cpu_ms"] for v in rs.values()]
        ratio_txt, cpu_txt = "", ""
        ratios = {}
        for den in (["dense"] if c.moe else []) + (["moe-ep1"] if c.ep > 1 else []):
            pr = paired_ratio({r: v["median_ms"] for r, v in rs.items()},
                              {r: v["median_ms"] for r, v in runs.get(den, {}).items()})
            pc = paired_ratio({r: v["cpu_ms"] for r, v in rs.items()},
                              {r: v["cpu_ms"] for r, v in runs.get(den, {}).items()})
            if pr is not None:
                ratios[den] = {"wall": pr.as_dict(), "cpu": pc.as_dict()}
                ratio_txt += f"vs {den} {pr.format()} "
                cpu_txt += f"vs {den} {pc.format()} "
        last = rs[max(rs)]
        comm = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(last["comm_wire_bytes"].items()) if v > 0)
        table[c.name] = {"median_ms": statistics.median(meds), "min_ms": min(meds), "max_ms": max(meds),
                         "cpu_ms": statistics.median(cpus), "cpu_min_ms": min(cpus), "cpu_max_ms": max(cpus),
                         "ratios": ratios, "blocked_ms": statistics.median(v["blocked_ms"] for v in rs.values()),
                         "comm_MB": {k: v / 1e6 for k, v in last["comm_wire_bytes"].items()},
                         "comm_total_MB": sum(last["comm_wire_bytes"].values()) / 1e6,
                         "peak_mb": max(v["peak_mb"] for v in rs.values()), "params_local": last["params_local"],
                         "final_loss": last["losses"][-1], "zero_stage": last["zero_stage"]}
        t = table[c.name]
        out.append(f"| {c.name} | {t['median_ms']:.0f} ({t['min_ms']:.0f}-{t['max_ms']:.0f}) | {ratio_txt.strip()} | "
                   f"{t['cpu_ms']:.0f} ({t['cpu_min_ms']:.0f}-{t['cpu_max_ms']:.0f}) | {cpu_txt.strip()} | "
                   f"{t['blocked_ms']:.0f} | total {t['comm_total_MB']:.2f}: {comm} | {t['params_local']:,} | "
                   f"{t['peak_mb']:.0f} MB | {t['final_loss']:.4f} |")
    out.append("")
    out.append(f"paired ratio: per round, this contender's median step time over the named one's; median (min-max) "
               f"over rounds. Ideal MoE/dense: {ideal:.3f}. ZeRO stage (hybrid's default): "
               f"{next(iter(table.values()))['zero_stage'] if table else 'n/a'}.")
    if args.cluster:
        out += cluster_main(args, chosen)
    for name, fs in failures.items():
        out.append(f"FAILED {name}: " + "; ".join(f"round {r + 1}: {m}" for r, m in fs.items()))
    print("\n".join(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
                       "started": started.isoformat(timespec="seconds"), "args": vars(args), "counts": counts,
                       "ideal_moe_over_dense": ideal, "table": table, "loadavg_start": load_start,
                       "runs": {n: {str(r + 1): v for r, v in rs.items()} for n, rs in runs.items()},
                       "failures": failures, "cluster": getattr(args, "cluster_results", {}),
                       "text": "\n".join(out)}, f, indent=1, default=str)
        print(f"results: {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    if "--worker" in " ".join(sys.argv):
        sys.exit(worker(parse()))
    sys.exit(main())
