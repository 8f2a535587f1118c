"""Two pieces of hybrid's expert-parallel token path, timed alone in CPU time (see benchmarks/moe.md).

1. The regroup of the rows that arrive at an expert-parallel rank (source-major to expert-major before the
   experts, and back after them: two ``index_select`` gathers of ``[N, h]`` and their backward), as
   ``model_zoo.moe.MoELayer._across_ep`` does, in one process.
2. hybrid's dispatch (the per-expert count exchange ``Communicator.all_to_all_single`` plus
   ``hybrid.tensor_parallel.all_to_all.all_to_all_v``) against a plain ``torch.distributed.all_to_all_single``
   of the same rows with equal splits (what DeepSpeed-MoE's fixed-capacity layout needs), at world 2 (gloo).

Each: median ``time.process_time`` (every thread of the process) per call over ``--calls`` calls after 10,
one torch thread. Reproduce::

    python benchmarks/moe_dispatch_micro.py            # N=1024 rows of h=256 fp32 (moe_vs_deepspeed's rank)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.multiproc import run_distributed  # noqa: E402


def regroup_ms(rows: int, h: int, calls: int) -> float:
    torch.set_num_threads(1)
    x = torch.randn(rows, h, requires_grad=True)
    perm = torch.randperm(rows)
    inv = torch.argsort(perm)
    ts = []
    for _ in range(calls + 10):
        t = time.process_time()
        y = x.index_select(0, perm).index_select(0, inv)
        y.backward(torch.ones_like(y))
        ts.append(time.process_time() - t)
    return 1e3 * statistics.median(ts[10:])


def dispatch_child(rows: int, h: int, calls: int, experts: int) -> dict:
    import torch.distributed as dist

    from hybrid import Topology
    from hybrid.tensor_parallel.all_to_all import all_to_all_v

    world = dist.get_world_size()
    topo = Topology(tp=1, ep=world)
    x = torch.randn(rows, h)
    per = rows // experts

    def hybrid_dispatch():
        send = torch.full((world, experts // world), per)  # rows for each peer's each local expert
        recv = torch.empty_like(send)
        topo.comm.all_to_all_single(recv, send, "ep")
        return all_to_all_v(x, recv.sum(1).tolist(), send.sum(1).tolist(), topo, "ep", op="moe_dispatch",
                            back_op="moe_dispatch_grad")

    def plain():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    res = {}
    for name, fn in (("hybrid count exchange + all_to_all_v", hybrid_dispatch),
                     ("torch.distributed.all_to_all_single", plain)):
        ts = []
        for _ in range(calls + 10):
            dist.barrier()
            t = time.process_time()
            fn()
            ts.append(time.process_time() - t)
        res[name] = 1e3 * statistics.median(ts[10:])
    return res


def main(argv=None) -> int:
    from hybrid.argument_parser import ArgumentParser

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024, help="routed rows on a rank (tokens x top-k)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    print(f"regroup (2 gathers of [{args.rows}, {args.hidden}] fp32 + backward): "
          f"{regroup_ms(args.rows, args.hidden, args.calls):.3f} ms CPU per step")
    per_rank = run_distributed(dispatch_child, 2, args.rows, args.hidden, args.calls, args.experts, timeout=300)
    for name in per_rank[0]:
        print(f"world 2, {name}: " + ", ".join(f"rank {r} {d[name]:.3f} ms" for r, d in enumerate(per_rank))
              + " CPU per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
