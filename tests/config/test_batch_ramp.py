"""The global-batch ramp-up (rampup_batch_size) and run lengths in samples: the schedule's rule against an
independent formulation, its step counting against a brute-force loop, resolve_batch and the config keys."""

import random
from fractions import Fraction

import pytest

from hybrid.config import ConfigError, config_from_command_line, config_from_dict, load_config, resolve_batch
from hybrid.config import validate_for_training
from hybrid.config.batch import GlobalBatchSchedule
from tests.config.one_error import raises_one_error_listing

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "512", "--micro-batch-size", "1", "--mock-data"]


def reference_size(final, start, increment, samples, consumed):
    """The rule written independently: n = (final - start) / increment increments, each lasting samples / n
    consumed samples (a fraction); the batch is start + increment x (whole increments passed), at most final."""
    if start is None or start == final:
        return final
    n = (final - start) // increment
    assert start + n * increment == final
    passed = (Fraction(consumed) / Fraction(samples, n)).__floor__()
    return min(start + increment * passed, final)


def brute_steps_within(schedule, total, consumed):
    steps = 0
    while consumed + schedule.size_at(consumed) <= total:
        consumed += schedule.size_at(consumed)
        steps += 1
    return steps


def brute_samples_after(schedule, steps, consumed):
    for _ in range(steps):
        consumed += schedule.size_at(consumed)
    return consumed


def random_schedule(rng):
    """A random ramp (or none): start, increment and the number of increments small; samples often not a
    multiple of the number of increments, sometimes smaller than it."""
    start = rng.randint(1, 12)
    increment = rng.randint(1, 6)
    n = rng.choice([0, 0, 1, 2, 3, 4, 5, 7])
    samples = rng.choice([rng.randint(1, 10), rng.randint(1, 120), n * rng.randint(1, 20) or 1])
    if rng.random() < 0.05:
        return GlobalBatchSchedule(start)  # no rampup_batch_size at all
    return GlobalBatchSchedule(start + n * increment, start, increment, samples)


# ---- the rule ------------------------------------------------------------------------------------------


def test_hand_worked_ramp_4_by_4_to_12_over_24_samples():
    # final 12, start 4, increment 4: n = (12 - 4) / 4 = 2 increments over 24 samples, so each size lasts
    # 24 / 2 = 12 samples: 4 until 12 samples are consumed, 8 until 24, then 12.
    #   consumed  0 -> batch 4  (0 * 2 // 24 = 0)
    #   consumed  4 -> batch 4
    #   consumed  8 -> batch 4  (the step starts before the mark at 12, so it is taken whole at 4)
    #   consumed 12 -> batch 8  (12 * 2 // 24 = 1)
    #   consumed 20 -> batch 8  (40 // 24 = 1: starts before the mark at 24, taken whole at 8, ends at 28)
    #   consumed 28 -> batch 12 (56 // 24 = 2)
    #   consumed 40 -> batch 12, and 12 from then on
    s = GlobalBatchSchedule(12, 4, 4, 24)
    consumed, sizes = 0, []
    for _ in range(8):
        sizes.append(s.size_at(consumed))
        consumed += sizes[-1]
    assert sizes == [4, 4, 4, 8, 8, 12, 12, 12]
    assert [s.size_at(c) for c in (0, 11, 12, 23, 24, 10**9)] == [4, 4, 8, 8, 12, 12]
    assert s.sizes() == (4, 8, 12) and s.ramps
    # whole steps within 30 samples: 4+4+4+8+8 = 28 fit, the next (12) does not
    assert s.steps_within(30) == 5 and s.steps_within(27) == 4 and s.steps_within(28) == 5
    assert s.samples_after(5) == 28 and s.samples_after(6) == 40 and s.samples_after(0, 13) == 13
    assert "4" in s.describe() and "12" in s.describe() and "24" in s.describe()


def test_no_ramp_is_the_final_size_throughout():
    for s in (GlobalBatchSchedule(8), GlobalBatchSchedule.constant(8), GlobalBatchSchedule(8, 8, 4, 100)):
        assert not s.ramps and s.sizes() == (8,)
        assert [s.size_at(c) for c in (0, 5, 99, 100, 12345)] == [8] * 5
        assert s.steps_within(100) == 12 and s.steps_within(100, 7) == 11  # (100 - 7) // 8
        assert s.samples_after(3, 5) == 29


def test_size_at_matches_an_independent_fraction_formulation():
    rng = random.Random(20261205)
    checked = 0
    for _ in range(400):
        s = random_schedule(rng)
        points = list(range(0, 3 * (s.samples or 1) + 20)) + [rng.randint(0, 10**6) for _ in range(20)]
        for c in points:
            assert s.size_at(c) == reference_size(s.final, s.start, s.increment, s.samples, c), (s, c)
            checked += 1
    assert checked > 10000
    # the cases the generator is meant to cover did occur
    assert GlobalBatchSchedule(10, 1, 3, 7).size_at(3) == reference_size(10, 1, 3, 7, 3) == 4  # 7 not div. by 3


def test_sizes_lists_every_size_the_ramp_takes():
    rng = random.Random(7)
    for _ in range(200):
        s = random_schedule(rng)
        seen, c = set(), 0
        while c <= (s.samples or 0) + 1:  # every consumed count up to past the ramp
            seen.add(s.size_at(c))
            c += 1
        expected = (s.final,) if s.start in (None, s.final) else tuple(range(s.start, s.final + 1, s.increment))
        assert s.sizes() == expected, s
        # Each size lasts samples / n consumed counts: at least one whole count when samples >= n, so every
        # size is some count's batch. With fewer samples than increments some sizes are passed over (and
        # sizes(), the ramp's sizes that the divisibility checks use, is then a superset).
        if s.start is None or s.samples >= (s.final - s.start) // s.increment:
            assert tuple(sorted(seen)) == expected, s
        else:
            assert seen < set(expected) and {s.start, s.final} <= seen, s


def test_steps_within_and_samples_after_match_a_brute_force_loop():
    rng = random.Random(12345)
    for _ in range(300):
        s = random_schedule(rng)
        ramp_end = (s.samples or 0) + s.final
        starts = {0, 1, rng.randint(0, s.samples or 1), rng.randint(0, 2 * (s.samples or 1)),
                  ramp_end + rng.randint(0, 50)}
        # a start on the run's own path too (a resumed run), mid-ramp when there is one
        starts.add(brute_samples_after(s, rng.randint(1, 6), 0))
        for consumed in starts:
            for total in {consumed, consumed + rng.randint(0, 3 * s.final), consumed + rng.randint(0, 400),
                          max(consumed - 5, 0)}:
                assert s.steps_within(total, consumed) == brute_steps_within(s, total, consumed), (s, total, consumed)
            for steps in (0, 1, 2, rng.randint(3, 40)):
                assert s.samples_after(steps, consumed) == brute_samples_after(s, steps, consumed), (s, steps, consumed)


def test_steps_within_and_samples_after_agree_with_each_other():
    s = GlobalBatchSchedule(64, 8, 8, 1000)
    for consumed in (0, 100, 999, 1000, 5000):
        for steps in range(0, 30):
            end = s.samples_after(steps, consumed)
            assert s.steps_within(end, consumed) == steps
            assert s.steps_within(end - 1, consumed) == max(steps - 1, 0)


# ---- resolve_batch -------------------------------------------------------------------------------------


def test_resolve_batch_with_a_ramp_follows_it_in_accumulation_steps():
    # micro 2 x dp 2 = 4 samples per micro-step; sizes 4, 8, 12 (each over 12 samples) -> 1, 2, 3 micro-steps
    b = resolve_batch(2, None, 12, 2, (4, 4, 24))
    assert (b.micro_batch_size, b.gradient_accumulation_steps, b.global_batch_size) == (2, 3, 12)
    assert b.rampup == (4, 4, 24) and b.schedule == GlobalBatchSchedule(12, 4, 4, 24)
    assert [b.accumulation_at(c) for c in (0, 11, 12, 23, 24, 500)] == [1, 1, 2, 2, 3, 3]
    # no ramp: always the configured accumulation
    plain = resolve_batch(2, None, 12, 2)
    assert plain.rampup is None and plain.schedule == GlobalBatchSchedule(12)
    assert [plain.accumulation_at(c) for c in (0, 7, 100)] == [3, 3, 3]


def test_a_ramp_that_starts_at_the_global_batch_is_no_ramp():
    # the increment 3 is no multiple of micro x dp = 2, but there is no increment to take
    b = resolve_batch(2, None, 8, 1, [8, 3, 100])
    assert not b.schedule.ramps and [b.accumulation_at(c) for c in (0, 50, 1000)] == [4, 4, 4]


@pytest.mark.parametrize("micro,glob,dp,rampup,match,keys", [
    (2, None, 1, (4, 4, 24), "needs global_batch_size: the batch the ramp ends at",
     {"rampup_batch_size", "global_batch_size"}),
    (2, 12, 1, (16, 4, 24), "starts above global_batch_size 12", {"rampup_batch_size", "global_batch_size"}),
    (2, 12, 1, (4, 3, 24), "12 - start 4 = 8 is not a multiple of the increment 3",
     {"rampup_batch_size", "global_batch_size"}),
    (2, 12, 2, (2, 2, 24), "must be multiples of micro_batch_size x data-parallel size = 2 x 2 = 4",
     {"rampup_batch_size", "micro_batch_size"}),
    (2, 12, 2, (4, 2, 24), "choose multiples of 4", {"rampup_batch_size", "micro_batch_size"}),
    (1, 24, 4, (12, 6, 24), "choose multiples of 4", {"rampup_batch_size", "micro_batch_size"}),
])
def test_a_ramp_that_cannot_be_taken_says_what_to_change(micro, glob, dp, rampup, match, keys):
    with pytest.raises(ConfigError, match=match) as raised:
        resolve_batch(micro, None, glob, dp, rampup)
    assert set(raised.value.keys) == keys


def test_the_config_names_the_flags_of_a_ramp_that_does_not_divide():
    cfg = config_from_dict({"micro_batch_size": 2, "global_batch_size": 12, "rampup_batch_size": [2, 2, 24]})
    assert cfg.resolve_batch(1).accumulation_at(0) == 1  # fine on one rank
    with pytest.raises(ConfigError, match=r"choose multiples of 4 \(set by --rampup-batch-size, --micro-batch-size\)"):
        cfg.resolve_batch(2)


# ---- the config keys ---------------------------------------------------------------------------------


def test_rampup_flag_parses_to_the_tuple():
    cfg = config_from_command_line(["--rampup-batch-size", "4", "4", "24", "--global-batch-size", "12",
                                    "--micro-batch-size", "2"])
    assert cfg.rampup_batch_size == (4, 4, 24)
    assert cfg.resolve_batch(1).schedule == GlobalBatchSchedule(12, 4, 4, 24)
    assert load_config({"rampup_batch_size": [4, 4, 24], "global_batch_size": 12}).rampup_batch_size == (4, 4, 24)


@pytest.mark.parametrize("data,match", [
    ({"rampup_batch_size": [4, 4, 24]}, "needs global_batch_size"),
    ({"rampup_batch_size": [4, 4, 24], "global_batch_size": 14}, "is not a multiple of the increment 4"),
    ({"rampup_batch_size": [20, 4, 24], "global_batch_size": 12}, "starts above global_batch_size 12"),
])
def test_a_bad_ramp_is_refused_by_the_config_with_its_flags(data, match):
    with pytest.raises(ConfigError, match=match) as raised:
        load_config(data)
    assert "(set by --rampup-batch-size, --global-batch-size)" in str(raised.value)


def test_train_iters_and_train_samples_together_are_one_error_naming_both():
    for load in (lambda: load_config({"run": {"train_iters": 10, "train_samples": 100}}),
                 lambda: config_from_command_line(["--train-iters", "10", "--train-samples", "100"])):
        with pytest.raises(ConfigError) as raised:
            load()
        message = str(raised.value)
        assert "need changing" not in message and "\n" not in message, message
        assert "'run.train_iters' (10)" in message and "'run.train_samples' (100)" in message
        assert "not both" in message and "--train-iters" in message and "--train-samples" in message
        assert set(raised.value.keys) == {"run.train_iters", "run.train_samples"}


def test_train_iters_and_train_samples_together_are_listed_with_other_problems():
    raises_one_error_listing(load_config, {"run": {"train_iters": 10, "train_samples": 100},
                                           "autocast": True, "precision": "fp32"}, 2, "config keys",
                             ("'run.train_iters' (10) or as 'run.train_samples' (100), not both",
                              "'autocast' is true but 'precision' is fp32"))


@pytest.mark.parametrize("scheduler", [
    {"type": "cosine", "warmup_iters": 5, "decay_samples": 100},
    {"type": "cosine", "warmup_samples": 5, "decay_iters": 100},
    {"type": "linear", "warmup_iters": 5, "warmup_samples": 10, "decay_samples": 100},
])
def test_a_schedule_in_both_steps_and_samples_is_refused(scheduler):
    with pytest.raises(ConfigError, match=r"give the learning-rate schedule in optimizer steps .* or in samples "
                                          r".*, not both"):
        load_config({"scheduler": scheduler})


def test_a_warmup_in_samples_and_as_a_fraction_is_refused():
    with pytest.raises(ConfigError, match=r"give the warmup as 'scheduler\.warmup_samples' \(10\) or as "
                                          r"'scheduler\.warmup_fraction' \(0\.1\), not both"):
        load_config({"scheduler": {"warmup_samples": 10, "warmup_fraction": 0.1, "decay_samples": 1000}})


def test_train_samples_gives_a_decaying_schedule_its_length_in_samples():
    cfg = config_from_command_line(["--train-samples", "1000", "--lr-decay-style", "cosine"])
    s = cfg.scheduler
    assert s.decay_samples == 1000 and s.decay_iters is None
    assert s.in_samples and s.unit == "samples" and s.decay_length == 1000 and s.warmup_length == 0


def test_a_warmup_fraction_of_a_run_in_samples_is_that_many_samples():
    cfg = config_from_command_line(["--train-samples", "1000", "--lr-warmup-fraction", "0.01"])
    s = cfg.scheduler
    assert s.in_samples and s.decay_samples == 1000 and s.warmup_length == 10  # 0.01 x 1000 samples


def test_a_run_in_steps_keeps_its_schedule_in_steps():
    s = config_from_command_line(["--train-iters", "200", "--lr-decay-style", "linear"]).scheduler
    assert not s.in_samples and s.unit == "steps" and s.decay_iters == 200 and s.decay_samples is None
    # and a run in samples with a warmup in samples derives the decay in samples
    s = config_from_command_line(["--train-samples", "800", "--lr-warmup-samples", "80", "--lr-decay-style",
                                  "linear"]).scheduler
    assert (s.decay_samples, s.warmup_length, s.unit) == (800, 80, "samples")


def test_a_schedule_in_steps_of_a_run_in_samples_asks_for_decay_iters():
    with pytest.raises(ConfigError, match=r"scheduler\.type 'cosine' needs 'scheduler\.decay_iters'.*"
                                          r"\(set by --lr-decay-iters\)"):
        config_from_command_line(["--lr-warmup-iters", "5", "--lr-decay-style", "cosine", "--train-samples", "1000"])
    # given, it is fine, and stays in steps
    s = config_from_command_line(["--lr-warmup-iters", "5", "--lr-decay-style", "cosine", "--train-samples", "1000",
                                  "--lr-decay-iters", "50"]).scheduler
    assert (s.unit, s.decay_length, s.warmup_length) == ("steps", 50, 5)


def test_a_schedule_in_samples_of_a_run_in_steps_asks_for_decay_samples():
    with pytest.raises(ConfigError, match=r"needs 'scheduler\.decay_samples'.*derives it from run\.train_samples"):
        config_from_command_line(["--lr-warmup-samples", "5", "--lr-decay-style", "cosine", "--train-iters", "100"])


# ---- validate_for_training -----------------------------------------------------------------------------


def _trainer_config(*flags):
    return config_from_command_line(MODEL + list(flags))


def test_train_samples_below_the_first_global_batch_is_refused():
    ramp = ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "24"]
    cfg = _trainer_config("--train-samples", "3", *ramp)
    with pytest.raises(ConfigError) as raised:
        validate_for_training(cfg, 1)
    message = str(raised.value)
    assert "'run.train_samples' (3) is less than the first global batch (4 samples)" in message, message
    assert "--train-samples" in message and raised.value.keys == ("run.train_samples",)
    # the first global batch of a ramp is its start (4), not the global batch (12): 4 and 11 samples take steps
    for samples in ("4", "11"):
        batch = validate_for_training(_trainer_config("--train-samples", samples, *ramp), 1)
        assert batch.schedule.steps_within(int(samples)) == int(samples) // 4  # 1 and 2 steps of 4
    # without a ramp 11 samples are less than one batch of 12
    with pytest.raises(ConfigError, match=r"'run\.train_samples' \(11\) is less than the first global batch "
                                          r"\(12 samples\)"):
        validate_for_training(_trainer_config("--train-samples", "11", "--global-batch-size", "12"), 1)


def test_a_run_needs_train_iters_or_train_samples():
    batch = validate_for_training(_trainer_config("--train-samples", "100", "--global-batch-size", "4"), 2)
    assert (batch.global_batch_size, batch.dp_size, batch.gradient_accumulation_steps) == (4, 2, 2)
    with pytest.raises(ConfigError, match=r"give the run's length: 'run\.train_iters' \(optimizer steps\) or "
                                          r"'run\.train_samples'"):
        validate_for_training(_trainer_config("--global-batch-size", "4"), 1)
