"""End to end, on real ranks: the planner's largest stage-3 model is the largest that trains within a memory budget.

The truth tests (``test_truth.py``) compare the planner's tensor bytes with the bytes a rank holds. This one asks
the question a user asks -- which is the largest model that fits? -- of the whole chain: 4 gloo ranks train a
deep GPT under ``benchmarks/max_model_size.py``'s monitor (each rank's resident peak, summed), and the planner's
prediction, plus what a rank holds beyond its tensors (measured once on hybrid stage 0, never on stage 3), must
name the same number of layers. The budget sits halfway between the planner's figures for ``N`` and ``N + 1``
layers, so the planner passes only if its error is under half a layer's bytes (about 60 MiB summed here),
whatever the machine: a stage-3 rule 5% off in either direction fails, and one written for another stage would
miss by whole layers.
"""

import argparse

import pytest

from benchmarks import max_model_size as bench

LAYERS = 16  # the size the budget is set for: large enough that a stage-3 rule 5% off misses by over half a layer


def _args(**kw):
    defaults = dict(vary="layers", hidden=768, layers=2, seq=32, step=1, steps=3, bucket=2_000_000,
                    prefetch=2_000_000, attempt_timeout=240.0, budget=8 * 2**30, max_attempts=2, json=None, only="",
                    predict="", rank=None)
    defaults.update(kw)
    return argparse.Namespace(**defaults)


@pytest.mark.slow  # two 16-layer trainings on 4 ranks (~30 s); the planner's truth tests keep fast cases
def test_the_planner_names_the_largest_stage3_model_that_trains_within_a_budget():
    args = _args()
    stage3 = next(c for c in bench.CONTENDERS if c.name == "hybrid zero-3")
    base = bench.calibrate([stage3], args, log=lambda line: None)[stage3.name]
    at_n, at_next = (bench.predicted_sum(stage3, n, args, base) for n in (LAYERS, LAYERS + 1))
    half_step = (at_next - at_n) / 2
    args.budget = int(at_n + half_step)
    assert bench.predicted_size(stage3, args, base) == LAYERS

    fits = bench.run_attempt(stage3, LAYERS, args)
    assert fits["ok"], f"{LAYERS} layers should train within {args.budget / 2**30:.3f} GiB: {fits['why']}"
    # The planner's figure against the measured summed peak: within half a layer, and in practice far closer.
    error = fits["peak_sum"] - at_n
    assert abs(error) < half_step, (f"planner {at_n / 2**20:.0f} MiB, measured {fits['peak_sum'] / 2**20:.0f} MiB "
                                    f"at {LAYERS} layers; half a layer is {half_step / 2**20:.0f} MiB")
    over = bench.run_attempt(stage3, LAYERS + 1, args)
    assert not over["ok"] and over["why"].startswith("over budget"), over


def test_an_attempt_over_budget_fails_on_memory_with_the_peak_it_reached():
    # A budget below what one idle rank holds: the attempt must fail on memory, never pass unmeasured.
    args = _args(budget=64 * 2**20)
    stage0 = next(c for c in bench.CONTENDERS if c.name == "hybrid zero-0")
    r = bench.run_attempt(stage0, 1, args)
    assert not r["ok"] and r["why"].startswith("over budget"), r
    assert r["peak_sum"] > args.budget


@pytest.mark.parametrize("off, expected", [(0, "exact"), (1, "+1 step"), (-2, "-2 steps")])
def test_the_table_says_how_far_the_planner_missed(off, expected):
    args = _args(step=128)
    row = {"exact": True, "size": 1024, "predicted": 1024 + off * 128}
    assert bench.verdict(row, args) == expected
    assert bench.verdict({**row, "exact": False}, args) == "search capped"
