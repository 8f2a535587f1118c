"""Ring attention (hybrid.context_parallel, --cp-comm-type p2p): how long the ring waits for key/value blocks,
out of the attention time, at CP2 and CP4 against CP1 (results: benchmarks/ring_attention.md).

For each sequence length (default 8K, 16K, 32K tokens; one sample, small heads: ``--heads`` query heads and
key/value groups of ``--head-dim``, fp32) each cp rank runs the forward and backward of
:func:`hybrid.context_parallel.context_parallel_attention` on its ``s / cp`` tokens. Per call: wall time between
two cp barriers (the attention time; the slowest rank's, as the ring makes every rank wait for the slowest), and
the seconds the rank's thread spent blocked in the ring's waits (``Communicator.blocked_seconds``: the
communication the block in hand did not hide). ``wait`` is blocked / attention time, the median over ranks.

Rounds: ``--rounds`` interleaved rounds (cp 1, 2, 4 in turn, fresh processes each), ``--calls`` timed calls per
length after one warm-up; the table gives per-round medians' median and their min-max over rounds. One torch
thread per rank: on a machine with fewer cores than cp ranks, the ranks share cores, so the wall time includes
their contention (and blocked time includes a peer being descheduled); the core count is printed.

Reproduce (from the repository root; ``flock /work/bench.lock`` on a shared machine)::

    python benchmarks/ring_attention.py                 # 8K, 16K, 32K; heads 1 x 16; 3 rounds
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.paired import PairedRatio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402


def child(lengths, heads: int, head_dim: int, calls: int) -> dict:
    from hybrid.context_parallel import context_parallel_attention
    from hybrid.topology import Topology

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    topo = Topology(cp=world)
    out = {}
    for s in lengths:
        S = s // world
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, S, head_dim, generator=g).requires_grad_() for _ in range(3))
        walls, waits = [], []
        for call in range(calls + 1):
            topo.comm.barrier("cp")
            blocked, t = topo.comm.blocked_seconds(), time.perf_counter()
            o = context_parallel_attention(q, k, v, topo, "p2p")
            o.backward(torch.ones_like(o))
            wall, blocked = time.perf_counter() - t, topo.comm.blocked_seconds() - blocked
            topo.comm.barrier("cp")
            if call:  # the first is a warm-up
                walls.append(wall)
                waits.append(blocked)
        out[s] = (statistics.median(walls), statistics.median(waits))
    return out


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rows = {}  # (cp, s) -> list over rounds of (attention s, wait fraction)
    for r in range(a.rounds):
        for cp in a.cps:
            ranks = run_distributed(child, cp, a.lengths, a.heads, a.head_dim, a.calls, timeout=3000)
            for s in a.lengths:
                wall = max(rk[s][0] for rk in ranks)
                wait = statistics.median(rk[s][1] / rk[s][0] for rk in ranks)
                rows.setdefault((cp, s), []).append((wall, wait))
                print(f"round {r} cp {cp} s {s}: attention {wall * 1e3:.0f} ms, waiting {100 * wait:.1f}%",
                      flush=True)
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__}, heads {a.heads} x {a.head_dim}, fp32, "
          f"fwd+bwd, {a.rounds} rounds x {a.calls} calls")
    print(table(rows, a.lengths, a.cps))


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
            lines.append(f"| {s} | {cp} | {statistics.median(ws) * 1e3:.0f} ({min(ws) * 1e3:.0f}-"
                         f"{max(ws) * 1e3:.0f}) | {paired.format()} | {100 * statistics.median(fr):.1f} "
                         f"({100 * min(fr):.1f}-{100 * max(fr):.1f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
