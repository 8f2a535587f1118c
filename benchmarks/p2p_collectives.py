"""gloo's own reduce-scatter and all-gather against hybrid's point-to-point ones, side by side.

    python benchmarks/p2p_collectives.py [--world 4] [--sizes 786432,2097152,8388608] [--rounds 3] [--calls 20]

Every contender runs in the same ``--world`` gloo processes of this machine (one node), over the
whole world as the ``dp`` axis, on fp32 buffers of each ``--sizes`` elements (the input of a
reduce-scatter, the output of an all-gather):

* ``gloo``: ``torch.distributed.reduce_scatter_tensor`` / ``all_gather_into_tensor``;
* ``ring``: :class:`hybrid.p2p_collectives.RingReduceScatter` (what the communicator runs when
  the group spans nodes);
* ``direct``: ``Communicator.reduce_scatter_tensor`` / ``all_gather_into_tensor``, which inside
  a node send every chunk straight to its rank (:mod:`hybrid.p2p_collectives`).

Each call starts after a barrier; its time is the slowest rank's wall time, and its CPU the
process CPU time (gloo's threads included) summed over ranks. Within a round each contender
makes ``--calls`` calls, interleaved call by call in an order rotated by one each time; the
round's figure is the median. Each round starts fresh processes. The ratios (hybrid over gloo)
are paired per round: the median over rounds and the min-max (``benchmarks/paired.py``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.paired import paired_ratio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402


def _calls(topo, numel: int) -> Dict[str, object]:
    """One callable per (op, contender) over ``numel``-element buffers of this rank."""
    import torch.distributed as dist

    from hybrid.p2p_collectives import RingReduceScatter

    comm, group, n = topo.comm, topo.group("dp"), topo.size("dp")
    ranks, me = list(topo.group_ranks("dp")), topo.rank_in("dp")
    k = numel // n
    big, small = torch.randn(n * k), torch.randn(k)
    sequence = [1 << 20]  # ring tags of their own, far from the communicator's

    def ring():
        sequence[0] += 1
        RingReduceScatter(small, big, group, ranks, me, sequence[0], None, contextlib.nullcontext).finish()

    return {
        ("reduce_scatter", "gloo"): lambda: dist.reduce_scatter_tensor(small, big, group=group),
        ("reduce_scatter", "ring"): ring,
        ("reduce_scatter", "direct"): lambda: comm.reduce_scatter_tensor(small, big, "dp"),
        ("all_gather", "gloo"): lambda: dist.all_gather_into_tensor(big, small, group=group),
        ("all_gather", "direct"): lambda: comm.all_gather_into_tensor(big, small, "dp"),
    }


def child(sizes: List[int], calls: int) -> Dict:
    """Per (size, op, contender): each call's wall and process CPU seconds on this rank."""
    import torch.distributed as dist

    from hybrid import Topology

    torch.set_num_threads(1)
    topo = Topology()
    out: Dict = {}
    for numel in sizes:
        fns = _calls(topo, numel)
        keys = list(fns)
        for key in keys:  # warm-up: connections, first-touch of the buffers
            fns[key]()
        for c in range(calls):
            for key in keys[c % len(keys):] + keys[:c % len(keys)]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fns[key]()
                rec = out.setdefault((numel,) + key, {"wall": [], "cpu": []})
                rec["wall"].append(time.perf_counter() - t0)
                rec["cpu"].append(time.process_time() - c0)
    return out


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", default="786432,2097152,8388608", help="elements per buffer, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    sizes = [int(s) // args.world * args.world for s in args.sizes.split(",")]
    rounds: List[Dict] = []
    for r in range(args.rounds):
        per_rank = run_distributed(child, args.world, sizes, args.calls, start="spawn", timeout=600)
        figures = {}
        for key in per_rank[0]:
            walls = [max(rank[key]["wall"][i] for rank in per_rank) for i in range(args.calls)]
            cpus = [sum(rank[key]["cpu"][i] for rank in per_rank) for i in range(args.calls)]
            figures[key] = (statistics.median(walls), statistics.median(cpus))
        rounds.append(figures)
        print(f"[round {r + 1}] done", flush=True)
    print(f"\nworld {args.world} (gloo, one node, {os.cpu_count()} CPUs), fp32, {args.calls} calls per contender "
          f"per round, {args.rounds} rounds; medians over calls then rounds; ratio: hybrid / gloo, paired per round "
          f"(min-max)\n")
    print(f"{'op':15s} {'elements':>9s} {'contender':9s} {'wall ms':>8s} {'CPU ms':>7s}   {'wall ratio':18s} CPU ratio")
    for key in rounds[0]:  # (elements, op, contender), in the order _calls lists them, size by size
        numel, op, name = key
        wall = statistics.median(f[key][0] for f in rounds) * 1e3
        cpu = statistics.median(f[key][1] for f in rounds) * 1e3
        line = f"{op:15s} {numel:9d} {name:9s} {wall:8.2f} {cpu:7.2f}"
        if name != "gloo":
            base = (numel, op, "gloo")
            w = paired_ratio({i: f[key][0] for i, f in enumerate(rounds)},
                             {i: f[base][0] for i, f in enumerate(rounds)})
            c = paired_ratio({i: f[key][1] for i, f in enumerate(rounds)},
                             {i: f[base][1] for i, f in enumerate(rounds)})
            line += f"   {w.format():18s} {c.format()}"
        print(line)


if __name__ == "__main__":
    main()
