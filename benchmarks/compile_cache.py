"""Cold and warm compile time of regional compilation (model_zoo.compile) at world 4, for 4 and 24 layers.

Each measurement is a fresh job of 4 spawned processes (TP2 x DP2, ZeRO-1, the demo's ``tiny`` GPT at sequence
128, micro-batch 2) that compiles its blocks, trains 2 steps and reports rank 0's compile time: dynamo's and
inductor's own clock (``CompileReport.figures()["seconds"]``, forward and backward graphs), beside the wall time
of the first step. Cold: an empty inductor cache folder. Warm: a second fresh job over the folder the cold one
filled, as a resumed run finds its ``checkpoint.save/compile-cache`` (fresh processes: nothing is remembered in
memory, only the FX graph cache on disk). Rounds interleave the four cases, so the machine's drifting load hits
each alike; the figures are medians with their min-max over rounds.

    python benchmarks/compile_cache.py [--rounds 3] [--layers 4 24]

Targets (issue 51): warm at most 0.3x cold; 24 layers at most 1.5x the compile time of 4 (one compiled block serves
every layer, so depth adds no compile).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.paired import PairedRatio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402

WORLD, TP = 4, 2


def job(layers: int, cache_dir: str) -> dict:
    import torch

    import hybrid
    from hybrid.config.parse import config_from_dict
    from model_zoo import GPTModel, get_preset
    from model_zoo.compile import compile_blocks

    topo = hybrid.Topology(tp=TP, timeout_s=600)
    cfg = get_preset("tiny").replace(num_layers=layers, sequence_parallel=True)
    model = GPTModel(cfg, topo, seed=1)
    engine = hybrid.initialize(model, config_from_dict({
        "optimizer": {"type": "adamw", "lr": 1e-3}, "zero": {"stage": 1}, "steps_per_print": 0,
        "micro_batch_size": 2, "global_batch_size": 2 * topo.dp_size}), topology=topo)
    report = compile_blocks(model, cache_dir=cache_dir)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    walls = []
    for _ in range(2):
        start = time.perf_counter()
        engine.train_batch([{"input_ids": ids, "labels": ids}])
        walls.append(time.perf_counter() - start)
    figures = report.figures()
    engine.close()
    topo.close()
    return {"compile_s": figures["seconds"], "first_step_s": walls[0], "step_s": walls[1],
            "graphs": figures["graphs"], "breaks": figures["breaks"]}


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 24])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {(n, kind): [] for n in args.layers for kind in ("cold", "warm")}
    for r in range(args.rounds):
        for n in args.layers:
            with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
                for kind in ("cold", "warm"):
                    out = run_distributed(job, WORLD, n, cache, timeout=1800, start="spawn")[0]
                    results[(n, kind)].append(out)
                    print(f"round {r + 1} layers {n} {kind}: compile {out['compile_s']:.1f} s, first step "
                          f"{out['first_step_s']:.1f} s, step {out['step_s'] * 1e3:.0f} ms, {out['graphs']} graphs, "
                          f"{out['breaks']} breaks", flush=True)

    def med(n, kind, key):
        values = [x[key] for x in results[(n, kind)]]
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    def paired(a, b):  # b / a per round, as benchmarks/paired.py publishes them
        return PairedRatio(tuple(range(args.rounds)),
                           tuple(y["compile_s"] / x["compile_s"] for x, y in zip(results[a], results[b]))).format()

    print("\n| layers | cold compile s | warm compile s | warm / cold | cold first step s | warm first step s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.layers:
        print(f"| {n} | {med(n, 'cold', 'compile_s')} | {med(n, 'warm', 'compile_s')} | "
              f"{paired((n, 'cold'), (n, 'warm'))} | {med(n, 'cold', 'first_step_s')} | "
              f"{med(n, 'warm', 'first_step_s')} |")
    if len(args.layers) >= 2:
        lo, hi = args.layers[0], args.layers[-1]
        for kind in ("cold", "warm"):
            print(f"{hi} layers / {lo} layers, {kind} compile time: {paired((lo, kind), (hi, kind))}")

if __name__ == "__main__":
    main()
