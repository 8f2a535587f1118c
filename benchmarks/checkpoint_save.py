"""How long training waits for a checkpoint: synchronous save vs background save (``checkpoint.async_save``).

    python benchmarks/checkpoint_save.py [--params 250e6] [--world 4] [--rounds 3]

Every rank (gloo, CPU) builds an engine (ZeRO stage 1, fp32, AdamW) over a
stack of linear layers of about ``--params`` parameters (what a save costs
depends on the bytes, not on the architecture), trains one step, then runs
``--rounds`` interleaved rounds, alternating which mode goes first:

* sync: ``save_checkpoint`` with ``async_save`` off; the time it blocks;
* async: the time training blocks, which is the time ``save_checkpoint``
  takes (RNG, counters, the directory; the weights and the optimizer
  partition are handed to the writer live) plus the time the first step's
  optimizer update waits at the write fence for the writer's host copy of
  them (``SaveReport.blocking_s``, both parts also reported apart); then
  ``--steps`` training steps while the writer runs (their times, fence
  included, are reported, not gated: the writer shares the machine's cores),
  then the wait for the commit; the writer's own time (``write_s``).

Reported: medians over rounds of rank 0's figures, the blocking time of the
background save as a fraction of the synchronous save's (the issue's goal:
at most 0.15), and step times with and without a save in flight. The first
background save allocates the host buffers the later ones reuse (page faults
make it several times slower), so it is reported apart, and the fraction is
that of the later saves. Results go
to ``benchmarks/results/checkpoint_save.json``. On a shared 2-core machine
the absolute times are noisy; the ratio of interleaved medians is the figure.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402

WIDTH = 2048  # hidden width of the linear stack: layers of WIDTH x WIDTH (+ bias)


def _engine(layers: int):
    import torch

    import hybrid
    from hybrid.topology import Topology

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    config = {"zero": {"stage": 1}, "optimizer": {"type": "adamw", "lr": 1e-4}, "micro_batch_size": 2,
              "gradient_accumulation_steps": 1}
    return hybrid.initialize(model, config, topology=Topology(tp=1))


def _step(engine) -> float:
    import torch

    start = time.perf_counter()
    x = torch.randn(2, WIDTH)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return time.perf_counter() - start


def _bench(layers: int, rounds: int, steps: int, root: str) -> dict:
    # One engine (host memory for one model): the mode is its checkpoint.async_save, switched between saves.
    engine = _engine(layers)
    _step(engine)
    out = {"state_dict_s": [], "state_dict_lazy_s": [], "sync_s": [], "async_blocking_s": [], "async_call_s": [],
           "async_fence_s": [], "async_prepare_s": [], "async_copy_s": [], "async_write_s": [], "steps_idle_s": [],
           "steps_during_save_s": [], "checkpoint_bytes": None, "snapshot_bytes": None}
    for r in range(rounds):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for mode in order:
            save_dir = os.path.join(root, f"{mode}-{r}")
            engine.config.checkpoint.async_save = mode == "async"
            if mode == "async":  # what each mode spends collecting the state (engine.state_dict), alone
                for key, lazy in (("state_dict_s", False), ("state_dict_lazy_s", True)):
                    start = time.perf_counter()
                    engine.state_dict(lazy=lazy)
                    out[key].append(time.perf_counter() - start)
            if mode == "sync":
                out["steps_idle_s"] += [_step(engine) for _ in range(steps)]
                start = time.perf_counter()
                engine.save_checkpoint(save_dir, r)
                out["sync_s"].append(time.perf_counter() - start)
            else:
                start = time.perf_counter()
                engine.save_checkpoint(save_dir, r)
                out["async_call_s"].append(time.perf_counter() - start)
                for _ in range(steps):
                    out["steps_during_save_s"].append(_step(engine))
                report = engine.wait_checkpoint()
                out["async_blocking_s"].append(report.blocking_s)  # the whole call and the fence's wait
                out["async_fence_s"].append(report.fence_s)
                out["async_write_s"].append(report.write_s)
                out["async_prepare_s"].append(report.prepare_s)
                out["async_copy_s"].append(report.copy_s)
                out["checkpoint_bytes"], out["snapshot_bytes"] = report.nbytes, report.snapshot_bytes
            if int(os.environ["RANK"]) == 0:
                shutil.rmtree(save_dir, ignore_errors=True)
            engine.topology.comm.barrier()
    return out


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=250e6, help="model parameters (default 250e6)")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps timed during each background save")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/checkpoint_save.json"))
    opts = parser.parse_args()
    layers = max(1, round(opts.params / (WIDTH * WIDTH + WIDTH)))
    params = layers * (WIDTH * WIDTH + WIDTH)
    root = tempfile.mkdtemp(dir=opts.dir)
    load_before = round(os.getloadavg()[0], 1)
    try:
        results = run_distributed(_bench, opts.world, layers, opts.rounds, opts.steps, root, timeout=3600, start="spawn")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    r0 = results[0]
    med = {k: statistics.median(v) for k, v in r0.items() if isinstance(v, list) and v}
    first_async = r0["async_blocking_s"][0]
    if len(r0["async_blocking_s"]) > 1:  # the steady state: buffers allocated by the first save
        med["async_blocking_s"] = statistics.median(r0["async_blocking_s"][1:])
    summary = {
        "params": params, "world": opts.world, "zero_stage": 1, "rounds": opts.rounds, "cpu_count": os.cpu_count(),
        "checkpoint_bytes": r0["checkpoint_bytes"], "rank0_snapshot_bytes": r0["snapshot_bytes"],
        "sync_save_s_median": med["sync_s"], "async_blocking_s_first": first_async,
        "async_blocking_s_median_after_first": med["async_blocking_s"],
        "async_call_s_median": med["async_call_s"], "async_fence_s_median": med["async_fence_s"],
        "async_copy_s_median": med["async_copy_s"],
        "async_write_s_median": med["async_write_s"], "state_dict_s_median": med["state_dict_s"],
        "state_dict_lazy_s_median": med["state_dict_lazy_s"],
        "blocking_fraction": med["async_blocking_s"] / med["sync_s"],
        "step_s_median_idle": med["steps_idle_s"], "step_s_median_during_save": med["steps_during_save_s"],
        "load_average_before": load_before, "rank0": r0,
    }
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"load average before: {load_before}, after: {os.getloadavg()[0]:.1f} (other jobs share the cores)")
    print(f"{params / 1e6:.0f}M parameters, world {opts.world} (gloo, CPU), ZeRO 1; checkpoint "
          f"{r0['checkpoint_bytes'] / 2**30:.2f} GiB; medians of {opts.rounds} interleaved rounds, rank 0:")
    print(f"  synchronous save blocks            {med['sync_s']:8.2f} s")
    print(f"  background save blocks             {med['async_blocking_s']:8.2f} s  "
          f"({summary['blocking_fraction']:.1%} of synchronous; goal <= 15%)")
    print(f"  first background save blocks       {first_async:8.2f} s  (allocates the host buffers)")
    print(f"  of which the save_checkpoint call  {med['async_call_s']:8.2f} s")
    print(f"    engine.state_dict(lazy=True)     {med['state_dict_lazy_s']:8.2f} s  (synchronous save's: "
          f"{med['state_dict_s']:.2f} s)")
    print(f"    preparing the directory          {med['async_prepare_s']:8.2f} s  (a gather: waits for every rank)")
    print(f"  of which the update's fence wait   {med['async_fence_s']:8.2f} s")
    print(f"  writer's copy to host buffers      {med['async_copy_s']:8.2f} s  (on its thread, during the step)")
    print(f"  background writer (to durable)     {med['async_write_s']:8.2f} s")
    print(f"  step time, no save in flight       {med['steps_idle_s']:8.3f} s")
    print(f"  step time, background save writing {med['steps_during_save_s']:8.3f} s")
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
