"""Megatron-LM's --no-load-optim and --no-load-rng: resume a checkpoint's weights and position without its
optimizer state, or without its random-number generators (issue 53)."""

import pytest
import torch

from tests.engine.test_engine_checkpoint import _engine, _train


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_no_load_optim_resumes_the_weights_and_position_with_a_fresh_optimizer(tmp_path, stage):
    straight = _engine(stage)
    _train(straight, 3, seed=1)
    straight.save_checkpoint(tmp_path)
    position = (straight.global_step, straight.consumed_samples, straight.lr_schedule.state_dict())
    after = _train(straight, 3, seed=2)

    fresh = _engine(stage)  # the trainer's --no-load-optim (the generators are restored: no --no-load-rng)
    info = fresh.load_checkpoint(tmp_path, load_optimizer=False, load_progress=True, load_rng=True)
    assert info["iteration"] == 3
    assert (fresh.global_step, fresh.consumed_samples, fresh.lr_schedule.state_dict()) == position
    continued = _train(fresh, 3, seed=2)
    assert continued[:2] == after[:2]  # the first step's two micro-batches: the same weights, data and dropout
    assert all(a != b for a, b in zip(continued[2:], after[2:]))  # then Adam starts again from zero moments


def test_no_load_rng_resumes_everything_but_the_generators(tmp_path):
    straight = _engine(1)
    _train(straight, 3, seed=1)
    straight.save_checkpoint(tmp_path)
    after = _train(straight, 3, seed=2)

    no_rng = _engine(1)
    no_rng.load_checkpoint(tmp_path, load_rng=False)
    assert no_rng.global_step == 3
    assert _train(no_rng, 3, seed=2) != after  # the model's dropout draws other masks

    exact = _engine(1)
    exact.load_checkpoint(tmp_path, load_rng=True)
    assert _train(exact, 3, seed=2) == after


def test_no_load_rng_holds_when_the_checkpoint_is_resharded(tmp_path):
    saved = _engine(1)
    _train(saved, 3, seed=1)
    saved.save_checkpoint(tmp_path)
    runs = {}
    for load_rng in (True, False):  # saved at ZeRO-1, loaded at ZeRO-3: another layout, so resharded on load
        engine = _engine(3)
        engine.load_checkpoint(tmp_path, load_rng=load_rng)
        runs[load_rng] = _train(engine, 3, seed=2)
    again = _engine(3)
    again.load_checkpoint(tmp_path, load_rng=True)
    assert _train(again, 3, seed=2) == runs[True]
    assert runs[False] != runs[True]  # the fresh generators draw other dropout masks
