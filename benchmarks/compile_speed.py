"""Tokens/s and peak RSS of compiled blocks (model_zoo.compile) over eager, on CPU at world 4 (TP2 x DP2, ZeRO-1).

Two models: the demo's ``tiny`` GPT (4 layers, hidden 128, sequence 128) and a GPT-2-small-sized one (12 layers,
hidden 768, vocabulary 50257) at a short sequence. Each contender of a round is a fresh job of 4 spawned
processes: build, compile (compiled only; from a warm inductor cache, filled before the first round, so the
rounds time steady-state steps, not compiling), ``--warmup`` steps untimed, then ``--steps`` timed steps. Tokens/s
counts the global batch's tokens over the median step time of rank 0; CPU ms/step is each rank's median process
CPU time per timed step summed over the ranks (the work, nearly independent of how a loaded machine shares its
cores); peak RSS is the largest rank's
``ru_maxrss``. Rounds interleave eager and compiled, so the machine's drifting load hits both alike; the
published figure is the median of the per-round compiled/eager ratios with their min-max
(benchmarks/paired.py).

    python benchmarks/compile_speed.py [--rounds 3] [--models tiny gpt2-small] [--tensorboard-dir runs/compile_speed]

Every timed step of rank 0 also goes to TensorBoard, eager and compiled side by side: one run folder per contender
(``<dir>/<model>/eager``, ``<dir>/<model>/compiled``) under the trainer's own tags, ``train/iteration_time_s`` and
``train/tokens_per_sec`` (hybrid.monitor.scalars), x-axis the timed step counted over the rounds;
``tensorboard --logdir <dir>`` overlays the two.

Target (issue 51): compiled at least 0.95x eager tokens/s on the demo model on CPU (no regression); the larger
model is reported as it comes out.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.paired import PairedRatio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402

WORLD, TP = 4, 2
MODELS = {  # name: (preset, layers, sequence, micro-batch)
    "tiny": ("tiny", 4, 128, 4),
    "gpt2-small": ("gpt2-small", 12, 64, 2),
}


def job(model_name: str, compiled: bool, cache_dir: Optional[str], warmup: int, steps: int, tp: int = TP,
        layers: Optional[int] = None, sequence_parallel: bool = False) -> dict:
    """One rank of a ``tp`` x (4 / tp) ZeRO-1 job: build ``model_name`` (``layers`` overrides its depth), compile
    its blocks when ``compiled``, train ``warmup`` + ``steps`` steps. Returns the median of the timed steps, the
    first step, the compile figures (:class:`model_zoo.compile.CompileReport`) and this rank's peak RSS."""
    import resource

    import torch

    import hybrid
    from hybrid.config.parse import config_from_dict
    from model_zoo import GPTModel, get_preset
    from model_zoo.compile import compile_blocks

    preset, depth, seq, micro = MODELS[model_name]
    topo = hybrid.Topology(tp=tp, timeout_s=1200)
    cfg = get_preset(preset).replace(num_layers=layers or depth, seq_length=seq, hidden_dropout=0.0,
                                     attention_dropout=0.0, sequence_parallel=sequence_parallel)
    model = GPTModel(cfg, topo, seed=1)
    engine = hybrid.initialize(model, config_from_dict({
        "optimizer": {"type": "adamw", "lr": 1e-4}, "zero": {"stage": 1}, "steps_per_print": 0,
        "micro_batch_size": micro, "global_batch_size": micro * topo.dp_size}), topology=topo)
    report = compile_blocks(model, cache_dir=cache_dir) if compiled else None
    g = torch.Generator().manual_seed(topo.dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (micro, seq), generator=g)
    times, cpu = [], []
    for _ in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.train_batch([{"input_ids": ids, "labels": ids}])
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    engine.close()
    topo.close()
    return {"step_s": statistics.median(times[warmup:]), "first_step_s": times[0], "step_times_s": times[warmup:],
            "cpu_step_s": statistics.median(cpu[warmup:]),
            "tokens": micro * seq * topo.dp_size, **(report.figures() if report else {}),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(model_name: str, compiled: bool, cache_dir: str, warmup: int, steps: int) -> dict:
    ranks = run_distributed(job, WORLD, model_name, compiled, cache_dir, warmup, steps, timeout=2400,
                            start="spawn", env={"OMP_NUM_THREADS": "1"})
    return {"tokens_per_s": ranks[0]["tokens"] / ranks[0]["step_s"], "tokens": ranks[0]["tokens"],
            "cpu_ms_per_step": 1e3 * sum(r["cpu_step_s"] for r in ranks),
            "step_times_s": ranks[0]["step_times_s"], "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}


def write_tensorboard(log_dir: str, results: dict) -> None:
    """Each contender's timed steps, ``results[(model, compiled)]`` a list over rounds of :func:`run`'s figures, as
    TensorBoard scalars in ``log_dir/<model>/<eager|compiled>``: ``train/iteration_time_s`` and
    ``train/tokens_per_sec`` at step 1, 2, ... counted over the rounds in order."""
    from hybrid.monitor.tensorboard_writer import TensorBoardSink

    for (name, compiled), rounds in results.items():
        sink = TensorBoardSink(os.path.join(log_dir, name, "compiled" if compiled else "eager"))
        step = 0
        for out in rounds:
            for seconds in out["step_times_s"]:
                step += 1
                sink.add_scalars(step, {"train/iteration_time_s": seconds,
                                        "train/tokens_per_sec": out["tokens"] / seconds})
        sink.close()


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tensorboard-dir", default=os.path.join("runs", "compile_speed"),
                        help="event files of every timed step, eager and compiled")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
        for name in args.models:  # fill the cache: the rounds time steps, not compiles
            run(name, True, cache, 1, 1)
        results = {(name, c): [] for name in args.models for c in (False, True)}
        for r in range(args.rounds):
            for name in args.models:
                for compiled in ((False, True) if r % 2 == 0 else (True, False)):
                    out = run(name, compiled, cache, args.warmup, args.steps)
                    results[(name, compiled)].append(out)
                    print(f"round {r + 1} {name} {'compiled' if compiled else 'eager'}: "
                          f"{out['tokens_per_s']:.0f} tokens/s, peak RSS {out['peak_rss_mib']:.0f} MiB", flush=True)
    write_tensorboard(args.tensorboard_dir, results)
    print(f"step times, eager and compiled: tensorboard --logdir {args.tensorboard_dir}")

    def paired(name, key):
        eager, comp = results[(name, False)], results[(name, True)]
        return PairedRatio(tuple(range(args.rounds)), tuple(c[key] / e[key] for e, c in zip(eager, comp))).format()

    def med(name, compiled, key):
        values = [x[key] for x in results[(name, compiled)]]
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    print("\n| model | eager tokens/s | compiled tokens/s | compiled / eager | eager CPU ms/step | "
          "compiled CPU ms/step | CPU compiled / eager | eager peak RSS MiB | compiled peak RSS MiB | "
          "RSS compiled / eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        print(f"| {name} | {med(name, False, 'tokens_per_s')} | {med(name, True, 'tokens_per_s')} | "
              f"{paired(name, 'tokens_per_s')} | {med(name, False, 'cpu_ms_per_step')} | "
              f"{med(name, True, 'cpu_ms_per_step')} | {paired(name, 'cpu_ms_per_step')} | "
              f"{med(name, False, 'peak_rss_mib')} | {med(name, True, 'peak_rss_mib')} | "
              f"{paired(name, 'peak_rss_mib')} |")
    print("CPU ms/step: the timed steps' median process CPU time (every thread, gloo's included), summed over the "
          "4 ranks: the work a step does, steadier than wall time on shared cores.")


if __name__ == "__main__":
    main()
