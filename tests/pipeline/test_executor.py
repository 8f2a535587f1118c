"""The pipeline executor against one process: GPipe, 1F1B and interleaved 1F1B on a toy stack (gloo, CPU).

The pipeline runs the same kernels on the same shapes as one process, and each parameter's gradient
accumulates over the micro-batches in the schedule's backward order; against a reference that accumulates
in that same order the results are bit for bit equal.
"""

import numpy as np
import pytest

from tests.multiproc import run_distributed
from tests.pipeline import toy

CASES = [  # (pp, schedule, chunks, layers, micro-batches)
    (2, "1f1b", 1, 3, 4),         # uneven split: 1 + 2 layers
    (2, "gpipe", 1, 3, 4),
    (4, "1f1b", 1, 6, 8),
    (2, "interleaved", 2, 6, 4),
]


@pytest.mark.parametrize("pp,schedule,chunks,layers,m", CASES, ids=[f"pp{c[0]}-{c[1]}-v{c[2]}" for c in CASES])
def test_pipeline_step_equals_one_process(pp, schedule, chunks, layers, m):
    results = run_distributed(toy.run_pipeline, pp, layers, m, schedule, chunks, timeout=120)
    ref_losses, ref_grads = toy.reference(layers, m, reverse_backward=schedule == "gpipe")
    last = results[-1]  # the last part is on the last rank for any chunk count
    assert last["losses"] == ref_losses
    assert sorted(sum((r["layers"] for r in results), [])) == list(range(layers))
    seen = set()
    for r in results:
        for name, g in r["grads"].items():
            assert name not in seen, f"{name} built on two stages"
            seen.add(name)
            np.testing.assert_array_equal(g, ref_grads[name], err_msg=name)
    assert seen == set(ref_grads)
    if schedule == "1f1b":
        assert [r["max_in_flight"] for r in results] == [min(pp - s, m) for s in range(pp)]


def test_forward_only_pass_gives_the_losses():
    results = run_distributed(toy.run_pipeline, 2, 3, 4, "1f1b", 1, False, timeout=120)
    ref_losses, _ = toy.reference(3, 4)
    assert results[-1]["losses"] == ref_losses
    assert all(r["grads"] == {} for r in results)


def test_mismatched_micro_batch_count_ends_in_a_timeout_error():
    # Stage 0 runs 3 micro-batches, stage 1 only 2: stage 0 waits for a gradient that never comes.
    results = run_distributed(toy.run_pipeline, 2, 3, 3, "1f1b", 1, True, {1: 2}, 3.0, 1.5, timeout=60,
                              collective_timeout_s=1.5)
    err = results[0].get("error", "")
    assert "recv from rank 1" in err and "did not complete within the timeout of 1.5 s" in err, err
