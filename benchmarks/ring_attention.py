"""Ring attention (hybrid.context_parallel, --cp-comm-type p2p): how long the ring waits for key/value blocks,
out of the attention time, at CP2 and CP4 against CP1, and on the emulated 2-node cluster with the cp pair inside
a node against across the link (results: benchmarks/ring_attention.md).

For each sequence length (default 8K, 16K, 32K tokens; one sample, small heads: ``--heads`` query heads and
key/value groups of ``--head-dim``, fp32) each cp rank runs the forward and backward of
:func:`hybrid.context_parallel.context_parallel_attention` on its ``s / cp`` tokens. Per call: wall time between
two world barriers (the attention time; the slowest rank's, as the ring makes every rank wait for the slowest),
and the seconds the rank's thread spent blocked in the ring's waits (``Communicator.blocked_seconds``: the
communication the block in hand did not hide). ``wait`` is blocked / attention time, the median over ranks.

Rounds: ``--rounds`` interleaved rounds (cp 1, 2, 4 in turn, fresh processes each), ``--calls`` timed calls per
length after one warm-up; the table gives per-round medians' median and their min-max over rounds. One torch
thread per rank: on a machine with fewer cores than cp ranks, the ranks share cores, so the wall time includes
their contention (and blocked time includes a peer being descheduled); the core count is printed.

``--cluster RATES`` (instead of the one-machine part; root): world 4 as 2 emulated nodes x 2 ranks
(``tools/emulated_cluster.py``: network namespaces, the veth link shaped with ``tc tbf`` at each rate, ``none``
for unshaped; ranks 0, 1 on node 0, ranks 2, 3 on node 1), one torchrun agent per node, this file with
``--worker NAME`` the per-rank program. Contenders (:data:`PLACEMENTS`), both with two cp = 2 rings running at
once, the same per-rank work and the same messages, only where the ring's hops go differs (hybrid.grid's order:
tp innermost, then cp, then dp):

* ``inside``: ``Topology(cp=2)``, CP2 x DP2: cp groups {0, 1} and {2, 3}, each inside a node; nothing of the
  ring crosses the link.
* ``across``: ``Topology(tp=2, cp=2)``, TP2 x CP2 (tp inside the node, as a real job keeps it): cp groups
  {0, 2} and {1, 3}, every hop of both rings crosses the link. The tp axis carries nothing here (the attention
  alone, each rank with its own heads); it only places the cp pairs.
* ``cp4`` (optional): ``Topology(cp=4)``: one ring 0-1-2-3, two of its four hops cross; each rank holds s / 4
  tokens, so its work differs from the others'.

Per call it also reports the bytes that crossed the link: each node's veth ``tx_bytes`` read by the node's local
rank 0 between barriers around the call (frames with their TCP/IP headers and the ACKs, plus one barrier), and
the communicator's model of the bytes sent off each node (``Communicator.inter_node_total``).

Reproduce (from the repository root; ``flock /work/bench.lock`` on a shared machine)::

    python benchmarks/ring_attention.py                 # 8K, 16K, 32K; heads 1 x 16; 3 rounds
    python benchmarks/ring_attention.py --cluster 200mbit,50mbit --lengths 8192 16384   # root
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.cluster_ranks import print_on_rank0, read_ranks  # noqa: E402
from benchmarks.paired import PairedRatio, paired_ratio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402

# The emulated-cluster contenders: name -> Topology sizes (world 4 on 2 nodes x 2 ranks; see the docstring).
PLACEMENTS = {"inside": {"cp": 2}, "across": {"tp": 2, "cp": 2}, "cp4": {"cp": 4}}
WORKER_PREFIX = "ring_attention worker: "


def _veth_tx() -> Optional[int]:
    """This node's veth ``tx_bytes`` (inside the emulated node's namespace; read by local rank 0 only), else None."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def measure(topo, lengths, heads: int, head_dim: int, calls: int) -> dict:
    """Per length ``s``: this rank's per-call figures over ``calls`` timed calls after one warm-up, as lists:
    ``wall`` (s), ``blocked`` (s), ``inter`` (bytes the communicator counts as sent off this node) and ``veth``
    (this node's veth tx bytes, or None off the emulated cluster)."""
    from hybrid.context_parallel import context_parallel_attention

    cp = topo.cp_size
    out = {}
    for s in lengths:
        S = s // cp
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, S, head_dim, generator=g).requires_grad_() for _ in range(3))
        rec: Dict[str, list] = {"wall": [], "blocked": [], "inter": [], "veth": []}
        for call in range(calls + 1):
            topo.comm.barrier("world")  # both rings (on the cluster) start together, as in a job
            tx, inter = _veth_tx(), topo.comm.inter_node_total()
            topo.comm.barrier("world")  # no rank sends before every node's counter is read
            blocked, t = topo.comm.blocked_seconds(), time.perf_counter()
            o = context_parallel_attention(q, k, v, topo, "p2p")
            o.backward(torch.ones_like(o))
            wall, blocked = time.perf_counter() - t, topo.comm.blocked_seconds() - blocked
            topo.comm.barrier("world")
            tx_after = _veth_tx()
            if call:  # the first is a warm-up
                rec["wall"].append(wall)
                rec["blocked"].append(blocked)
                rec["inter"].append(topo.comm.inter_node_total() - inter)
                rec["veth"].append(None if tx is None else tx_after - tx)
        out[s] = rec
    return out


def child(lengths, heads: int, head_dim: int, calls: int) -> dict:
    from hybrid.topology import Topology

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return measure(Topology(cp=world), lengths, heads, head_dim, calls)


def summarise(ranks: List[dict], s: int) -> dict:
    """One run's figures at length ``s`` from every rank's :func:`measure`: the slowest rank's median wall,
    the median over ranks of each rank's median blocked time and wait fraction, and the bytes per call
    (median over calls) summed over ranks (model) and over nodes (veth)."""
    calls = len(ranks[0][s]["wall"])
    wall = max(statistics.median(rk[s]["wall"]) for rk in ranks)
    blocked = statistics.median(statistics.median(rk[s]["blocked"]) for rk in ranks)
    wait = statistics.median(statistics.median(rk[s]["blocked"]) / statistics.median(rk[s]["wall"]) for rk in ranks)
    inter = statistics.median(sum(rk[s]["inter"][c] for rk in ranks) for c in range(calls))
    veths = [[rk[s]["veth"][c] for rk in ranks if rk[s]["veth"][c] is not None] for c in range(calls)]
    veth = statistics.median(sum(v) for v in veths) if all(veths) else None
    return {"wall": wall, "blocked": blocked, "wait": wait, "inter": inter, "veth": veth}


def main() -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cluster", default="", help="run on 2 emulated nodes x 2 ranks instead, at these link rates "
                                                 "(comma-separated tc rates, e.g. 200mbit,50mbit; none: unshaped)")
    p.add_argument("--placements", default="inside,across",
                   help=f"cluster contenders, comma-separated, of {', '.join(PLACEMENTS)}")
    p.add_argument("--cluster-timeout", type=float, default=900.0, help="seconds per emulated-cluster run")
    p.add_argument("--worker", default="", help="internal: run this placement under torchrun")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.cluster:
        return cluster_main(a)
    rows = {}  # (cp, s) -> list over rounds of (attention s, wait fraction)
    for r in range(a.rounds):
        for cp in a.cps:
            ranks = run_distributed(child, cp, a.lengths, a.heads, a.head_dim, a.calls, timeout=3000)
            for s in a.lengths:
                row = summarise(ranks, s)
                rows.setdefault((cp, s), []).append((row["wall"], row["wait"]))
                print(f"round {r} cp {cp} s {s}: attention {row['wall'] * 1e3:.0f} ms, waiting "
                      f"{100 * row['wait']:.1f}%, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, heads {a.heads} x {a.head_dim}, fp32, "
          f"fwd+bwd, {a.rounds} rounds x {a.calls} calls")
    print(table(rows, a.lengths, a.cps))
    return 0


def table(rows, lengths, cps) -> str:
    """The markdown table: per (tokens, cp) the median over rounds and min-max of the attention time, its ratio
    to the first cp's time paired within each round (benchmarks/paired.py), and the waiting fraction."""
    lines = ["| tokens | cp | attention fwd+bwd, ms (min-max) | time / cp 1's, paired per round | "
             "ring waiting, % of attention (min-max) |", "|---|---|---|---|---|"]
    for s in lengths:
        base = [w for w, _ in rows[(cps[0], s)]]
        for cp in cps:
            ws = [w for w, _ in rows[(cp, s)]]
            fr = [f for _, f in rows[(cp, s)]]
            paired = PairedRatio(tuple(range(len(ws))), tuple(w / b for w, b in zip(ws, base)))
            lines.append(f"| {s} | {cp} | {_spread(ws, 1e3, '.0f')} | {paired.format()} | "
                         f"{_spread(fr, 100, '.1f')} |")
    return "\n".join(lines)


def _spread(xs, scale: float, fmt: str) -> str:
    """``median (min-max)`` of ``xs`` times ``scale``."""
    return f"{statistics.median(xs) * scale:{fmt}} ({min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}})"


# ---- the emulated 2-node cluster (tools/emulated_cluster.py) ---------------------------------------------------
def worker(a) -> int:
    """Under torchrun (one agent per emulated node): measure placement ``--worker`` and print every rank's
    figures from rank 0 as one ``ring_attention worker: {json}`` line."""
    import hybrid
    from hybrid.topology import Topology

    torch.set_num_threads(1)
    hybrid.init_distributed(backend="gloo")
    topo = Topology(**PLACEMENTS[a.worker])  # ranks_per_node from torchrun's LOCAL_WORLD_SIZE
    mine = measure(topo, a.lengths, a.heads, a.head_dim, a.calls)
    mine["cp_groups"] = topo.grid.all_groups("cp")
    print_on_rank0(WORKER_PREFIX, mine)
    topo.close()
    return 0


def worker_argv(name: str, a) -> List[str]:
    return [os.path.abspath(__file__), f"--worker={name}", "--lengths", *map(str, a.lengths), f"--heads={a.heads}",
            f"--head-dim={a.head_dim}", f"--calls={a.calls}"]


def cluster_main(a) -> int:
    """Every placement on 2 emulated nodes x 2 ranks at each ``--cluster`` rate, ``--rounds`` interleaved rounds
    (order reversed on odd rounds); prints a line per run, then the table."""
    from tools import emulated_cluster as tool

    names = [n.strip() for n in a.placements.split(",") if n.strip()]
    bad = [n for n in names if n not in PLACEMENTS]
    if bad:
        print(f"--placements {','.join(bad)}: not one of {', '.join(PLACEMENTS)}", file=sys.stderr)
        return 2
    try:
        tool.check_available()
    except tool.ClusterUnavailable as e:
        print(f"emulated cluster: not available here: {e}", file=sys.stderr)
        return 2
    rates = [r.strip() for r in a.cluster.split(",") if r.strip()]
    runs: Dict[tuple, Dict[int, dict]] = {}  # (rate, name, s) -> round -> summarise()
    failed = []
    for rate in rates:
        with tool.EmulatedCluster(nodes=2, ranks_per_node=2, rate=None if rate == "none" else rate) as cluster:
            for r in range(a.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    load = os.getloadavg()[0]
                    res = cluster.run(worker_argv(name, a), timeout_s=a.cluster_timeout, cwd=REPO)
                    every = read_ranks(res.nodes[0].output, WORKER_PREFIX)
                    if not res.ok or every is None:
                        failed.append(f"{rate} round {r} {name}")
                        print(f"[{rate}, round {r}] {name}: FAILED {res.describe()}\n{res.nodes[0].output[-1500:]}",
                              flush=True)
                        continue
                    # JSON made the lengths strings
                    ranks = [{(int(k) if k.isdigit() else k): v for k, v in rk.items()} for rk in every]
                    run_tx = sum(v["tx_bytes"] for v in res.link_bytes.values())
                    for s in a.lengths:
                        row = summarise(ranks, s)
                        runs.setdefault((rate, name, s), {})[r] = row
                        print(f"[{rate}, round {r}] {name} (cp groups {ranks[0]['cp_groups']}) s {s}: attention "
                              f"{row['wall'] * 1e3:.0f} ms, blocked {row['blocked'] * 1e3:.0f} ms "
                              f"({100 * row['wait']:.1f}%), link {row['veth'] / 1e6:.2f} MB/call (model "
                              f"{row['inter'] / 1e6:.2f})", flush=True)
                    print(f"[{rate}, round {r}] {name}: run {res.wall_s:.0f} s, veth tx of the whole run (start-up "
                          f"included) {run_tx / 1e6:.1f} MB, load {load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, 2 emulated nodes x 2 ranks (tc tbf both "
          f"directions), heads {a.heads} x {a.head_dim}, fp32, fwd+bwd, {a.rounds} interleaved rounds x "
          f"{a.calls} calls after a warm-up")
    print(cluster_table(runs, rates, names, a.lengths))
    if failed:
        print("FAILED: " + "; ".join(failed))
    return 1 if failed else 0


def cluster_table(runs, rates, names, lengths) -> str:
    """Per (link, tokens, placement): attention time, its ratio to the first placement's paired per round, the
    ring's blocked time and its share, and the bytes per call over the link (veth, measured; model)."""
    lines = [f"| link | tokens | placement | attention fwd+bwd, ms (min-max) | time / {names[0]}'s, paired | "
             "ring blocked, ms (min-max) | ring waiting, % of attention (min-max) | link MB/call, veth tx both "
             "nodes (min-max) | model MB/call |", "|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        for s in lengths:
            base = {r: v["wall"] for r, v in runs.get((rate, names[0], s), {}).items()}
            for name in names:
                rs = runs.get((rate, name, s))
                if not rs:
                    continue
                col = lambda key: [v[key] for v in rs.values()]  # noqa: E731
                pr = paired_ratio({r: v["wall"] for r, v in rs.items()}, base)
                lines.append(f"| {rate} | {s} | {name} | {_spread(col('wall'), 1e3, '.0f')} | "
                             f"{pr.format() if pr else 'n/a'} | {_spread(col('blocked'), 1e3, '.0f')} | "
                             f"{_spread(col('wait'), 100, '.1f')} | {_spread(col('veth'), 1e-6, '.2f')} | "
                             f"{statistics.median(col('inter')) / 1e6:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
