"""The pipeline executor against one process: GPipe, 1F1B and interleaved 1F1B on a toy stack (gloo, CPU).

The pipeline runs the same kernels on the same shapes as one process, and each parameter's gradient
accumulates over the micro-batches in the schedule's backward order; against a reference that accumulates
in that same order the results are bit for bit equal.
"""

import numpy as np
import pytest

from tests.multiproc import run_distributed
from tests.pipeline import toy

CASES = {  # world 4: pp stages, each replicated over dp = 4 / pp ranks
    "pp2-1f1b-uneven": dict(pp=2, schedule="1f1b", chunks=1, num_layers=3, count=4),  # 1 + 2 layers
    "pp2-gpipe": dict(pp=2, schedule="gpipe", chunks=1, num_layers=3, count=4),
    "pp4-1f1b": dict(pp=4, schedule="1f1b", chunks=1, num_layers=6, count=8),
    "pp2-interleaved-v2": dict(pp=2, schedule="interleaved", chunks=2, num_layers=6, count=4),
    "pp2-forward-only": dict(pp=2, schedule="1f1b", chunks=1, num_layers=3, count=4, train=False),
}


@pytest.fixture(scope="module")
def results():
    per_rank = run_distributed(toy.run_cases, 4, list(CASES.values()), timeout=180)
    return {name: [rank[i] for rank in per_rank if rank[i]["dp_rank"] == 0] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].get("train", True)])
def test_pipeline_step_equals_one_process(results, name):
    case = CASES[name]
    pp, m = case["pp"], case["count"]
    ranks = sorted(results[name], key=lambda r: r["pp_rank"])
    ref_losses, ref_grads = toy.reference(case["num_layers"], m, reverse_backward=case["schedule"] == "gpipe")
    assert ranks[-1]["losses"] == ref_losses  # the last part is on the last rank for any chunk count
    assert sorted(sum((r["layers"] for r in ranks), [])) == list(range(case["num_layers"]))
    seen = set()
    for r in ranks:
        for pname, g in r["grads"].items():
            assert pname not in seen, f"{pname} built on two stages"
            seen.add(pname)
            np.testing.assert_array_equal(g, ref_grads[pname], err_msg=pname)
    assert seen == set(ref_grads)
    if case["schedule"] == "1f1b":
        assert [r["max_in_flight"] for r in ranks] == [min(pp - s, m) for s in range(pp)]
    for r in ranks:  # one duration per action, and with the waits they fit inside the step
        assert len(r["action_s"]) == 2 * m * case["chunks"]
        assert min(r["action_s"]) > 0
        assert sum(r["action_s"]) + r["wait_s"] <= r["step_s"]


def test_forward_only_pass_gives_the_losses(results):
    ranks = sorted(results["pp2-forward-only"], key=lambda r: r["pp_rank"])
    ref_losses, _ = toy.reference(3, 4)
    assert ranks[-1]["losses"] == ref_losses
    assert all(r["grads"] == {} for r in ranks)


def test_mismatched_micro_batch_count_ends_in_a_timeout_error():
    # Stage 0 runs 3 micro-batches, stage 1 only 2: stage 0 waits for a gradient that never comes.
    results = run_distributed(toy.run_pipeline, 2, 3, 3, "1f1b", 1, True, {1: 2}, 3.0, 1.5, timeout=60,
                              collective_timeout_s=1.5)
    err = results[0].get("error", "")
    assert "recv from rank 1" in err and "did not complete (timeout 1.5 s)" in err, err
