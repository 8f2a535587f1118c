"""Stage splits and schedules, checked on paper (no processes): every schedule finishes without deadlock,
delivers its transfers in order, idles exactly the bubble formula's fraction and keeps the promised number of
micro-batches in flight."""

import pytest

from hybrid.config.errors import ConfigError
from hybrid.pipeline import Action, ScheduleError, balanced_layer_counts, bubble_fraction, simulate, split_layers
from hybrid.pipeline import schedule

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def _lists(name, pp, m, chunks=1):
    return [schedule.build(name, r, pp, m, chunks) for r in range(pp)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedules_idle_the_formula_and_bound_memory(name):
    for pp, m in SIZES:
        sim = simulate(_lists(name, pp, m))
        assert max(sim.idle_fraction) == pytest.approx(bubble_fraction(pp, m), abs=1e-12), (pp, m)
        expected = [m] * pp if name == "gpipe" else [min(pp - s, m) for s in range(pp)]
        assert sim.max_in_flight == expected, (pp, m)


def test_interleaving_divides_the_bubble_by_the_chunk_count():
    for pp, m in SIZES:
        for v in (2, 3):
            if pp == 1 or m % pp:
                continue
            sim = simulate(_lists("interleaved", pp, m, v), chunks=v)
            assert max(sim.idle_fraction) == pytest.approx(bubble_fraction(pp, m, v), abs=1e-12), (pp, m, v)
            assert max(sim.idle_fraction) < bubble_fraction(pp, m)
            assert sim.max_in_flight == [min(2 * (pp - s - 1) + (v - 1) * pp + 1, v * m) for s in range(pp)]


def test_a_slower_last_stage_sets_the_pace_and_the_faster_one_waits_for_it():
    # 1F1B at p = 2, forward 1 and backward 2 on rank 0, s times that on rank 1 (s >= 1): after rank 0's first
    # forward, rank 1 computes without a break (rank 0 always has the next activation ready), then rank 0 runs
    # the last backward; so the step is 1 + 3ms + 2, rank 1 idles 3 of it and rank 0 all but its 3m.
    for s in (1.0, 1.02, 1.05):
        for m in (2, 8, 16):
            sim = simulate(_lists("1f1b", 2, m), stage_speed=[1.0, s])
            step = 3 + 3 * m * s
            assert sim.makespan == pytest.approx(step, rel=1e-12)
            assert sim.idle_fraction == pytest.approx([1 - 3 * m / step, 3 / step], rel=1e-12)
            if s > 1:  # the slower stage idles less than the formula, the faster more
                assert sim.idle_fraction[1] < bubble_fraction(2, m) < sim.idle_fraction[0]


def test_replaying_durations_follows_each_action_own_time():
    # The cost model's own durations replay to the same step; a measured set is played exactly.
    for name, pp, m, v in (("1f1b", 2, 8, 1), ("gpipe", 3, 4, 1), ("interleaved", 2, 8, 2)):
        lists = _lists(name, pp, m, v)
        speeds = [1.0, 1.03] + [1.0] * (pp - 2)
        modeled = simulate(lists, v, stage_speed=speeds)
        durations = [[(1.0 if a.kind == "F" else 2.0) / v * speeds[r] for a in acts] for r, acts in enumerate(lists)]
        replayed = simulate(lists, v, durations=durations)
        assert replayed.makespan == pytest.approx(modeled.makespan, rel=1e-12)
        assert replayed.idle_fraction == pytest.approx(modeled.idle_fraction, rel=1e-12)
    # 1F1B, p = 2, m = 2, rank 1's first backward 5 long. Rank 0: F0 [0, 1], F1 [1, 2], B0 waits for rank 1's
    # B0 [2, 7] and runs [7, 9], B1 waits for rank 1's B1 [8, 10] and runs [10, 12]; rank 1's F1 runs [7, 8].
    sim = simulate(_lists("1f1b", 2, 2), durations=[[1, 1, 2, 2], [1, 5, 1, 2]])
    assert sim.makespan == 12
    assert sim.idle_fraction == [0.5, 0.25]
    with pytest.raises(ValueError, match=r"durations give \[4, 3\] actions per rank, the schedules \[4, 4\]"):
        simulate(_lists("1f1b", 2, 2), durations=[[1, 1, 2, 2], [1, 5, 1]])


def test_every_action_runs_once():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for r in range(4):
            acts = schedule.build(name, r, 4, 8, v)
            assert sorted((a.kind, a.microbatch, a.chunk) for a in acts) == sorted(
                (k, mb, c) for k in "FB" for mb in range(8) for c in range(v))


def test_the_checker_catches_a_deadlock_and_swapped_transfers():
    # Swapped: rank 1 awaits micro-batch 1's activation first. Deadlock: rank 0 waits for micro-batch 0's
    # gradient before sending micro-batch 1's activation, which rank 1 waits for before that backward.
    ok = _lists("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="order"):
        simulate([ok[0], [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]])
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate([[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                  [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]])


def test_every_configurable_schedule_has_its_module():
    from hybrid.config.schema import PIPELINE_SCHEDULES

    assert sorted(schedule.SCHEDULES) == sorted(PIPELINE_SCHEDULES)


def test_bad_schedule_requests_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zigzag'"):
        schedule.build("zigzag", 0, 2, 4)
    with pytest.raises(ConfigError, match="need the interleaved schedule"):
        schedule.build("1f1b", 0, 2, 4, 2)
    with pytest.raises(ConfigError, match="multiple of pipeline_model_parallel_size=4"):
        schedule.build("interleaved", 0, 4, 6, 2)


def test_balanced_split_rule():
    # the embedding and the head count as one layer each; extra layers go to the last stages
    assert balanced_layer_counts(3, 2) == [1, 2]
    assert balanced_layer_counts(24, 4) == [5, 6, 7, 6]
    assert balanced_layer_counts(8, 1) == [8]
    for layers in range(0, 40):
        for parts in range(1, 9):
            try:
                counts = balanced_layer_counts(layers, parts)
            except ConfigError:
                assert layers + 2 < parts
                continue
            assert sum(counts) == layers and min(counts) >= 0
            loads = [c + (k == 0) + (k == parts - 1) for k, c in enumerate(counts)] if parts > 1 else counts
            assert max(loads) - min(loads) <= 1
            assert loads == sorted(loads)  # the heavier parts come last


def test_split_ranges_and_explicit_override():
    split = split_layers(6, 2, chunks=2)
    assert [list(split.layers_of(r, c)) for c in range(2) for r in range(2)] == [[0], [1, 2], [3, 4], [5]]
    assert split.layers_of_rank(0) == [0, 3, 4]
    explicit = split_layers(5, 2, layers_per_stage=[4, 1])
    assert explicit.counts() == [4, 1]
    with pytest.raises(ConfigError, match="sum to num_layers=5"):
        split_layers(5, 2, layers_per_stage=[4, 2])
    with pytest.raises(ConfigError, match="one count per part"):
        split_layers(5, 2, layers_per_stage=[5])
