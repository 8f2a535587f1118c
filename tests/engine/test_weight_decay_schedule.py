"""A growing weight decay (Megatron's ``--start-weight-decay``, ``--end-weight-decay``,
``--weight-decay-incr-style``): the formula, and every ZeRO stage's steps against ``torch.optim.AdamW`` given the
same weight decay at each step."""

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid.optim.wd_schedule import WeightDecaySchedule
from tests.numerics import adam_trajectory_tolerance


def megatron_wd(n, start, end, style, incr_steps):
    """Megatron-LM's weight decay after ``n`` scheduler steps, as its documentation states it."""
    if n > incr_steps or style == "constant":
        return end
    ratio = n / incr_steps
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_the_weight_decay_is_megatrons_formula(style):
    s = WeightDecaySchedule(0.01, 0.1, style, length=40)
    for n in range(50):
        assert s.value_at(n) == pytest.approx(megatron_wd(n, 0.01, 0.1, style, 40), rel=1e-12), n
    assert s.value_at(0) == pytest.approx(0.01) and s.value_at(40) == pytest.approx(0.1)
    assert WeightDecaySchedule(0.1, 0.1).value_at(10**6) == 0.1


@pytest.mark.parametrize("kwargs,match", [
    (dict(start=0.2, end=0.1), r"need 0 <= start \(0\.2\) <= end \(0\.1\)"),
    (dict(start=0.0, end=0.1), r"a constant weight decay has start == end"),
    (dict(start=0.0, end=0.1, style="linear"), r"a linear weight decay increment needs a length >= 1"),
    (dict(start=0.0, end=0.1, style="exp", length=3), r"must be one of constant, linear, cosine"),
])
def test_bad_schedules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightDecaySchedule(**kwargs)


LR, STEPS, START, END = 0.1, 6, 0.0, 1.0  # a strong decay, so that a wrong schedule shows at once


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _reference(weight_decay_at):
    """torch.optim.AdamW on the same batches, the matrices' weight decay set before each step."""
    model = _model()
    matrices = [p for p in model.parameters() if p.dim() > 1]
    others = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": matrices}, {"params": others, "weight_decay": 0.0}], lr=LR)
    for step, (x, y) in enumerate(_batches()):
        opt.param_groups[0]["weight_decay"] = weight_decay_at(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_every_stage_steps_with_the_scheduled_weight_decay(stage, style):
    import hybrid

    config = {"micro_batch_size": 8, "global_batch_size": 8, "zero": {"stage": stage}, "clip_grad": 0.0,
              "steps_per_print": 0,
              "optimizer": {"type": "adamw", "lr": LR, "weight_decay": END, "start_weight_decay": START,
                            "weight_decay_incr_style": style},
              "scheduler": {"weight_decay_incr_iters": STEPS - 1}}
    model = _model()
    engine = hybrid.initialize(model, config)
    for x, y in _batches():
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    with engine.gathered_parameters():
        got = [p.detach().clone() for p in model.parameters()]
    want = _reference(lambda step: megatron_wd(step, START, END, style, STEPS - 1))
    constant = _reference(lambda step: END)  # what the run would be without the schedule
    tol = adam_trajectory_tolerance(STEPS, LR)
    for g, w, c in zip(got, want, constant):
        assert (g - w).abs().max() <= tol
    assert max((w - c).abs().max() for w, c in zip(want, constant)) > 10 * tol  # the test can tell them apart
    engine.close()


def test_the_config_derives_the_length_from_the_run():
    from hybrid.config import config_from_command_line
    from hybrid.engine.builders import build_wd_schedule

    cfg = config_from_command_line(["--train-iters", "100", "--weight-decay", "0.1", "--start-weight-decay", "0.0",
                                    "--weight-decay-incr-style", "cosine"])
    s = build_wd_schedule(cfg)
    assert (s.start, s.end, s.length) == (0.0, 0.1, 100)
    assert s.value_at(50) == pytest.approx(0.05)


@pytest.mark.parametrize("config,match", [
    ({"optimizer": {"weight_decay": 0.1, "start_weight_decay": 0.2, "weight_decay_incr_style": "linear"},
      "scheduler": {"weight_decay_incr_iters": 5}},
     r"'optimizer\.end_weight_decay' \(0\.1\) is below 'optimizer\.start_weight_decay' \(0\.2\)"),
    ({"optimizer": {"end_weight_decay": 0.1}},
     r"a weight decay from 0\.0 to 0\.1 needs 'optimizer\.weight_decay_incr_style' linear or cosine"),
    ({"optimizer": {"weight_decay_incr_style": "cosine", "end_weight_decay": 0.1}},
     r"'cosine' needs 'scheduler\.weight_decay_incr_iters'.*derives it from run\.train_iters"),
    ({"scheduler": {"weight_decay_incr_samples": 5}},
     r"'scheduler\.weight_decay_incr_samples' is the length of a growing weight decay, but "
     r"'optimizer\.weight_decay_incr_style' is constant"),
])
def test_settings_that_cannot_be_used_are_refused(config, match):
    from hybrid.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(config)


def test_a_resumed_run_keeps_its_weight_decay_schedule_unless_told(tmp_path):
    import hybrid
    from hybrid.checkpoint import CheckpointError

    def engine(end):
        config = {"micro_batch_size": 8, "global_batch_size": 8, "steps_per_print": 0,
                  "optimizer": {"type": "adamw", "lr": LR, "weight_decay": end, "start_weight_decay": START,
                                "weight_decay_incr_style": "linear"},
                  "scheduler": {"weight_decay_incr_iters": STEPS}}
        return hybrid.initialize(_model(), config)

    first = engine(END)
    for x, y in _batches()[:2]:
        first.backward(F.mse_loss(first(x), y))
        first.step()
    first.save_checkpoint(str(tmp_path / "ck"))
    first.close()
    same = engine(END)
    same.load_checkpoint(str(tmp_path / "ck"))
    assert same.lr_schedule.iteration == 2  # the position the weight decay follows
    assert same.wd_schedule.value_at(same.lr_schedule.iteration) == pytest.approx(END * 2 / STEPS)
    same.close()
    changed = engine(2 * END)
    with pytest.raises(CheckpointError, match=r"the saved weight-decay schedule differs from the configured one "
                                              r"\(end: checkpoint 1\.0 vs now 2\.0\).*--override-opt-param-scheduler"):
        changed.load_checkpoint(str(tmp_path / "ck"))
    changed.close()
