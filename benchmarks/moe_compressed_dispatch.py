"""The MoE layer's int8 token dispatch (``--moe-quantized-dispatch``) against the uncompressed one.

Two contenders, the same model and data, side by side in one run:

==============  ==========================================================================================
name            what crosses the expert-parallel all-to-all (``hybrid/tensor_parallel/all_to_all.py``)
==============  ==========================================================================================
fp32            every routed token row as the model's fp32 values, both ways, and its gradient back
int8            the same rows packed in int8 blocks of ``model_zoo.config.DISPATCH_BLOCK`` values with one fp32
                scale each (``hybrid.compression.Quantization(8, DISPATCH_BLOCK)``), dequantized on arrival
==============  ==========================================================================================

Two parts (``--parts``, default both):

* ``cluster`` -- bytes and step time on 2 emulated nodes x 2 ranks (``tools/emulated_cluster.py``: one network
  namespace per node, named ``<--prefix>-node<K>``, joined by a veth pair shaped with ``tc tbf`` at each
  ``--rates`` point, both directions). World 4, EP 4 (``Topology(tp=1, ep=4)``): ranks 0,1 sit on node 0 and
  2,3 on node 1, so every EP group spans the link and half of each rank's routed tokens cross it (an expert
  per rank; tiny-moe has 4). Each run (fresh processes under torchrun, one agent per node) does, per rank:

  1. **dispatch window**: ``--dispatch-passes`` forward + backward passes of the bare ``GPTModel`` (no engine,
     so no gradient reduction: the only traffic is the four token exchanges, ``moe_dispatch``,
     ``moe_combine`` and their ``_grad`` twins, per MoE layer). Between two barriers each node's first rank
     reads its veth's ``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics/tx_bytes``: the link's bytes of the
     all-to-all alone (TCP/IP headers and acknowledgements included; the closing barrier's few bytes too);
     beside it the communicator's count (``Communicator.report()``: ``wire_bytes`` and ``inter_node_bytes``
     of the ``moe_*/ep`` ops, summed over the 4 ranks);
  2. **training steps**: hybrid's engine (``hybrid.initialize``, its defaults but the learning rate; fp32,
     mock data: random token copies) runs ``--warmup`` + ``--steps`` optimizer steps; a step's time is the
     slowest rank's, the run's figure the median over the timed steps. The same ``tx_bytes`` reading brackets
     the timed steps (everything a step sends: the all-to-alls and the dense parameters' gradient reduction
     over ``dp``; experts are reduced over ``edp`` = 1: nothing), and ``engine.comm_report()`` of the last step
     gives the bytes by ``op/axis``.

  Rounds are interleaved (round r runs both contenders, in reversed order on odd rounds); the int8/fp32 ratios
  are paired per round (``benchmarks/paired.py``): median (min-max over rounds).

* ``loss`` -- validation loss of the demo (``launch_scripts/pretrain_gpt_tiny.sh`` with ``MODEL=tiny-moe``: the
  standard library's docstrings, a SentencePiece tokenizer, TP 2 x DP 2 with EP 2 and sequence parallelism,
  ZeRO-1, ``--loss-iters`` iterations, evaluated on the validation split every 50 and at the end), once plain and
  once with ``EXTRA_ARGS=--moe-quantized-dispatch``, on loopback (one node), for each of ``--seeds`` (the first
  the demo's 1234; another is appended to ``EXTRA_ARGS``, the last ``--seed`` wins). ``--seed`` also orders the
  samples, so only the runs of one seed compare. ``--loss-mode parallel`` (default) starts a seed's runs at
  once, so both see the same machine load and their wall times compare; ``sequential`` runs them back to back.
  ``--loss-contenders fp32-tp1`` runs the control instead: fp32 at TP 1 x DP 4, the same function but for
  rounding, which shows how far a harmless change moves the loss (``LOSS_ENV``). Each run gets its own
  ``WORK_DIR`` under ``--work-dir`` (removed first).

Reproduce (from the repository root, as root; ``flock /work/bench.lock`` on a shared machine)::

    python benchmarks/moe_compressed_dispatch.py                     # both parts, seed 1234 (~25 min here)
    python benchmarks/moe_compressed_dispatch.py --parts cluster --rates 50mbit,200mbit --rounds 3
    python benchmarks/moe_compressed_dispatch.py --parts loss --seeds 1234,1235,1236,1237
    python benchmarks/moe_compressed_dispatch.py --parts loss --loss-contenders fp32-tp1 --seeds 1234,1235,1236,1237
    python benchmarks/moe_compressed_dispatch.py --summarize benchmarks/results/moe_compressed_dispatch.json
                                    # every kept loss run: per-seed table, mean change and its 95% t-interval
    python benchmarks/moe_compressed_dispatch.py --parts cluster --rates 200mbit --rounds 1 --steps 2 \\
        --dispatch-passes 1 --json /tmp/mcd.json                                  # the machinery, quickly

Results: ``--json`` (default ``benchmarks/results/moe_compressed_dispatch.json``) and a Markdown report on
stdout; the figures are in ``benchmarks/moe_compressed_dispatch.md``. Exits 1 when a run failed; the
``cluster`` part is skipped with one line where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.cluster_ranks import print_on_rank0, read_ranks  # noqa: E402
from benchmarks.paired import paired_ratio  # noqa: E402

CONTENDERS = ("fp32", "int8")  # the denominator of every ratio first
NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
EP = WORLD  # every EP group spans both nodes
MOE_OPS = ("moe_dispatch", "moe_combine", "moe_dispatch_grad", "moe_combine_grad")
WORKER_PREFIX = "moe_compressed_dispatch worker: "
DEMO = os.path.join(REPO, "launch_scripts", "pretrain_gpt_tiny.sh")
_VALID_RE = re.compile(r"validation at iteration (\d+) \| lm loss: ([0-9.eE+-]+)")
_TRAIN_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.eE+-]+).*?iteration time: ([\d.]+) ms")


# ---- one run on the emulated cluster (under torchrun, one agent per node) ----------------------------------------
def model_config(args):
    from model_zoo.presets import get_preset

    return get_preset("tiny-moe", moe_quantized_dispatch=args.worker == "int8", seq_length=args.seq)


def batch(step: int, args):
    """Global batch ``step``: token ids ``[micro_batch x WORLD, seq]`` (a copy task: labels = ids)."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, args.vocab_cap, (args.micro_batch * WORLD, args.seq), generator=g)


def _tx_bytes() -> int:
    """This node's veth counter of bytes sent (the interface gloo is bound to)."""
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def _moe_bytes(report: dict) -> Dict[str, float]:
    """``wire_bytes`` and ``inter_node_bytes`` of the four token exchanges in a ``Communicator.report()``."""
    keys = [k for k in report if k.split("/")[0] in MOE_OPS]
    return {"wire": sum(report[k]["wire_bytes"] for k in keys),
            "inter": sum(report[k]["inter_node_bytes"] for k in keys)}


def worker(args) -> int:
    """Run contender ``--worker`` on this rank; rank 0 prints every rank's figures as one JSON line."""
    import torch
    import torch.distributed as dist

    import hybrid
    from hybrid import Topology
    from model_zoo import GPTModel

    torch.set_num_threads(1)
    hybrid.init_distributed(backend="gloo")
    local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one reader of each node's veth
    topo = Topology(tp=1, ep=EP)
    rank = topo.dp_rank
    cfg = model_config(args)

    def ids(step):
        return batch(step, args)[rank * args.micro_batch:(rank + 1) * args.micro_batch]

    # 1. the all-to-all alone: forward + backward of the bare model, nothing reduced
    torch.manual_seed(0)
    bare = GPTModel(cfg, topo)
    x = ids(0)
    bare(x, x).sum().backward()  # one pass outside the window: first-call allocations, gloo's connections
    dist.barrier()
    topo.comm.reset_stats()
    tx0 = _tx_bytes() if local0 else 0
    t0 = time.perf_counter()
    for p in range(args.dispatch_passes):
        x = ids(1 + p)
        bare(x, x).sum().backward()
    dist.barrier()
    window_s = time.perf_counter() - t0
    dispatch = {"tx": (_tx_bytes() - tx0) if local0 else 0, "comm": _moe_bytes(topo.comm.report()),
                "seconds": window_s}
    del bare

    # 2. training steps through the engine
    torch.manual_seed(0)
    model = GPTModel(cfg, topo)
    engine = hybrid.initialize(model, {"micro_batch_size": args.micro_batch, "optimizer": {"lr": args.lr}},
                               topology=topo)
    times, blocked, losses = [], [], []
    report, tx0 = None, 0
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()
            tx0 = _tx_bytes() if local0 else 0
        x = ids(100 + s)
        b0 = topo.comm.blocked_seconds()
        t0 = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        blocked.append(topo.comm.blocked_seconds() - b0)
        losses.append(float(loss.detach()))
        report = engine.comm_report()
    dist.barrier()
    mine = {"dispatch": dispatch, "times": times[args.warmup:], "blocked": blocked[args.warmup:], "losses": losses,
            "step_tx": (_tx_bytes() - tx0) if local0 else 0, "report": report}
    print_on_rank0(WORKER_PREFIX, mine)
    dist.barrier()
    return 0


def summarise(per_rank: List[dict], args) -> dict:
    """One run's figures from every rank's (bytes summed over ranks/nodes, per pass or per step)."""
    steps = len(per_rank[0]["times"])
    slowest = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    by_op: Dict[str, Dict[str, float]] = {}
    for r in per_rank:
        for k, v in (r["report"] or {}).items():
            row = by_op.setdefault(k, {"wire": 0.0, "inter": 0.0})
            row["wire"] += v["wire_bytes"]
            row["inter"] += v["inter_node_bytes"]
    step_moe = {"wire": sum(v["wire"] for k, v in by_op.items() if k.split("/")[0] in MOE_OPS),
                "inter": sum(v["inter"] for k, v in by_op.items() if k.split("/")[0] in MOE_OPS)}
    n = args.dispatch_passes
    return {
        "step_ms": 1e3 * statistics.median(slowest), "step_ms_each": [1e3 * t for t in slowest],
        "blocked_ms": 1e3 * statistics.median(statistics.mean(r["blocked"][i] for r in per_rank)
                                              for i in range(steps)),
        # the dispatch window, per forward + backward pass, all ranks / both nodes together
        "a2a_tx_per_pass": sum(r["dispatch"]["tx"] for r in per_rank) / n,
        "a2a_wire_per_pass": sum(r["dispatch"]["comm"]["wire"] for r in per_rank) / n,
        "a2a_inter_per_pass": sum(r["dispatch"]["comm"]["inter"] for r in per_rank) / n,
        "a2a_ms_per_pass": 1e3 * max(r["dispatch"]["seconds"] for r in per_rank) / n,
        # one training step (the last one's communicator report; the link's bytes over the timed steps)
        "step_tx": sum(r["step_tx"] for r in per_rank) / steps,
        "step_moe_wire": step_moe["wire"], "step_moe_inter": step_moe["inter"],
        "step_wire": sum(v["wire"] for v in by_op.values()), "step_inter": sum(v["inter"] for v in by_op.values()),
        "step_by_op": by_op, "final_loss": statistics.mean(r["losses"][-1] for r in per_rank),
    }


def worker_argv(name: str, args) -> List[str]:
    keys = ("steps", "warmup", "dispatch_passes", "micro_batch", "seq", "vocab_cap", "lr")
    return [os.path.abspath(__file__), f"--worker={name}",
            *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]]


def _pr(rs: Dict[str, Dict[int, dict]], key: str):
    return paired_ratio({r: v[key] for r, v in rs.get("int8", {}).items()},
                        {r: v[key] for r, v in rs.get("fp32", {}).items()})


def cluster_part(args, results: dict, failures: List[str]) -> List[str]:
    from tools import emulated_cluster as tool

    try:
        tool.check_available(args.prefix)
    except tool.ClusterUnavailable as e:
        return [f"emulated cluster: skipped, not available here: {e}"]
    out = []
    for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
        runs: Dict[str, Dict[int, dict]] = {}
        # the context manager tears the namespaces down on exit, an exception or SIGINT/SIGTERM
        with tool.EmulatedCluster(nodes=NODES, ranks_per_node=RANKS_PER_NODE, rate=rate,
                                  prefix=args.prefix) as cluster:
            for r in range(args.rounds):
                for name in (CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS))):
                    res = cluster.run(worker_argv(name, args), timeout_s=args.timeout, cwd=REPO)
                    every = read_ranks(res.nodes[0].output, WORKER_PREFIX)
                    if not res.ok or every is None:
                        msg = f"[{rate}, round {r + 1}] {name}: FAILED {res.describe()[-400:]}"
                        print(msg, flush=True)
                        failures.append(msg)
                        continue
                    row = summarise(every, args)
                    row["run_wall_s"] = res.wall_s
                    row["run_tx_total"] = sum(v["tx_bytes"] for v in res.link_bytes.values())
                    runs.setdefault(name, {})[r] = row
                    print(f"[{rate}, round {r + 1}, {res.wall_s:.0f}s] {name}: {row['step_ms']:.0f} ms/step, "
                          f"all-to-all {row['a2a_tx_per_pass'] / 1e6:.2f} MB/pass at the veths "
                          f"({row['a2a_inter_per_pass'] / 1e6:.2f} counted), step {row['step_tx'] / 1e6:.2f} MB",
                          flush=True)
        results[rate] = {n: {str(k + 1): v for k, v in rs.items()} for n, rs in runs.items()}
        out += ["", f"### Link {rate} (tc tbf, both directions); {args.rounds} interleaved rounds", "",
                "| contender | all-to-all MB/pass, veths (tx, both nodes) | all-to-all MB/pass, comm_report "
                "inter-node | all-to-all MB/pass, comm_report wire (4 ranks) | ms/step median (min-max) | "
                "exposed comm ms/step | MB/step, veths | MB/step comm_report: all-to-all + rest (wire) |",
                "|---|---|---|---|---|---|---|---|"]
        for name in CONTENDERS:
            rs = runs.get(name)
            if not rs:
                out.append(f"| {name} | FAILED | | | | | | |")
                continue
            med = lambda key: statistics.median(v[key] for v in rs.values())  # noqa: E731
            steps = [v["step_ms"] for v in rs.values()]
            last = rs[max(rs)]
            out.append(f"| {name} | {med('a2a_tx_per_pass') / 1e6:.3f} | {med('a2a_inter_per_pass') / 1e6:.3f} | "
                       f"{med('a2a_wire_per_pass') / 1e6:.3f} | {statistics.median(steps):.0f} "
                       f"({min(steps):.0f}-{max(steps):.0f}) | {med('blocked_ms'):.0f} | "
                       f"{med('step_tx') / 1e6:.2f} | {last['step_moe_wire'] / 1e6:.2f} + "
                       f"{(last['step_wire'] - last['step_moe_wire']) / 1e6:.2f} |")
        ratios = {key: _pr(runs, key) for key in ("a2a_tx_per_pass", "a2a_inter_per_pass", "a2a_wire_per_pass",
                                                  "step_ms", "step_tx", "blocked_ms")}
        results[rate]["paired_int8_over_fp32"] = {k: (v.as_dict() if v else None) for k, v in ratios.items()}
        fmt = {k: (v.format() if v else "n/a") for k, v in ratios.items()}
        out += ["", f"int8 / fp32, paired per round, median (min-max): all-to-all bytes at the veths "
                    f"{fmt['a2a_tx_per_pass']}, in comm_report {fmt['a2a_inter_per_pass']} (inter-node) and "
                    f"{fmt['a2a_wire_per_pass']} (wire); step time {fmt['step_ms']}; exposed comm "
                    f"{fmt['blocked_ms']}; link bytes per step {fmt['step_tx']}"]
    return out


# ---- validation loss of the demo ---------------------------------------------------------------------------------
# EXTRA_ARGS and environment of each demo contender. fp32-tp1 is a control, not a contender: TP 1 x DP 4 (EP 2) in
# place of TP 2 x DP 2 trains on the same global batches from the same initial weights, the same function but for
# rounding (the matmuls split otherwise, gradients accumulated over one micro-batch per rank instead of two) and the
# balancing loss's grouping of sequences into micro-batches: how far such harmless changes move this run's loss.
LOSS_EXTRA = {"fp32": [], "int8": ["--moe-quantized-dispatch"], "fp32-tp1": []}
LOSS_ENV = {"fp32-tp1": {"TP": "1"}}
DEMO_SEED = 1234  # launch_scripts/pretrain_gpt_tiny.sh's --seed; another seed is appended to EXTRA_ARGS (last wins)


def _loss_pair(args, seed: int, failures: List[str]) -> Dict[str, dict]:
    """Both contenders' demo runs with ``seed`` (side by side, or back to back); their figures by name."""
    procs, logs, started, wall = {}, {}, {}, {}
    env_base = dict(os.environ, MODEL="tiny-moe", SETUP="0", TRAIN_ITERS=str(args.loss_iters))
    os.makedirs(args.work_dir, exist_ok=True)

    def start(name):
        tag = name if seed == DEMO_SEED else f"{name}-seed{seed}"
        work = os.path.join(args.work_dir, tag)
        shutil.rmtree(work, ignore_errors=True)
        extra = LOSS_EXTRA[name] + ([] if seed == DEMO_SEED else ["--seed", str(seed)])
        env = dict(env_base, WORK_DIR=work, EXTRA_ARGS=" ".join(extra), **LOSS_ENV.get(name, {}))
        logs[name] = os.path.join(args.work_dir, f"{tag}.log")
        started[name] = time.monotonic()
        # a session of its own: an interrupted run's torchrun agent and ranks go with its process group
        procs[name] = subprocess.Popen(["bash", DEMO], cwd=REPO, env=env, stdout=open(logs[name], "w"),
                                       stderr=subprocess.STDOUT, start_new_session=True)
        print(f"[loss, seed {seed}] {name}: started, EXTRA_ARGS={' '.join(extra)!r} (log {logs[name]})", flush=True)

    names = [n.strip() for n in args.loss_contenders.split(",") if n.strip()]
    try:
        for name in names:
            start(name)
            if args.loss_mode == "sequential":
                procs[name].wait()
                wall[name] = time.monotonic() - started[name]
        for name in names:
            if name not in wall:
                procs[name].wait()
                wall[name] = time.monotonic() - started[name]
    finally:
        for p in procs.values():  # interrupted: the script, its torchrun agent and the ranks
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    rows = {}
    for name in names:
        text = open(logs[name], errors="replace").read()
        valid = [(int(i), float(v)) for i, v in _VALID_RE.findall(text)]
        train = [(int(i), float(v), float(ms)) for i, v, ms in _TRAIN_RE.findall(text)]
        # the logged iterations after the first log line (which carries the start-up)
        iter_ms = statistics.median(ms for _, _, ms in train[1:]) if len(train) > 1 else None
        stage = re.search(r"== 3/4.*?\(([\d.]+) s\)", text, re.S)
        ok = procs[name].returncode == 0 and valid and valid[-1][0] == args.loss_iters
        if not ok:
            failures.append(f"loss {name}, seed {seed}: exit {procs[name].returncode}, validation lines "
                            f"{valid[-2:]} (log {logs[name]})")
            continue
        rows[name] = {"seed": seed, "valid": valid, "train": train, "final_valid": valid[-1][1],
                      "wall_s": wall[name], "iteration_ms_median": iter_ms,
                      "train_s": float(stage.group(1)) if stage else None, "log": logs[name]}
        print(f"[loss, seed {seed}] {name}: validation loss {valid[-1][1]:.4f} at {valid[-1][0]}, "
              f"{wall[name]:.0f} s", flush=True)
    return rows


def loss_part(args, results: dict, failures: List[str]) -> List[str]:
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    out = ["", f"### Validation loss, tiny-moe demo, {args.loss_iters} iterations, each seed's pair "
               f"{'side by side' if args.loss_mode == 'parallel' else 'back to back'}", "",
           "| seed | contender | validation loss at each evaluation | final | vs fp32 (same seed) | wall s (training "
           "stage s) | ms/iteration (median of the logged ones) |",
           "|---|---|---|---|---|---|---|"]
    for seed in seeds:
        rows = _loss_pair(args, seed, failures)
        results[str(seed)] = rows
        for name in [n.strip() for n in args.loss_contenders.split(",") if n.strip()]:
            if name not in rows:
                out.append(f"| {seed} | {name} | FAILED | | | | |")
                continue
            r = rows[name]
            rel = (r["final_valid"] / rows["fp32"]["final_valid"] - 1) if "fp32" in rows and name != "fp32" \
                else None
            r["rel_vs_fp32"] = rel
            out.append(f"| {seed} | {name} | {', '.join(f'{i}: {v:.4f}' for i, v in r['valid'])} | "
                       f"{r['final_valid']:.4f} | {'' if rel is None else f'{100 * rel:+.2f}%'} | {r['wall_s']:.0f} "
                       f"({r['train_s'] if r['train_s'] is not None else 'n/a'}) | "
                       f"{'n/a' if r['iteration_ms_median'] is None else round(r['iteration_ms_median'])} |")
    # --seed also orders the data (hybrid/data/gpt_dataset.py), so the validation batches differ between seeds:
    # only the two runs of one seed compare
    rels = [results[str(s)]["int8"]["rel_vs_fp32"] for s in seeds
            if "int8" in results.get(str(s), {}) and results[str(s)]["int8"].get("rel_vs_fp32") is not None]
    if rels:
        results["int8_vs_fp32"] = {"mean": statistics.mean(rels), "min": min(rels), "max": max(rels)}
        out += ["", f"int8 vs fp32, final validation loss, over {len(rels)} seed(s): mean "
                    f"{100 * statistics.mean(rels):+.2f}% (min {100 * min(rels):+.2f}%, max {100 * max(rels):+.2f}%)"]
    return out


def _t_quantile(p: float, df: int) -> float:
    """Student's t quantile (two-sided intervals: ``p`` = 0.975) by bisection on its CDF, the density integrated
    with Simpson's rule: no SciPy needed, accurate to 1e-6 for df >= 2."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t, n=2000):  # 0.5 + integral of the density from 0 to t
        h = t / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: List[float]) -> dict:
    """Mean, sample standard deviation and the 95% t-interval of the mean of ``values`` (n >= 2)."""
    n, mean = len(values), statistics.mean(values)
    sd = statistics.stdev(values)
    half = _t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}


def summarize(paths: List[str]) -> str:
    """Every seed's final validation loss over the loss runs kept in ``paths`` (this script's ``--json`` files, or
    the results file that holds many under ``runs``): int8 and the fp32-tp1 control against fp32 of the same seed,
    and over the seeds the mean change with its 95% t-interval (seeds are independent draws of data order and
    initial weights; a seed's runs are paired)."""
    finals: Dict[int, Dict[str, float]] = {}
    for path in paths:
        data = json.load(open(path))
        for run in (data["runs"].values() if "runs" in data else [data]):
            loss = run["results"].get("loss", {})
            if any(k in LOSS_EXTRA for k in loss):  # the first runs' layout: one seed, rows by contender
                loss = {str(run["args"].get("seeds", DEMO_SEED)): {k: v for k, v in loss.items() if k in LOSS_EXTRA}}
            for seed, rows in loss.items():
                if seed.isdigit():
                    for name, row in rows.items():
                        finals.setdefault(int(seed), {})[name] = row["final_valid"]
    names = [n for n in LOSS_EXTRA if n != "fp32"]
    out = ["| seed | fp32 | " + " | ".join(f"{n} | {n} vs fp32" for n in names) + " |",
           "|---|---:|" + "---:|---:|" * len(names)]
    changes: Dict[str, List[float]] = {n: [] for n in names}
    for seed in sorted(finals):
        row = finals[seed]
        if "fp32" not in row:
            continue
        cells = []
        for n in names:
            if n in row:
                changes[n].append(row[n] / row["fp32"] - 1)
                cells += [f"{row[n]:.4f}", f"{100 * changes[n][-1]:+.2f}%"]
            else:
                cells += ["", ""]
        out.append(f"| {seed} | {row['fp32']:.4f} | " + " | ".join(cells) + " |")
    out.append("")
    for n, values in changes.items():
        if len(values) >= 2:
            m = mean_interval(values)
            out.append(f"{n} vs fp32 over {m['n']} seeds: mean {100 * m['mean']:+.2f}%, 95% interval of the mean "
                       f"[{100 * m['low']:+.2f}%, {100 * m['high']:+.2f}%], sd {100 * m['sd']:.2f}%, per seed "
                       f"{100 * min(values):+.2f}% to {100 * max(values):+.2f}%")
    return "\n".join(out)


# ---- the driver ----------------------------------------------------------------------------------------------------
def warm_quantize_kernel() -> None:
    """Build (or load) the int8 packing kernel here, once, before any run: its first build takes minutes on a
    loaded machine and would otherwise land inside the first int8 run's figures."""
    import torch

    from hybrid.kernels import quantize
    from model_zoo.config import DISPATCH_BLOCK

    quantize.pack(torch.zeros(2, DISPATCH_BLOCK), 8, DISPATCH_BLOCK)


def parse(argv=None) -> argparse.Namespace:
    from hybrid.argument_parser import ArgumentParser

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="cluster,loss", help="comma-separated: cluster, loss")
    ap.add_argument("--rates", default="50mbit,200mbit", help="tc rates of the emulated link, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="optimizer steps before the timed ones")
    ap.add_argument("--dispatch-passes", type=int, default=2, help="forward+backward passes in the bytes window")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab-cap", type=int, default=4096, help="token ids drawn below this")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per emulated-cluster run")
    ap.add_argument("--prefix", default="hmq", help="name prefix of the emulated cluster's namespaces")
    ap.add_argument("--loss-iters", type=int, default=300)
    ap.add_argument("--loss-mode", choices=("parallel", "sequential"), default="parallel")
    ap.add_argument("--loss-contenders", default="fp32,int8",
                    help=f"comma-separated, of {sorted(LOSS_EXTRA)} (fp32-tp1: a control, see LOSS_ENV)")
    ap.add_argument("--seeds", default=str(DEMO_SEED), help="comma-separated --seed values: one pair of demo runs "
                                                            "each (the first the demo's own)")
    ap.add_argument("--work-dir", default="/tmp/hmq_loss", help="the loss part's runs (WORK_DIR per contender)")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "moe_compressed_dispatch.json"))
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the loss runs kept in these --json files "
                    "(or the results file) over all their seeds, with the mean change and its 95%% interval; runs "
                    "nothing")
    ap.add_argument("--worker", default="", help="internal: run this contender under torchrun")
    args = ap.parse_args(argv)
    bad = set(p.strip() for p in args.parts.split(",") if p.strip()) - {"cluster", "loss"}
    unknown = set(n.strip() for n in args.loss_contenders.split(",") if n.strip()) - set(LOSS_EXTRA)
    if unknown:
        ap.error(f"--loss-contenders {args.loss_contenders}: unknown {sorted(unknown)}; give some of {sorted(LOSS_EXTRA)}")
    if bad:
        ap.error(f"--parts {args.parts}: unknown part(s) {sorted(bad)}; give cluster and/or loss")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    # SIGTERM unwinds like Ctrl-C: the loss part's runs are ended and the emulated cluster torn down on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    started = datetime.datetime.now().astimezone()
    load = os.getloadavg()
    results: dict = {"cluster": {}, "loss": {}}
    warm_quantize_kernel()
    failures: List[str] = []
    out = [f"{started:%Y-%m-%d %H:%M} {started.tzname()}; {os.cpu_count()} CPU cores, load average at start "
           f"{' '.join(f'{v:.2f}' for v in load)}"]
    if "cluster" in parts:
        out += [f"", f"## Emulated cluster: {NODES} nodes x {RANKS_PER_NODE} ranks, EP {EP}, tiny-moe fp32, micro "
                     f"batch {args.micro_batch} x seq {args.seq} per rank; {args.dispatch_passes} forward+backward "
                     f"passes in the bytes window; {args.warmup} + {args.steps} timed optimizer steps"]
        out += cluster_part(args, results["cluster"], failures)
    if "loss" in parts:
        out += loss_part(args, results["loss"], failures)
    out += [f"", f"finished {datetime.datetime.now().astimezone():%H:%M}"] + [f"FAILED: {f}" for f in failures]
    print("\n".join(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
                       "started": started.isoformat(timespec="seconds"), "args": vars(args), "loadavg_start": load,
                       "results": results, "failures": failures, "text": "\n".join(out)}, f, indent=1,
                      default=str)
        print(f"results: {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    if any(a.startswith("--worker") for a in sys.argv[1:]):
        sys.exit(worker(parse()))
    sys.exit(main())
