"""The planner tells the truth about pipelines: its per-stage predictions against real gloo runs (world 4).

Three pipelines train one step through ``Engine.train_batch`` (one spawn, see
``harness.measure_pipeline_configs``): four stages of 1F1B over 8 micro-batches,
two stages with TP 2 and sequence parallelism over an uneven split (3 layers),
and the interleaved schedule with two virtual stages per rank at DP 2. For every
rank, against :func:`hybrid.plan.estimate.estimate_stages` for its pipeline rank:

* the activations in flight: the executor's count of micro-batch chunks forwarded
  and not yet backwarded is exactly the planner's replay of the schedule (the first
  1F1B stage holds ``pp`` micro-batches, not all 8), and the most saved-activation
  bytes held at once are exactly the planner's;
* each ``memory_report()`` component and the tensors held between steps within 5%,
  the step's peak of live tensor bytes within 15% (as for one process,
  ``test_truth.py``);
* ``comm_report()`` has exactly the predicted collectives and transfers, calls and
  payload bytes: the point-to-point sends and receives, the tied embeddings'
  gradient sum over ``embed`` and the loss broadcast included.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from hybrid.layout import ParallelLayout
from hybrid.plan import CPU, Candidate, TrainingSetup, activation_bytes, step_volume, zero_layout
from hybrid.plan.estimate import estimate_stages
from hybrid.plan.pipeline_stages import stage_share
from tests.multiproc import run_distributed
from tests.plan.harness import gpt_config, measure_pipeline_configs
from tests.plan.test_truth import COMPONENTS, WORLD, _close

SMALL = dict(hidden=64, seq=32, vocab=500)
SPECS: List[Dict] = [
    dict(pp=4, tp=1, stage=1, precision="fp32", micro=1, gas=8, layers=6, recompute="none", **SMALL),
    dict(pp=2, tp=2, sp=True, stage=2, precision="bf16", micro=2, gas=8, layers=3, recompute="none", bucket=10_000,
         **SMALL),
    dict(pp=2, tp=1, stage=0, precision="fp32", micro=1, gas=4, layers=4, recompute="none", schedule="interleaved",
         per_virtual=1, **SMALL),
]


def _candidate(spec: Dict) -> Candidate:
    chunks = spec["layers"] // (spec["pp"] * spec["per_virtual"]) if spec.get("per_virtual") else 1
    parallel = ParallelLayout(tp=spec["tp"], dp=WORLD // (spec["tp"] * spec["pp"]), pp=spec["pp"],
                              zero_stage=spec["stage"], precision=spec["precision"])
    return Candidate(parallel, recompute=spec["recompute"], micro_batch=spec["micro"],
                     sequence_parallel=spec.get("sp", False), pipeline_schedule=spec.get("schedule", "1f1b"),
                     virtual_stages=chunks)


def _check(spec: Dict, r: Dict) -> List[str]:
    where = f"config {spec} rank pp{r['pp_rank']}/tp{r['tp_rank']}/dp{r['dp_rank']}"
    cfg, candidate = gpt_config(spec), _candidate(spec)
    setup = TrainingSetup(bucket_size=spec.get("bucket", 10**8), compiled_adam=r["compiled_adam"], profile=CPU)
    memory = estimate_stages(cfg, candidate, setup, spec["gas"])[r["pp_rank"]]
    act = activation_bytes(cfg, spec["micro"], tp=spec["tp"], sequence_parallel=spec.get("sp", False),
                           recompute=spec["recompute"], precision=spec["precision"], profile=CPU)
    share = stage_share(cfg, candidate, act, spec["gas"], r["pp_rank"])
    problems = []
    if r["in_flight"] != share.in_flight or memory.in_flight != share.in_flight:
        problems.append(f"{where}: {r['in_flight']} micro-batch chunks in flight, predicted {share.in_flight}")
    if r["held"] != share.saved:
        problems.append(f"{where}: {r['held']} saved-activation bytes held at once, predicted {share.saved}")
    state = dataclasses.asdict(memory.state)
    for reported, predicted in COMPONENTS:
        names = reported if isinstance(reported, tuple) else (reported,)
        got, want = sum(r["report"].get(name, 0) for name in names), state[predicted]
        if not _close(got, want, 0.05):
            problems.append(f"{where}: memory_report {reported} = {got}, predicted {want}")
    if not _close(r["state"], memory.persistent, 0.05):
        problems.append(f"{where}: tensors held between steps {r['state']}, predicted {memory.persistent}")
    print(f"{where}: held {r['held']} (predicted {share.saved}, {share.in_flight} in flight); peak measured "
          f"{r['peak']} predicted {memory.peak} ({r['peak'] / memory.peak - 1:+.1%})")
    if not _close(r["peak"], memory.peak, 0.15):
        problems.append(f"{where}: peak {r['peak']}, predicted {memory.peak}")
    comm = step_volume(cfg, zero_layout(cfg, candidate, setup, r["pp_rank"]), candidate, micro_batches=spec["gas"],
                       pp_rank=r["pp_rank"])
    if set(r["comm"]) != set(comm):
        problems.append(f"{where}: collectives {sorted(r['comm'])}, predicted {sorted(comm)}")
    for key in set(r["comm"]) & set(comm):
        got, want = r["comm"][key], comm[key]
        if (got["calls"], got["payload_bytes"]) != (want["calls"], want["payload_bytes"]):
            problems.append(f"{where}: {key} {got['calls']} calls / {got['payload_bytes']} bytes, predicted "
                            f"{want['calls']} / {want['payload_bytes']}")
    return problems


def test_pipeline_predictions_match_real_runs():
    results = run_distributed(measure_pipeline_configs, WORLD, SPECS, timeout=300)
    problems = [p for i, spec in enumerate(SPECS) for rank in results for p in _check(spec, rank[i])]
    assert not problems, "the planner disagrees with the real pipelines:\n" + "\n".join(problems)
    first = [rank[0] for rank in results if rank[0]["pp_rank"] == 0][0]
    assert first["in_flight"] == 4  # the first of 4 stages holds 4 of the 8 micro-batches under 1F1B
