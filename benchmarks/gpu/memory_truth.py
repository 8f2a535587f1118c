"""Part 4 of the GPU verification run: the memory planner's predictions against what CUDA allocates.

What runs: part 3's four ZeRO runs (gpt2-medium, bf16, sequence 1024, micro batch 2; stages 1, 2, 3, and
2 with CPU offload), each for one warm-up step and one measured step.

What it compares, side by side, per run:
  * each component the optimizer reports (``engine.memory_report()``: weights, gradients, staging
    buckets, fp32 master, optimizer state; offloaded ones counted in host memory) against the planner's
    ``hybrid.plan.estimate_memory`` for the same layout -- within 5%, as tests/plan/test_truth.py asks;
  * bytes held between steps: ``torch.cuda.memory_allocated()`` at the start of the measured step
    (minus what was allocated before the model existed) against the planner's persistent bytes;
  * the step's peak: ``torch.cuda.max_memory_allocated()`` over the measured step (same baseline)
    against the planner's peak without its fragmentation allowance -- target within 10%.
Dry run (CPU, tiny GPT, gloo): the CUDA counters are n/a on CPU; the same comparison uses the live
tensor bytes the planner's truth tests measure on CPU (``hybrid.plan.measure.LiveTensorTracker``) with
the planner's CPU profile.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.gpu import engine_setup as es  # noqa: E402
from benchmarks.gpu.results import PartResult, run_part  # noqa: E402

PEAK_TARGET = 0.10  # the target for the predicted peak
COMPONENT_TOL = 0.05  # tests/plan/test_truth.py's tolerance for each component
# memory_report() key -> the planner's StateBytes fields (device + host share) it is compared with
COMPONENTS = {"params": ("weights",), "grads": ("grads",), "grad_buckets": ("grad_buckets",),
              "master": ("master", "host_master"), "optimizer_states": ("optimizer_states", "host_optimizer_states"),
              "offload_staging": ("host_grads",)}


class CudaCounter:
    """The caching allocator's counters: bytes allocated now, and the most since the last reset."""

    name = "torch.cuda.memory_allocated / max_memory_allocated"

    def __init__(self):
        torch.cuda.synchronize()
        self.baseline = torch.cuda.memory_allocated()

    def measure(self, step) -> Dict[str, int]:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - self.baseline
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return {"held": held, "peak": torch.cuda.max_memory_allocated() - self.baseline}


class LiveTensorCounter:
    """The CPU instrument of the planner's truth tests: live tensor storages (CUDA counters are n/a on CPU)."""

    name = "live tensor bytes (hybrid.plan.measure; CUDA counters n/a on CPU)"

    def __init__(self):
        from hybrid.plan.measure import live_tensor_bytes

        self.baseline = live_tensor_bytes()

    def measure(self, step) -> Dict[str, int]:
        from hybrid.plan.measure import LiveTensorTracker

        with LiveTensorTracker() as tracker:
            held = tracker.start_bytes - self.baseline
            step()
        return {"held": held, "peak": tracker.peak_bytes - self.baseline}


def predict(cfg, run: Dict, micro: int, compiled_adam: bool, dry_run: bool):
    from hybrid.plan import CPU, CUDA, Candidate, ParallelLayout, TrainingSetup, estimate_memory

    candidate = Candidate(ParallelLayout(tp=1, dp=1, zero_stage=run["stage"], precision="bf16"),
                          offload=run.get("offload", "none"), recompute="none", micro_batch=micro)
    return estimate_memory(cfg, candidate, TrainingSetup(compiled_adam=compiled_adam, profile=CPU if dry_run else CUDA))


def _close(measured: float, predicted: float, tol: float) -> bool:
    return measured == predicted if predicted == 0 else abs(measured - predicted) <= tol * predicted


def measure_run(res: PartResult, factory: es.ModelFactory, name: str, run: Dict, micro: int) -> str:
    cfg, device = factory.cfg, factory.device
    counter = LiveTensorCounter() if res.dry_run else CudaCounter()
    engine = es.build_engine(factory, run, micro)

    batches = [es.batch(k, micro, cfg, device) for k in range(2)]  # made outside the measured step

    def step(k: int = 1) -> None:
        x, y = batches[k]
        loss = engine(x, y)
        engine.backward(loss)
        del loss
        engine.step()

    step(0)  # the warm-up step allocates the lazily built buffers
    measured = counter.measure(step)
    report = engine.memory_report()
    memory = predict(cfg, run, micro, bool(getattr(engine.optimizer.inner, "compiled", False)), res.dry_run)
    es.close_engine(engine)
    state = dataclasses.asdict(memory.state)
    row = dict(run=name, instrument=counter.name, components={}, held=measured["held"],
               predicted_held=memory.persistent, peak=measured["peak"], predicted_peak=memory.peak)
    print(f"\n{name}: {'component':<18}{'reported':>16}{'predicted':>16}{'diff':>8}")
    for key, fields in COMPONENTS.items():
        got, want = report.get(key, 0), sum(state[f] for f in fields)
        row["components"][key] = dict(reported=got, predicted=want)
        res.check(f"{name}: {key} within {COMPONENT_TOL:.0%} of the planner", _close(got, want, COMPONENT_TOL),
                  f"reported {got}, predicted {want}")
        print(f"{'':<{len(name) + 2}}{key:<18}{got:>16,}{want:>16,}{_rel(got, want):>8}")
    for label, got, want in (("held between steps", measured["held"], memory.persistent),
                             ("step peak", measured["peak"], memory.peak)):
        print(f"{'':<{len(name) + 2}}{label:<18}{got:>16,}{want:>16,}{_rel(got, want):>8}")
    res.check(f"{name}: peak within {PEAK_TARGET:.0%} of the planner", _close(measured["peak"], memory.peak,
                                                                              PEAK_TARGET),
              f"measured {measured['peak']}, predicted {memory.peak}")
    res.rows.append(row)
    return f"{name} peak {_rel(measured['peak'], memory.peak)}"


def _rel(got: float, want: float) -> str:
    return "n/a" if want == 0 else f"{got / want - 1:+.1%}"


def body(res: PartResult) -> None:
    dry = res.dry_run
    topo, _ = es.world_one(dry)
    device = topo.device  # the GPU under NCCL, the CPU in the dry run
    cfg = es.model_config(dry, "gpt2-medium")
    micro = 2
    res.info.update(model="tiny (dry run)" if dry else "gpt2-medium", micro_batch=micro, seq_length=cfg.seq_length,
                    instrument=(LiveTensorCounter if dry else CudaCounter).name)
    factory = es.ModelFactory(cfg, topo, device)  # before every baseline: its weights are in none of the steps
    heads, last_s = [], 0.0
    for name, run in es.ZERO_RUNS.items():
        if not res.fits(name, 1.5 * last_s, required=True):  # each run is a check the part exists for
            continue
        head, last_s = es.timed(lambda: measure_run(res, factory, name, run, micro), device)
        heads.append(head)
    res.headline = ("measured vs predicted (" + ("live tensors: CUDA counters n/a on CPU" if dry else
                                                  "max_memory_allocated") + "): " + ", ".join(heads))


if __name__ == "__main__":
    sys.exit(run_part(4, "memory", body, __doc__))
