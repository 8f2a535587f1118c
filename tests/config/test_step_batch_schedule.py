"""Megatron-LM's --step-batch-size-schedule: its format (facts from Megatron-Core's
StepBatchsizeNumMicroBatchesCalculator: THRESHOLD:SIZE pairs, thresholds in tokens with suffixes K/M/B/T,
converted to samples as THRESHOLD // seq_length, first threshold 0), the schedule's counting against a brute-force
loop, resolve_batch's rules, and the flag through the trainer's start-up."""

import random

import pytest

from hybrid.config import ConfigError, config_from_command_line, config_from_dict, resolve_batch
from hybrid.config.batch import GlobalBatchSchedule, parse_step_schedule
from tests.config.test_batch_ramp import MODEL, brute_samples_after, brute_steps_within

# Megatron-LM's GPT-3 175B script (examples/gpt3/train_gpt3_175b_distributed.sh): 16 -> 1536 over 12B tokens
GPT3 = ["0:16", "2.4B:320", "4.8B:624", "7.2B:928", "9.6B:1232", "12B:1536"]


def test_the_gpt3_schedule_in_samples():
    # 2.4e9 tokens / 2048 tokens a sample = 1171875 samples, exactly; each further 2.4B another 1171875
    steps = parse_step_schedule(GPT3, 2048)
    assert steps == tuple((k * 1171875, size) for k, size in enumerate((16, 320, 624, 928, 1232, 1536)))
    s = GlobalBatchSchedule.stepwise(steps)
    assert s.final == 1536 and s.ramps and s.sizes() == (16, 320, 624, 928, 1232, 1536)
    # the size of the step that starts after c samples is the last threshold <= c: 16 up to 1171874 consumed
    assert [s.size_at(c) for c in (0, 1171874, 1171875, 2343749, 2343750, 10 ** 9)] == [16, 16, 320, 320, 624, 1536]
    # 1171875 / 16 = 73242.19: 73242 steps at 16 end at 1171872, the next (still 16) ends at 1171888
    assert s.samples_after(73243) == 1171888 and s.size_at(1171888) == 320


@pytest.mark.parametrize("words,seq,expected", [
    (["0:8", "1K:16"], 10, ((0, 8), (100, 16))),  # 1000 tokens // 10
    (["0:8,1.5k:16,2M:32"], 1000, ((0, 8), (1, 16), (2000, 32))),  # commas, a lower-case suffix
    (["3T:4 0:2"], 10 ** 6, ((0, 2), (3 * 10 ** 6, 4))),  # sorted by threshold
    (["0:8", "15:16"], 10, ((0, 8), (1, 16))),  # 15 // 10 = 1, Megatron's floor
])
def test_thresholds_are_tokens_read_as_megatron_reads_them(words, seq, expected):
    assert parse_step_schedule(words, seq) == expected


@pytest.mark.parametrize("words,seq,match", [
    (["8:16"], 4, "the first threshold must be 0"),
    (["0:8", "4:16"], 8, r"two thresholds fall on the same sample \(0 = tokens // seq_length 8\)"),
    (["0:8", "16"], 4, "'16' is not THRESHOLD:SIZE"),
    (["0:8", "1X:16"], 4, "'1X:16' is not THRESHOLD:SIZE"),
    (["0:0"], 4, "'0:0' is not THRESHOLD:SIZE"),
    (["0:1.5"], 4, "'0:1.5' is not THRESHOLD:SIZE"),
    (["0:8"], None, "its thresholds are tokens, read with the sequence length; give model.seq_length"),
])
def test_a_schedule_that_cannot_be_read_says_why(words, seq, match):
    with pytest.raises(ConfigError, match=match) as raised:
        parse_step_schedule(words, seq)
    assert "step_batch_size_schedule" in raised.value.keys


def test_counting_steps_agrees_with_a_brute_force_loop():
    """Random schedules, sizes that grow and shrink too (Megatron takes any order): steps_within and
    samples_after against taking one step at a time by size_at."""
    rng = random.Random(3)
    for _ in range(300):
        thresholds = sorted(rng.sample(range(1, 200), rng.randint(0, 5)))
        s = GlobalBatchSchedule.stepwise([(0, rng.randint(1, 12))] + [(t, rng.randint(1, 40)) for t in thresholds])
        for consumed in {0, rng.randint(0, 250), brute_samples_after(s, rng.randint(1, 8), 0)}:
            for total in (consumed, consumed + rng.randint(0, 300), max(consumed - 3, 0)):
                assert s.steps_within(total, consumed) == brute_steps_within(s, total, consumed), (s, total, consumed)
            for steps in (0, 1, rng.randint(2, 50)):
                assert s.samples_after(steps, consumed) == brute_samples_after(s, steps, consumed), (s, steps)


def test_resolve_batch_follows_the_steps_in_accumulation():
    # micro 2 x dp 2 = 4 samples a micro-step: sizes 4, 12, 8 -> 1, 3, 2 micro-steps
    b = resolve_batch(2, None, None, 2, steps=((0, 4), (10, 12), (30, 8)))
    assert (b.global_batch_size, b.gradient_accumulation_steps) == (8, 2) and b.varies
    assert [b.accumulation_at(c) for c in (0, 9, 10, 29, 30, 999)] == [1, 1, 3, 3, 2, 2]
    assert b.accumulations() == (1, 3, 2)


@pytest.mark.parametrize("glob,dp,rampup,match,keys", [
    (None, 2, None, r"its sizes 6 are not multiples of micro_batch_size x data-parallel size = 2 x 2 = 4",
     {"step_batch_size_schedule", "micro_batch_size"}),
    (16, 1, None, "global_batch_size 16 differs from the last size of step_batch_size_schedule, 8",
     {"step_batch_size_schedule", "global_batch_size"}),
    (None, 1, (2, 2, 10), "step_batch_size_schedule and rampup_batch_size both set",
     {"step_batch_size_schedule", "rampup_batch_size"}),
])
def test_a_schedule_that_cannot_be_taken_says_what_to_change(glob, dp, rampup, match, keys):
    with pytest.raises(ConfigError, match=match) as raised:
        resolve_batch(2, None, glob, dp, rampup, steps=((0, 4), (10, 6), (20, 8)))
    assert set(raised.value.keys) == keys


def test_the_flag_reads_its_thresholds_with_the_models_sequence_length():
    cfg = config_from_command_line(MODEL + ["--step-batch-size-schedule", "0:2", "320:4", "--global-batch-size", "4",
                                            "--train-iters", "5"])
    assert cfg.step_batch_size_schedule == ["0:2", "320:4"]
    b = cfg.resolve_batch(1)  # seq length 32: 320 tokens are 10 samples
    assert b.steps == ((0, 2), (10, 4)) and [b.accumulation_at(c) for c in (0, 9, 10)] == [2, 2, 4]
    # a config file may give it as one string; the preset's sequence length when the model has none of its own
    cfg = config_from_dict({"model": {"preset": "tiny"}, "step_batch_size_schedule": "0:4 1K:8",
                            "micro_batch_size": 4})
    from model_zoo.presets import get_preset

    assert cfg.batch_steps() == ((0, 4), (1000 // get_preset("tiny").seq_length, 8))


def test_a_global_batch_that_is_not_the_last_size_is_named_with_its_flags():
    with pytest.raises(ConfigError, match=r"differs from the last size of step_batch_size_schedule, 4.*"
                                          r"--step-batch-size-schedule, --global-batch-size"):
        config_from_command_line(MODEL + ["--step-batch-size-schedule", "0:2", "320:4", "--global-batch-size", "8",
                                          "--train-iters", "5"])
