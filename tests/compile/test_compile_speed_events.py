"""benchmarks/compile_speed.py writes every timed step of both contenders to TensorBoard (issue 51, reporting)."""

import pytest

from benchmarks.compile_speed import write_tensorboard


def test_eager_and_compiled_step_times_land_in_tensorboard_side_by_side(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = {("tiny", False): [{"tokens": 1024, "step_times_s": [0.125, 0.25]}, {"tokens": 1024,
                                                                                  "step_times_s": [0.5]}],
               ("tiny", True): [{"tokens": 1024, "step_times_s": [0.0625]}]}
    write_tensorboard(str(tmp_path), results)
    for contender, expected in (("eager", [0.125, 0.25, 0.5]), ("compiled", [0.0625])):
        acc = EventAccumulator(str(tmp_path / "tiny" / contender), size_guidance={"scalars": 0})
        acc.Reload()
        times = acc.Scalars("train/iteration_time_s")
        assert [e.step for e in times] == list(range(1, len(expected) + 1))
        assert [e.value for e in times] == pytest.approx(expected)
        assert [e.value for e in acc.Scalars("train/tokens_per_sec")] == pytest.approx([1024 / t for t in expected])
