"""The pipeline bubble, measured: idle time per stage against (p - 1) / (v m + p - 1).

Two pipeline ranks (gloo, one per core of this machine) run the pipeline
executor (:mod:`hybrid.pipeline.executor`) over equal parts of a stack of
linear layers, for m = 2, 4, 8 and 16 micro-batches, with 1F1B and with the
interleaved schedule at v = 2 model chunks per rank. The idle fraction of a
stage is the time it spends blocked in receives (and waiting for the step's
end) over the step time. The formula assumes equal stages and free
transfers. The parts here do equal work by construction (the first part also
computes its input's gradient), each rank's process is pinned to a core of
its own before gloo starts its threads (``--no-pin`` leaves them to the
scheduler), and the executor posts its receives ahead, so each 512 KB
transfer moves while the receiver computes. What remains beyond the formula is
how unevenly the machine runs equal work: the two cores' speeds, which on this
virtual machine differ by a few per cent, and the spread of one action's time
to the next. In the steady state a stage waits for the other's last output, so
every late action shows as idle on the other stage. The ``replayed`` column
plays each step with its actions' measured durations
(``StepStats.action_s``): the idle those very durations imply.

Rounds interleave the schedules and the micro-batch counts; the table gives
medians over rounds (each round's figure is a median over steps), the
formula, and measured / formula. The defaults (32 layers of 1024 per rank,
micro-batches of 128 rows) give each transfer of 512 KB some 100 ms of
compute on either side; fewer layers make transfers and scheduling jitter a
larger share (``--layers-per-rank 8 --batch 64``: the smaller run).

Reproduce (from the repository root, on a quiet machine)::

    python benchmarks/pipeline_bubble.py                 # ~5 min on 2 cores
    python benchmarks/pipeline_bubble.py --json benchmarks/results/pipeline_bubble.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402  (the repository's gloo process harness)

PP = 2
MICROBATCHES = (2, 4, 8, 16)
SCHEDULES = (("1f1b", 1), ("interleaved", 2))


def _chunk(layers: int, hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)])


def _rank(args: dict) -> dict:
    """One pipeline rank: every (schedule, m) of every round; median idle fraction and step time per cell."""
    import hybrid
    from hybrid.pipeline import AutogradStage, PipelineExecutor

    if args["pin"]:  # each stage on a core of its own, as each stage has its own device on a GPU node
        os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})
    topo = hybrid.Topology(pp=PP, timeout_s=120)
    hidden, batch = args["hidden"], args["batch"]
    out = {}
    for _ in range(args["rounds"]):
        for schedule, chunks in SCHEDULES:
            # the same work per rank for every schedule: layers_per_rank split over the chunks
            parts = [_chunk(args["layers_per_rank"] // chunks, hidden, seed=c) for c in range(chunks)]
            last = PP * chunks - 1

            def forward(chunk, part, x, mb):
                h = parts[chunk](mb if part == 0 else x)
                return h.square().mean() if part == last else h

            stage = AutogradStage(forward)
            executor = PipelineExecutor(topo, list(range(chunks)), schedule,
                                        activation_shape=lambda mb: torch.Size((batch, hidden)),
                                        activation_dtype=torch.float32)
            for m in MICROBATCHES:
                # requires_grad: the first part computes its input's gradient as every other part does, so the
                # stages do equal work, as the formula assumes
                mbs = [torch.randn(batch, hidden, requires_grad=True) for _ in range(m)]
                idle, step, busy, actions = [], [], [], []
                for k in range(args["steps"] + 1):
                    topo.comm.barrier("pp")  # both stages start the step together
                    stats = executor.step(mbs, stage)
                    # ... and end it together: a stage that finishes early idles until the step's end (the
                    # formula's makespan), which its own step time would leave out
                    begin = time.perf_counter()
                    topo.comm.barrier("pp")
                    tail = time.perf_counter() - begin
                    for p in (q for c in parts for q in c.parameters()):
                        p.grad = None
                    if k:  # the first step warms up
                        idle.append((stats.wait_s + tail) / (stats.step_s + tail))
                        step.append(stats.step_s + tail)
                        busy.append(stats.step_s - stats.wait_s)
                        actions.append(stats.action_s)
                cell = out.setdefault(f"{schedule}/m{m}", {"idle": [], "step_s": [], "busy_s": [], "action_s": []})
                for name, values in (("idle", idle), ("step_s", step), ("busy_s", busy)):
                    cell[name].append(statistics.median(values))
                cell["action_s"].append(actions)  # per round, per step: this rank's action durations
    topo.close()
    return out


def _replay(lists, chunks: int, action_s) -> tuple:
    """The worst stage's idle fraction when every step is played with its actions' measured durations (median
    over steps, then rounds), and the median coefficient of variation of a stage's forward times in a step.

    ``action_s[rank][round][step]``: that step's durations on ``rank``, in schedule order."""
    from hybrid.pipeline import simulate

    idle, spread = [], []
    for rnd in range(len(action_s[0])):
        per_step = []
        for k in range(len(action_s[0][rnd])):
            durations = [action_s[r][rnd][k] for r in range(len(lists))]
            per_step.append(max(simulate(lists, chunks, durations=durations).idle_fraction))
            for r, acts in enumerate(lists):
                forwards = [d for a, d in zip(acts, durations[r]) if a.kind == "F"]
                spread.append(statistics.pstdev(forwards) / statistics.mean(forwards))
        idle.append(statistics.median(per_step))
    return statistics.median(idle), statistics.median(spread)


def main(argv=None) -> None:
    from hybrid.pipeline import bubble_fraction, schedule, simulate

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per cell and round")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=128, help="rows per micro-batch")
    ap.add_argument("--layers-per-rank", type=int, default=32)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the ranks' processes unpinned (by default each is pinned to its own core)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("rounds", "steps", "hidden", "batch", "layers_per_rank", "pin")}
    per_rank = run_distributed(_rank, PP, cfg, timeout=1800, env={"OMP_NUM_THREADS": "1"}, start="spawn")
    rows = []
    pinned = ", pinned to a core each" if args.pin else ""
    print(f"pipeline bubble: pp={PP} (gloo, one thread per rank{pinned}), {args.layers_per_rank} linear layers of "
          f"{args.hidden} per rank, micro-batch {args.batch} rows; medians of {args.rounds} interleaved rounds")
    # busy 1/0: stage 1's compute time over stage 0's. The formula assumes 1; in the steady state the faster
    # stage waits for the slower one at every micro-batch, so a few per cent apart show as idle beyond it.
    # "at busy": the schedule played on paper with the stages' measured speeds (hybrid.pipeline.simulate).
    # "replayed": played with every action's own measured duration (StepStats.action_s), step by step: the idle
    # those very durations imply, their spread from action to action included, with transfers free. Measured
    # over replayed is what the executor and the transfers add; replayed over formula is what the machine adds.
    # rounds: the min-max over rounds of each round's worst stage over the formula (the spread of the ratio)
    # spread: the median over steps of the coefficient of variation of a stage's forward times
    print(f"{'schedule':<16} {'m':>3} {'formula':>8} {'stage 0':>8} {'stage 1':>8} {'worst/formula':>14} "
          f"{'rounds':>10} {'step ms':>8} {'busy 1/0':>9} {'at busy':>8} {'replayed':>9} {'worst/replayed':>15} "
          f"{'spread':>7}")
    for name, chunks in SCHEDULES:
        for m in MICROBATCHES:
            key = f"{name}/m{m}"
            formula = bubble_fraction(PP, m, chunks)
            idle = [statistics.median(r[key]["idle"]) for r in per_rank]
            step_ms = 1e3 * statistics.median(per_rank[0][key]["step_s"])
            busy = [statistics.median(r[key]["busy_s"]) for r in per_rank]
            lists = [schedule.build(name, r, PP, m, chunks) for r in range(PP)]
            at_busy = max(simulate(lists, chunks, stage_speed=[b / busy[0] for b in busy]).idle_fraction)
            replayed, spread = _replay(lists, chunks, [r[key]["action_s"] for r in per_rank])
            ratio = max(idle) / formula
            per_round = [max(r[key]["idle"][k] for r in per_rank) / formula for k in range(args.rounds)]
            rows.append({"schedule": name, "chunks": chunks, "microbatches": m, "formula": formula,
                         "idle_per_stage": idle, "worst_over_formula": ratio, "step_ms": step_ms,
                         "busy_ms_per_stage": [1e3 * b for b in busy], "idle_at_measured_busy": at_busy,
                         "idle_replayed": replayed, "worst_over_replayed": max(idle) / replayed,
                         "forward_time_spread": spread, "worst_over_formula_per_round": per_round})
            rounds = f"{min(per_round):.2f}-{max(per_round):.2f}"
            print(f"{name + (f' v={chunks}' if chunks > 1 else ''):<16} {m:>3} {formula:>8.3f} {idle[0]:>8.3f} "
                  f"{idle[1]:>8.3f} {ratio:>14.2f} {rounds:>10} {step_ms:>8.1f} {busy[1] / busy[0]:>9.3f} "
                  f"{at_busy:>8.3f} {replayed:>9.3f} {max(idle) / replayed:>15.2f} {spread:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"pp": PP, **cfg}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
