"""benchmarks/moe_compressed_dispatch.py --summarize: the per-seed validation table and the mean's t-interval."""

import json
import math
import statistics

import pytest

from benchmarks.moe_compressed_dispatch import _t_quantile, mean_interval, summarize


def test_the_t_quantile_tends_to_the_normal_one_and_exceeds_it_for_few_samples():
    normal = statistics.NormalDist().inv_cdf(0.975)
    assert _t_quantile(0.975, 2000) == pytest.approx(normal, abs=2e-3)
    # df = 1 is the Cauchy distribution, whose quantile is tan(pi (p - 1/2)) exactly
    assert _t_quantile(0.75, 1) == pytest.approx(math.tan(math.pi * 0.25), rel=1e-4)
    assert _t_quantile(0.975, 3) > _t_quantile(0.975, 7) > _t_quantile(0.975, 30) > normal


def test_mean_interval_is_centred_and_widens_with_the_spread():
    narrow, wide = mean_interval([1.0, 2.0, 3.0]), mean_interval([0.0, 2.0, 4.0])
    assert narrow["mean"] == wide["mean"] == 2.0
    assert narrow["high"] - 2.0 == pytest.approx(2.0 - narrow["low"])
    assert (wide["high"] - wide["low"]) == pytest.approx(2 * (narrow["high"] - narrow["low"]))


def test_summarize_pairs_each_seed_with_its_own_fp32_run(tmp_path):
    def run(seed, **finals):
        return {"args": {"seeds": str(seed)}, "results": {"loss": {str(seed): {
            name: {"final_valid": v} for name, v in finals.items()}}}}

    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": {"a": run(1, fp32=5.0, int8=5.05), "b": run(2, fp32=4.0, int8=3.96),
                                         "c": run(2, **{"fp32-tp1": 4.04})}}))
    text = summarize([str(path)])
    assert "| 1 | 5.0000 | 5.0500 | +1.00% |" in text and "| 2 | 4.0000 | 3.9600 | -1.00% | 4.0400 | +1.00% |" in text
    assert "int8 vs fp32 over 2 seeds: mean +0.00%" in text
    assert "fp32-tp1 vs fp32 over" not in text  # one seed: no interval
