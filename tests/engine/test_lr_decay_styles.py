"""The inverse-square-root and WSD (warmup-stable-decay) learning-rate schedules: against a reference written
from Megatron-LM's published formulas, through the config (flags, validation, the trainer's derived decay
length) and across a checkpoint."""

import math

import pytest

from hybrid.config import ConfigError, config_from_command_line, load_config
from hybrid.engine.builders import build_lr_schedule
from hybrid.optim import LRSchedule


def megatron_lr(n, *, max_lr, min_lr, init_lr, warmup, decay, style, wsd=None, wsd_style=None):
    """Megatron-LM's rate after ``n`` scheduler steps, as its documentation states it: linear warmup while
    ``n <= warmup``; then constant, or ``min_lr`` past ``decay``; then the style's formula."""
    if warmup > 0 and n <= warmup:
        return init_lr + (max_lr - init_lr) * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    delta = max_lr - min_lr
    if style == "linear":
        return min_lr + delta * (1 - (n - warmup) / (decay - warmup))
    if style == "cosine":
        return min_lr + delta * 0.5 * (math.cos(math.pi * (n - warmup) / (decay - warmup)) + 1)
    assert style == "wsd"
    start = decay - wsd
    if n <= start:
        return max_lr
    r = (n - start) / wsd
    coeff = {"linear": 1 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1), "exponential": 2 * 0.5 ** r - 1,
             "minus_sqrt": 1 - math.sqrt(r)}[wsd_style]
    return min_lr + delta * coeff


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
@pytest.mark.parametrize("warmup,decay,wsd", [(10, 100, 20), (0, 50, 50), (5, 60, 55), (3, 40, 1)])
def test_wsd_is_megatrons_formula_at_every_step(wsd_style, warmup, decay, wsd):
    s = LRSchedule(3e-4, decay_style="wsd", warmup_iters=warmup, warmup_start_lr=1e-5, decay_iters=decay,
                   min_lr=3e-5, wsd_decay_iters=wsd, wsd_decay_style=wsd_style)
    for n in range(decay + 10):
        want = megatron_lr(n, max_lr=3e-4, min_lr=3e-5, init_lr=1e-5, warmup=warmup, decay=decay, style="wsd",
                           wsd=wsd, wsd_style=wsd_style)
        assert s.lr_at(n) == pytest.approx(want, rel=1e-12, abs=1e-18), n


def test_wsd_holds_the_peak_then_anneals_to_min_lr_without_a_jump():
    s = LRSchedule(1.0, decay_style="wsd", warmup_iters=4, decay_iters=20, min_lr=0.1, wsd_decay_iters=6)
    assert [s.lr_at(i) for i in range(4)] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert [s.lr_at(i) for i in range(4, 15)] == [1.0] * 11          # stable: warmup's end to 20 - 6 = 14
    anneal = [s.lr_at(i) for i in range(14, 21)]
    assert all(a > b for a, b in zip(anneal, anneal[1:]))             # falls at every step of the anneal
    assert anneal[-1] == 0.1 and s.lr_at(21) == 0.1 and s.lr_at(10**6) == 0.1
    # the default shape is exponential: half way through, 2 * 0.5^0.5 - 1 of the way from min_lr to the peak
    assert s.lr_at(17) == pytest.approx(0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1))


@pytest.mark.parametrize("warmup,decay", [(0, None), (8, None), (8, 30), (1, 5)])
def test_inverse_square_root_is_megatrons_formula(warmup, decay):
    s = LRSchedule(2e-3, decay_style="inverse-square-root", warmup_iters=warmup, decay_iters=decay, min_lr=4e-4)
    for n in range(60):
        want = megatron_lr(n, max_lr=2e-3, min_lr=4e-4, init_lr=0.0, warmup=warmup,
                           decay=math.inf if decay is None else decay, style="inverse-square-root")
        assert s.lr_at(n) == pytest.approx(want, rel=1e-12, abs=1e-18), n


def test_inverse_square_root_needs_no_decay_length_and_never_goes_below_min_lr():
    s = LRSchedule(1.0, decay_style="inverse-square-root", warmup_iters=16, min_lr=0.2)
    assert s.lr_at(16) == 1.0 and s.lr_at(64) == pytest.approx(0.5) and s.lr_at(256) == pytest.approx(0.25)
    assert s.lr_at(400) == pytest.approx(0.2) and s.lr_at(10**9) == 0.2
    assert s.settings()["decay_iters"] is None and "wsd_decay_iters" not in s.settings()


@pytest.mark.parametrize("kwargs,match", [
    (dict(decay_style="wsd", decay_iters=10), r"wsd decay needs 1 <= wsd_decay_iters <= decay_iters - "
                                              r"warmup_iters \(10\).*got None"),
    (dict(decay_style="wsd", warmup_iters=4, decay_iters=10, wsd_decay_iters=7), r"<= decay_iters - warmup_iters "
                                                                                 r"\(6\).*got 7"),
    (dict(decay_style="wsd", wsd_decay_iters=2), r"wsd decay needs decay_iters > warmup_iters"),
    (dict(decay_style="wsd", decay_iters=10, wsd_decay_iters=2, wsd_decay_style="step"),
     r"wsd_decay_style must be one of exponential, linear, cosine, minus_sqrt"),
    (dict(decay_style="inverse-square-root", warmup_iters=8, decay_iters=8), r"decay_iters > warmup_iters \(8\)"),
])
def test_bad_wsd_and_inverse_square_root_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule(1.0, **kwargs)


def test_wsd_settings_are_checked_on_load_and_other_styles_ignore_them():
    from hybrid.optim.lr_schedule import ScheduleSettingsDiffer

    s = LRSchedule(1.0, decay_style="wsd", decay_iters=20, wsd_decay_iters=5)
    for _ in range(7):
        s.step()
    state = s.state_dict()
    assert state["settings"]["wsd_decay_iters"] == 5 and state["settings"]["wsd_decay_style"] == "exponential"
    same = LRSchedule(1.0, decay_style="wsd", decay_iters=20, wsd_decay_iters=5)
    same.load_state_dict(state)
    assert same.iteration == 7
    for changed in (dict(wsd_decay_iters=6), dict(wsd_decay_iters=5, wsd_decay_style="cosine")):
        with pytest.raises(ScheduleSettingsDiffer, match="wsd_decay"):
            LRSchedule(1.0, decay_style="wsd", decay_iters=20, **changed).load_state_dict(state)
    # a cosine schedule records no WSD settings, whatever the (unused) anneal shape
    cosine = LRSchedule(1.0, decay_style="cosine", decay_iters=20, wsd_decay_style="linear")
    assert "wsd_decay_style" not in cosine.settings()
    LRSchedule(1.0, decay_style="cosine", decay_iters=20).load_state_dict(cosine.state_dict())


# ---- through the configuration ---------------------------------------------------------------------


def test_megatron_flags_build_a_wsd_schedule_whose_decay_length_is_the_run():
    cfg = config_from_command_line(["--train-iters", "100", "--lr", "1e-3", "--min-lr", "1e-4",
                                    "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear",
                                    "--lr-wsd-decay-iters", "20", "--lr-warmup-iters", "10"])
    sched = cfg.scheduler
    assert (sched.type, sched.decay_iters, sched.wsd_length, sched.unit) == ("wsd", 100, 20, "steps")
    s = build_lr_schedule(cfg)
    assert s.lr_at(50) == 1e-3 and s.lr_at(80) == 1e-3
    assert s.lr_at(90) == pytest.approx(1e-4 + 9e-4 * 0.5) and s.lr_at(100) == pytest.approx(1e-4)


def test_a_wsd_schedule_in_samples():
    cfg = config_from_command_line(["--train-samples", "1000", "--global-batch-size", "10",
                                    "--micro-batch-size", "10", "--lr", "1.0", "--lr-decay-style", "WSD",
                                    "--lr-wsd-decay-samples", "200", "--lr-wsd-decay-style", "cosine",
                                    "--lr-warmup-samples", "100"])
    assert (cfg.scheduler.unit, cfg.scheduler.decay_samples, cfg.scheduler.wsd_length) == ("samples", 1000, 200)
    s = build_lr_schedule(cfg)
    assert s.lr_at(50) == pytest.approx(0.5) and s.lr_at(800) == 1.0
    assert s.lr_at(900) == pytest.approx(0.5) and s.lr_at(1000) == 0.0


def test_the_trainer_leaves_inverse_square_root_without_an_end():
    cfg = config_from_command_line(["--train-iters", "100", "--lr", "1e-3", "--lr-decay-style",
                                    "inverse-square-root", "--lr-warmup-iters", "4"])
    assert cfg.scheduler.decay_iters is None
    s = build_lr_schedule(cfg)
    assert s.lr_at(99) == pytest.approx(1e-3 * math.sqrt(4 / 99)) and s.lr_at(400) == pytest.approx(1e-4)


@pytest.mark.parametrize("scheduler,match", [
    ({"type": "wsd", "decay_iters": 100},
     r"scheduler\.type 'wsd' needs 'scheduler\.wsd_decay_iters': how long the final anneal .* ends at "
     r"'scheduler\.decay_iters'.*--lr-wsd-decay-iters"),
    ({"type": "wsd", "decay_samples": 1000, "warmup_samples": 10},
     r"needs 'scheduler\.wsd_decay_samples'.*--lr-wsd-decay-samples"),
    ({"type": "wsd", "decay_iters": 100, "warmup_iters": 10, "wsd_decay_iters": 91},
     r"'scheduler\.wsd_decay_iters' \(91\) must be at most 'scheduler\.decay_iters' \(100\) minus "
     r"'scheduler\.warmup_iters' \(10\)"),
    ({"type": "cosine", "decay_iters": 100, "wsd_decay_iters": 10},
     r"'scheduler\.wsd_decay_iters' applies to scheduler\.type wsd only, but scheduler\.type is 'cosine'"),
    ({"type": "wsd", "decay_samples": 100, "wsd_decay_iters": 10},
     r"in optimizer steps \(.*'scheduler\.wsd_decay_iters'.*\) or in samples"),
    ({"type": "wsd", "decay_iters": 100, "wsd_decay_iters": 0}, r"'scheduler\.wsd_decay_iters' must be >= 1"),
    ({"type": "wsd", "decay_iters": 100, "wsd_decay_iters": 10, "wsd_decay_style": "step"},
     r"scheduler\.wsd_decay_style"),
])
def test_wsd_settings_that_cannot_be_used_are_refused(scheduler, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"scheduler": scheduler})


def test_the_start_up_line_names_the_wsd_anneal():
    from hybrid.training.summary import optimizer_line

    cfg = config_from_command_line(["--train-iters", "100", "--lr", "1e-3", "--lr-decay-style", "WSD",
                                    "--lr-wsd-decay-iters", "20"])
    line = optimizer_line(cfg, exempt=0, trainable=4)
    assert "wsd schedule, 0 warmup steps, exponential anneal over the last 20 steps, min 0" in line
