"""LR schedules against hand-computed values, and the DeepSpeed schedules mapped onto them."""

import math

import pytest

from hybrid.config import ConfigError, load_config
from hybrid.engine.builders import build_lr_schedule
from hybrid.optim import LRSchedule, deepspeed_schedule_kwargs


def test_constant_without_warmup():
    s = LRSchedule(0.5)
    assert [s.lr_at(i) for i in (0, 1, 1000)] == [0.5, 0.5, 0.5]


def test_linear_warmup_endpoints_then_constant():
    s = LRSchedule(1.0, warmup_iters=4, warmup_start_lr=0.2)
    assert s.lr_at(0) == pytest.approx(0.2)
    assert s.lr_at(1) == pytest.approx(0.2 + 0.8 * 1 / 4)
    assert s.lr_at(3) == pytest.approx(0.2 + 0.8 * 3 / 4)
    assert s.lr_at(4) == 1.0 and s.lr_at(50) == 1.0


def test_log_warmup_matches_ln_ratio():
    s = LRSchedule(1e-3, warmup_iters=10, warmup_style="log", warmup_start_lr=1e-4)
    assert s.lr_at(0) == pytest.approx(1e-4)  # ln(1) = 0
    assert s.lr_at(4) == pytest.approx(1e-4 + 9e-4 * math.log(5) / math.log(10))
    assert s.lr_at(9) == pytest.approx(1e-4 + 9e-4 * 1.0)  # ln(10)/ln(10) at the last warmup step
    assert s.lr_at(10) == 1e-3


def test_linear_decay_endpoints_and_floor():
    s = LRSchedule(1.0, decay_style="linear", warmup_iters=2, decay_iters=12, min_lr=0.1)
    assert s.lr_at(0) == 0.0 and s.lr_at(1) == pytest.approx(0.5)
    assert s.lr_at(2) == pytest.approx(1.0)           # decay starts at the peak
    assert s.lr_at(7) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway
    assert s.lr_at(11) == pytest.approx(0.1 + 0.9 * 0.1)
    assert s.lr_at(12) == pytest.approx(0.1) and s.lr_at(10**6) == pytest.approx(0.1)


def test_cosine_decay_endpoints_midpoint_and_floor():
    s = LRSchedule(2.0, decay_style="cosine", decay_iters=10, min_lr=0.2)
    assert s.lr_at(0) == pytest.approx(2.0)
    assert s.lr_at(5) == pytest.approx(0.2 + 1.8 * 0.5)
    assert s.lr_at(3) == pytest.approx(0.2 + 1.8 * (1 + math.cos(math.pi * 0.3)) / 2)
    assert s.lr_at(10) == pytest.approx(0.2) and s.lr_at(99) == pytest.approx(0.2)
    assert all(s.lr_at(i) > s.lr_at(i + 1) for i in range(9))


def test_step_advances_and_state_round_trips():
    s = LRSchedule(1.0, decay_style="linear", warmup_iters=2, decay_iters=6)
    assert s.lr == 0.0
    assert s.step() == pytest.approx(0.5) and s.iteration == 1
    s.step(); s.step()
    state = s.state_dict()
    t = LRSchedule(1.0, decay_style="linear", warmup_iters=2, decay_iters=6)
    t.load_state_dict(state)
    assert t.iteration == 3 and t.lr == s.lr == pytest.approx(0.75)
    other = LRSchedule(2.0, decay_style="linear", warmup_iters=2, decay_iters=6)
    with pytest.raises(ValueError, match=r"max_lr: checkpoint 1\.0 vs now 2\.0"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    assert other.iteration == 3 and other.lr == pytest.approx(1.5)
    with pytest.raises(ValueError, match="invalid iteration"):
        t.load_state_dict({"iteration": -1, "settings": t.settings()})


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_lr=0.0), r"max_lr must be > 0"),
    (dict(max_lr=1.0, min_lr=2.0), r"min_lr \(2\.0\) <= max_lr"),
    (dict(max_lr=1.0, decay_style="step"), r"decay_style must be one of constant, linear, cosine"),
    (dict(max_lr=1.0, warmup_style="exp"), r"warmup_style must be one of linear, log"),
    (dict(max_lr=1.0, decay_style="cosine"), r"cosine decay needs decay_iters > warmup_iters"),
    (dict(max_lr=1.0, warmup_iters=-1), r"warmup_iters must be >= 0"),
    (dict(max_lr=1.0, warmup_iters=1, warmup_style="log"), r"log warmup needs warmup_iters >= 2"),
])
def test_bad_schedule_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule(**kwargs)


def test_negative_step_index():
    with pytest.raises(ValueError, match="step index must be >= 0"):
        LRSchedule(1.0).lr_at(-1)


def test_built_from_native_config():
    cfg = load_config({"optimizer": {"lr": 6e-4}, "scheduler": {"type": "cosine", "warmup_iters": 10,
                                                               "decay_iters": 110, "min_lr": 6e-5}})
    s = build_lr_schedule(cfg)
    assert s.lr_at(5) == pytest.approx(6e-4 * 5 / 10)
    assert s.lr_at(60) == pytest.approx(6e-5 + 5.4e-4 * 0.5)
    assert s.lr_at(110) == pytest.approx(6e-5)


def test_a_warmup_given_as_a_fraction_of_decay_iters_is_that_many_steps():
    cfg = load_config({"optimizer": {"lr": 6e-4}, "scheduler": {"type": "cosine", "warmup_fraction": 0.0466,
                                                               "decay_iters": 300, "min_lr": 6e-5}})
    assert cfg.scheduler.warmup_length == 14  # 13.98 rounded to the nearest step
    s = build_lr_schedule(cfg)
    assert s.lr_at(7) == pytest.approx(6e-4 * 7 / 14)
    assert s.lr_at(14) == pytest.approx(6e-4)
    assert s.lr_at(157) == pytest.approx(6e-5 + 5.4e-4 * 0.5)  # halfway from step 14 to 300


def test_the_trainer_derives_decay_iters_for_a_warmup_fraction_also_under_the_constant_schedule():
    from hybrid.config import config_from_command_line

    cfg = config_from_command_line(["--train-iters", "200", "--lr-warmup-fraction", "0.1", "--lr", "1e-3"])
    assert (cfg.scheduler.decay_iters, cfg.scheduler.warmup_length) == (200, 20)
    s = build_lr_schedule(cfg)
    assert s.lr_at(10) == pytest.approx(5e-4) and s.lr_at(150) == pytest.approx(1e-3)


@pytest.mark.parametrize("scheduler,match", [
    ({"warmup_fraction": 0.1, "warmup_iters": 5, "decay_iters": 100},
     r"give the warmup as 'scheduler\.warmup_iters' \(5\) or as 'scheduler\.warmup_fraction' \(0\.1\), not both"),
    ({"warmup_fraction": 0.1}, r"'scheduler\.warmup_fraction' needs 'scheduler\.decay_iters'"),
    ({"warmup_fraction": 0.01, "decay_iters": 40}, r"'scheduler\.warmup_fraction' 0\.01 of 'scheduler\.decay_iters' "
                                                   r"40 rounds to no warmup step"),
    ({"warmup_fraction": 0.025, "decay_iters": 40, "warmup_style": "log"},
     r"'log' needs at least 2 warmup steps, got the 1 warmup steps of 'scheduler\.warmup_fraction' \(0\.025\)"),
    ({"warmup_fraction": 1.0, "decay_iters": 40}, r"'scheduler\.warmup_fraction' must be < 1\.0"),
])
def test_a_warmup_fraction_that_cannot_be_used_is_refused(scheduler, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"scheduler": scheduler})


# DeepSpeed's formulas, written out by hand from its documentation: with i = the
# scheduler's iteration, W = max(2, warmup_num_steps), T = total_num_steps,
#   warmup gamma: linear i / W, log ln(i + 1) / ln(W)
#   WarmupLR:       min + (max - min) * gamma (i < W), else max
#   WarmupDecayLR:  as WarmupLR in warmup, then min + (max - min) * max(0, (T - i) / (T - W))
#   WarmupCosineLR: lr * (wmin + (1 - wmin) * gamma) in warmup.
def test_deepspeed_warmup_lr_log():
    s = LRSchedule(**deepspeed_schedule_kwargs("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                                                            "warmup_num_steps": 100}, 5e-4))
    for i in (0, 1, 10, 50, 99):
        assert s.lr_at(i) == pytest.approx(1e-5 + (1e-3 - 1e-5) * math.log(i + 1) / math.log(100))
    assert s.lr_at(100) == pytest.approx(1e-3) and s.lr_at(5000) == pytest.approx(1e-3)


def test_deepspeed_warmup_decay_lr_linear():
    s = LRSchedule(**deepspeed_schedule_kwargs("WarmupDecayLR", {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "total_num_steps": 110,
        "warmup_type": "linear"}, 1.0))
    for i in (0, 3, 9):
        assert s.lr_at(i) == pytest.approx(0.1 * i / 10)
    for i in (10, 35, 60, 109, 110, 200):
        assert s.lr_at(i) == pytest.approx(0.1 * max(0.0, (110 - i) / (110 - 10)))


def test_deepspeed_warmup_cosine_lr():
    lr = 1e-3
    s = LRSchedule(**deepspeed_schedule_kwargs("WarmupCosineLR", {
        "total_num_steps": 1000, "warmup_num_steps": 100, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
        "warmup_type": "linear"}, lr))
    for i in (0, 50, 99):
        assert s.lr_at(i) == pytest.approx(lr * (0.1 + 0.9 * i / 100))
    assert s.lr_at(100) == pytest.approx(lr)
    assert s.lr_at(550) == pytest.approx(lr * (0.01 + 0.99 * 0.5))
    assert s.lr_at(1000) == pytest.approx(lr * 0.01)


# ---- a schedule in samples (a batch ramp-up warms up and decays over the same data) ----------------------


def test_a_schedule_in_samples_advances_by_each_steps_samples():
    # linear warmup from 0 over 8 samples to 1.0, cosine to 0.1 at 40 samples; steps of 4, 4, 8, 12, 12 samples
    s = LRSchedule(1.0, decay_style="cosine", warmup_iters=8, decay_iters=40, min_lr=0.1, unit="samples")
    assert s.unit == "samples" and s.settings()["unit"] == "samples"
    assert s.lr == 0.0                                        # 0 samples consumed
    assert s.step(4) == pytest.approx(0.5)                    # 4 of 8 warmup samples
    assert s.step(4) == pytest.approx(1.0)                    # 8: warmup over, decay starts at the peak
    # 16: (16 - 8) / (40 - 8) = 1/4 of the decay
    assert s.step(8) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    # 28: (28 - 8) / 32 = 5/8 of the decay
    assert s.step(12) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 5 / 8)) / 2)
    assert s.iteration == 28
    assert s.step(12) == pytest.approx(0.1) and s.iteration == 40   # at decay_iters: the floor
    assert s.step(1) == pytest.approx(0.1) and s.iteration == 41


def test_a_schedule_in_samples_refuses_a_step_of_no_samples():
    s = LRSchedule(1.0, decay_style="linear", warmup_iters=4, decay_iters=20, unit="samples")
    for bad in (0, -3, 0.5):
        with pytest.raises(ValueError, match="a schedule in samples advances by a step's global batch"):
            s.step(bad)
    assert s.iteration == 0  # a refused step does not move it
    with pytest.raises(ValueError, match="unit must be 'steps' or 'samples'"):
        LRSchedule(1.0, unit="tokens")


def test_a_schedule_in_steps_ignores_the_steps_size():
    s = LRSchedule(1.0, decay_style="linear", warmup_iters=2, decay_iters=6)
    assert s.unit == "steps"
    assert s.step(64) == pytest.approx(0.5) and s.iteration == 1
    assert s.step(0) == pytest.approx(1.0) and s.iteration == 2
    assert s.step() == pytest.approx(0.75) and s.iteration == 3


def test_built_from_a_config_in_samples():
    cfg = load_config({"optimizer": {"lr": 1.0}, "scheduler": {"type": "linear", "warmup_samples": 100,
                                                               "decay_samples": 1100, "min_lr": 0.0}})
    s = build_lr_schedule(cfg)
    assert s.unit == "samples"
    assert s.lr_at(50) == pytest.approx(0.5) and s.lr_at(600) == pytest.approx(0.5)
    assert s.step(100) == pytest.approx(1.0) and s.step(1000) == pytest.approx(0.0)


def test_the_engine_follows_a_batch_ramp_and_a_schedule_in_samples():
    import torch
    import torch.nn.functional as F

    import hybrid

    # micro 2, global 6, rampup_batch_size 2 2 8: n = (6 - 2) / 2 = 2 increments over 8 samples, each lasting
    # 4 samples: batch 2 before 4 samples are consumed, 4 before 8, then 6. One rank, so the accumulation
    # count is the batch / 2. The run's path:
    #   consumed  0: batch 2 (1 micro-step)   consumed  2: batch 2 (1)   consumed 4: batch 4 (2)
    #   consumed  8: batch 6 (3)              consumed 14: batch 6 (3)   consumed 20: batch 6 (3)
    # The schedule counts samples: linear warmup over 4 samples from 0 to 0.1, linear decay to 0.01 at 20.
    def lr_by_hand(c):
        if c < 4:
            return 0.1 * c / 4
        return 0.01 + 0.09 * max(0.0, 1 - (c - 4) / 16)

    path = [(0, 2, 1), (2, 2, 1), (4, 4, 2), (8, 6, 3), (14, 6, 3), (20, 6, 3)]
    config = {"micro_batch_size": 2, "global_batch_size": 6, "rampup_batch_size": [2, 2, 8],
              "optimizer": {"type": "adamw", "lr": 0.1, "betas": [0.9, 0.95], "weight_decay": 0.0},
              "scheduler": {"type": "linear", "warmup_samples": 4, "decay_samples": 20, "min_lr": 0.01},
              "clip_grad": 0.0, "steps_per_print": 0}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    engine = hybrid.initialize(model, config)
    assert engine.batch.gradient_accumulation_steps == 3 and engine.batch.rampup == (2, 2, 8)
    g = torch.Generator().manual_seed(1)
    micro_steps = 0
    for k, (consumed, size, accum) in enumerate(path):
        assert (engine.consumed_samples, engine.global_batch_size, engine.gradient_accumulation_steps) == \
            (consumed, size, accum), k
        assert engine.lr == pytest.approx(lr_by_hand(consumed), abs=1e-12), k
        x, y = torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g)
        stepped = []
        for j in range(accum):
            assert engine.is_accumulation_boundary == (j == accum - 1)
            engine.backward(F.mse_loss(engine(x[2 * j:2 * j + 2]), y[2 * j:2 * j + 2]))
            stepped.append(engine.step())
        micro_steps += accum
        assert stepped == [False] * (accum - 1) + [True], k
        assert engine.last_lr == pytest.approx(lr_by_hand(consumed), abs=1e-12)
        assert (engine.global_step, engine.micro_steps, engine.consumed_samples) == (k + 1, micro_steps,
                                                                                      consumed + size)
        # the same step on the whole batch at once: the engine's loss divisor followed the accumulation count
        for group in ref_opt.param_groups:
            group["lr"] = lr_by_hand(consumed)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert engine.consumed_samples == 26 and engine.lr == pytest.approx(0.01)
    assert engine.lr_schedule.iteration == 26  # the schedule counted samples, not its 6 steps


def test_a_position_in_steps_is_never_loaded_as_one_in_samples():
    from hybrid.optim.lr_schedule import ScheduleSettingsDiffer

    steps = LRSchedule(1e-3, warmup_iters=4)
    steps.step()
    samples = LRSchedule(1e-3, warmup_iters=4, unit="samples")
    for strict in (True, False):  # keeping the configured settings cannot make a step count a sample count
        with pytest.raises(ValueError, match="counts steps and the configured one samples") as raised:
            samples.load_state_dict(steps.state_dict(), strict=strict)
        assert not isinstance(raised.value, ScheduleSettingsDiffer)
    assert samples.iteration == 0
    # a schedule saved before the unit was recorded counted steps
    old = {"iteration": 3, "settings": {k: v for k, v in steps.settings().items() if k != "unit"}}
    with pytest.raises(ValueError, match="counts steps"):
        samples.load_state_dict(old, strict=False)
    steps.load_state_dict(old)
    assert steps.iteration == 3
    with pytest.raises(ScheduleSettingsDiffer, match="warmup_iters"):
        LRSchedule(1e-3, warmup_iters=5).load_state_dict(steps.state_dict())
