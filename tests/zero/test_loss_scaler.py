"""The loss-scale state machine, driven by injected overflow sequences (exact scales)."""

import pytest

from hybrid.zero import LossScaler


def run(scaler, overflows):
    scales = []
    for o in overflows:
        scaler.update(o)
        scales.append(scaler.scale)
    return scales


def test_dynamic_defaults():
    s = LossScaler(dynamic=True)
    assert s.scale == 2.0 ** 16 and s.enabled


def test_hysteresis_delays_the_first_halving_and_growth_restores_it():
    s = LossScaler(dynamic=True, initial_scale_power=10, window=3, hysteresis=2, min_scale=1.0)
    F, T = False, True
    got = run(s, [T, T, T, F, F, F, T, T, F, F, F, F, F, F])
    assert got == [1024, 512, 256,          # 1st overflow only uses up hysteresis; then halve, halve
                   256, 256, 512,           # 3 finite steps -> double, hysteresis restored to 2
                   512, 256,                # again: first overflow absorbed, second halves
                   256, 256, 512, 512, 512, 1024]


def test_hysteresis_one_halves_on_every_overflow_and_respects_min_scale():
    s = LossScaler(dynamic=True, initial_scale_power=3, window=1000, hysteresis=1, min_scale=2.0)
    assert run(s, [True] * 5) == [4, 2, 2, 2, 2]


def test_overflow_resets_the_growth_window():
    s = LossScaler(dynamic=True, initial_scale_power=4, window=2, hysteresis=1)
    assert run(s, [False, True, False, False, False, False]) == [16, 8, 8, 16, 16, 32]


def test_static_and_disabled_scalers_never_change():
    static = LossScaler(dynamic=False, static_scale=128.0)
    assert run(static, [True, False, True]) == [128.0] * 3 and static.enabled
    off = LossScaler(dynamic=False)
    assert run(off, [True, True]) == [1.0, 1.0] and not off.enabled


def test_state_round_trip():
    a = LossScaler(dynamic=True, initial_scale_power=5, window=3, hysteresis=2)
    run(a, [True, False])
    b = LossScaler(dynamic=True, initial_scale_power=5, window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    seq = [False, False, True, True, False]
    assert run(a, seq) == run(b, seq)
    with pytest.raises(ValueError, match="fp16.loss_scale"):
        LossScaler(dynamic=False, static_scale=2.0).load_state_dict(a.state_dict())


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 0}, "loss_scale_window"),
    ({"hysteresis": 0}, "fp16.hysteresis"),
    ({"min_scale": 0}, "fp16.min_loss_scale"),
    ({"initial_scale_power": 0, "min_scale": 4}, "below min_scale"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(dynamic=True, **kwargs)
