"""Megatron-DeepSpeed's token-based run and schedule (--train-tokens, --lr-warmup-tokens, --lr-decay-tokens), read
as samples with the sequence length: the run's length against Megatron-DeepSpeed's loop (train while fewer tokens
are consumed), the learning rate against its token formula (facts from its OptimizerParamScheduler.get_lr:
warmup max_lr x tokens / warmup_tokens, then the decay ratio (tokens - warmup) / (decay - warmup)), and the
errors."""

import math
import random

import pytest

from hybrid.config import ConfigError, config_from_command_line
from hybrid.config.batch import GlobalBatchSchedule
from hybrid.optim.lr_schedule import LRSchedule
from tests.config.test_batch_ramp import MODEL, brute_samples_after  # MODEL: --seq-length 32, micro batch 1


def megatron_deepspeed_steps(schedule: GlobalBatchSchedule, train_tokens: int, seq: int) -> int:
    """Its loop: a step is taken while the consumed tokens (samples x seq_length) are below train_tokens."""
    steps = consumed = 0
    while consumed * seq < train_tokens:
        consumed += schedule.size_at(consumed)
        steps += 1
    return steps


def megatron_deepspeed_lr(tokens, max_lr, min_lr, warmup_tokens, decay_tokens):
    """get_lr with token lengths, cosine decay."""
    if warmup_tokens > 0 and tokens <= warmup_tokens:
        return max_lr * tokens / warmup_tokens
    if tokens > decay_tokens:
        return min_lr
    ratio = (tokens - warmup_tokens) / (decay_tokens - warmup_tokens)
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_a_hand_worked_run_in_tokens():
    # 300 tokens at 32 a sample are 9.4 samples: with batch 4 Megatron-DeepSpeed steps at 0, 128 and 256 tokens
    # consumed (all below 300) and stops at 384: 3 steps, 12 samples
    flags = MODEL + ["--global-batch-size", "4", "--train-tokens", "300"]
    assert config_from_command_line(flags).run.train_samples == 12
    assert config_from_command_line(flags + ["--train-samples", "8"]).run.train_samples == 8  # it ends first
    cfg = config_from_command_line(flags + ["--train-iters", "2"])
    assert (cfg.run.train_iters, cfg.run.train_samples) == (2, None)
    assert config_from_command_line(flags + ["--train-iters", "9"]).run.train_iters == 3


@pytest.mark.parametrize("seed", range(3))
def test_the_run_takes_the_steps_megatron_deepspeed_takes(seed):
    """Random ramps and step schedules: the derived train_samples holds exactly Megatron-DeepSpeed's steps."""
    rng = random.Random(seed)
    for _ in range(40):
        seq = rng.choice([1, 7, 32, 100])
        ramp = ["--rampup-batch-size", "2", "2", str(rng.randint(1, 60))] if rng.random() < 0.5 else []
        tokens = rng.randint(1, 4000)
        cfg = config_from_command_line(MODEL[:MODEL.index("--seq-length")] + MODEL[MODEL.index("--seq-length") + 2:]
                                       + ["--seq-length", str(seq), "--global-batch-size", "8",
                                          "--train-tokens", str(tokens)] + ramp)
        schedule = cfg.resolve_batch(1).schedule
        expected = megatron_deepspeed_steps(schedule, tokens, seq)
        assert schedule.steps_within(cfg.run.train_samples) == expected, (seq, ramp, tokens)
        assert cfg.run.train_samples == brute_samples_after(schedule, expected, 0)


@pytest.mark.parametrize("warmup_tokens,decay_tokens", [(3200, 32000), (3000, 31000)])
def test_the_learning_rate_follows_megatron_deepspeeds_token_formula(warmup_tokens, decay_tokens):
    """At seq 32 and batch 4. Divisible lengths (3200 = 100 samples, 32000 = 1000): the same rate. Others are
    read to the nearest sample, W = 94 for 93.75 and D = 969 for 968.75, each off by at most 1/2 sample: during
    warmup the rate is max_lr x c / W against max_lr x c / 93.75, a relative difference |W - 93.75| / W; after it
    the decay ratio moves by at most (|dW| + |dD|) / (D - W - 1) and cosine's slope is at most pi / 2 of
    (max_lr - min_lr)."""
    cfg = config_from_command_line(MODEL + ["--global-batch-size", "4", "--train-tokens", "40000", "--lr", "1e-3",
                                            "--min-lr", "1e-4", "--lr-decay-style", "cosine",
                                            "--lr-warmup-tokens", str(warmup_tokens),
                                            "--lr-decay-tokens", str(decay_tokens)])
    s = cfg.scheduler
    W, D = s.warmup_samples, s.decay_samples
    assert (W, D) == (round(warmup_tokens / 32), round(decay_tokens / 32))
    schedule = LRSchedule(1e-3, decay_style="cosine", warmup_iters=W, decay_iters=D, min_lr=1e-4, unit="samples")
    dW, dD = abs(W - warmup_tokens / 32), abs(D - decay_tokens / 32)
    for c in range(0, 1300, 4):  # consumed samples before each step
        ours, theirs = schedule.lr_at(c), megatron_deepspeed_lr(c * 32, 1e-3, 1e-4, warmup_tokens, decay_tokens)
        if dW == dD == 0:
            assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18), c
        elif c < W:
            assert abs(ours - theirs) <= theirs * dW / W + 1e-18, c
        else:
            assert abs(ours - theirs) <= (1e-3 - 1e-4) * math.pi / 2 * (dW + dD) / (D - W - 1) + 1e-3 * dW / W, c


@pytest.mark.parametrize("flags,match,keys", [
    (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--lr-warmup-tokens", "64"],
     "is read as samples with the sequence length: give 'model.seq_length'", {"scheduler.warmup_tokens"}),
    (MODEL + ["--lr-warmup-tokens", "64", "--lr-warmup-iters", "3"],
     "give the warmup as 'scheduler.warmup_tokens' or as 'scheduler.warmup_iters', not both",
     {"scheduler.warmup_tokens"}),
    (MODEL + ["--lr-decay-tokens", "640", "--lr-decay-samples", "30"],
     "give the decay as 'scheduler.decay_tokens' or as 'scheduler.decay_samples', not both",
     {"scheduler.decay_tokens"}),
    (MODEL + ["--train-tokens", "640"], "ends the run after the step that reaches it: give 'global_batch_size'",
     {"run.train_tokens"}),
])
def test_a_token_count_that_cannot_be_read_says_why(flags, match, keys):
    with pytest.raises(ConfigError, match=match) as raised:
        config_from_command_line(flags)
    assert keys <= set(raised.value.keys)
