"""Cold and warm compile time of regional compilation (model_zoo.compile) at world 4, for 4 and 24 layers.

Each measurement is a fresh job of 4 spawned processes (``--tp`` x DP, ZeRO-1, the demo's ``tiny`` GPT at sequence
128, micro-batch 4; sequence parallelism when TP > 1) that compiles its blocks, trains 2 steps and reports rank
0's compile time: dynamo's and inductor's own clock (``CompileReport.figures()["seconds"]``, forward and backward
graphs), beside the wall time of the first step (benchmarks/compile_speed.py's job). Cold: an empty inductor cache
folder. Warm: a second fresh job over the folder the cold one filled, as a resumed run finds its
``checkpoint.save/compile-cache`` (fresh processes: nothing is remembered in memory, only inductor's FX graph
cache and AOTAutograd's cache on disk; dynamo still traces every graph). Rounds interleave the four cases, so the
machine's drifting load hits each alike; the figures are medians with their min-max over rounds, and the ratios
are paired per round (benchmarks/paired.py).

    python benchmarks/compile_cache.py [--rounds 3] [--layers 4 24] [--tp 2]

Targets (issue 51): warm at most 0.3x cold; 24 layers at most 1.5x the compile time of 4 (one compiled block serves
every layer, so depth adds no compile).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.compile_speed import WORLD, job  # noqa: E402
from benchmarks.paired import PairedRatio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 24])
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2, 4))
    args = parser.parse_args()
    results = {(n, kind): [] for n in args.layers for kind in ("cold", "warm")}
    for r in range(args.rounds):
        for n in args.layers:
            with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
                for kind in ("cold", "warm"):
                    out = run_distributed(job, WORLD, "tiny", True, cache, 1, 1, args.tp, n, args.tp > 1,
                                          timeout=1800, start="spawn", env={"OMP_NUM_THREADS": "1"})[0]
                    results[(n, kind)].append(out)
                    print(f"round {r + 1} layers {n} {kind}: compile {out['seconds']:.1f} s, first step "
                          f"{out['first_step_s']:.1f} s, step {out['step_s'] * 1e3:.0f} ms, {out['graphs']:.0f} "
                          f"graphs, {out['breaks']:.0f} breaks", flush=True)

    def med(n, kind, key):
        values = [x[key] for x in results[(n, kind)]]
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    def paired(a, b):  # b / a per round
        return PairedRatio(tuple(range(args.rounds)),
                           tuple(y["seconds"] / x["seconds"] for x, y in zip(results[a], results[b]))).format()

    print(f"\nworld {WORLD}, tp {args.tp}")
    print("| layers | cold compile s | warm compile s | warm / cold | cold first step s | warm first step s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.layers:
        print(f"| {n} | {med(n, 'cold', 'seconds')} | {med(n, 'warm', 'seconds')} | "
              f"{paired((n, 'cold'), (n, 'warm'))} | {med(n, 'cold', 'first_step_s')} | "
              f"{med(n, 'warm', 'first_step_s')} |")
    if len(args.layers) >= 2:
        lo, hi = args.layers[0], args.layers[-1]
        for kind in ("cold", "warm"):
            print(f"{hi} layers / {lo} layers, {kind} compile time: {paired((lo, kind), (hi, kind))}")


if __name__ == "__main__":
    main()
