"""Issue 48, defect 2: a non-finite loss or gradient norm stops an fp32 or bf16 run at once.

Before, fp32 and bf16 shared fp16's skip budget: a run at ``--lr 1e6`` went on
skipping every step to its last iteration, saved its checkpoints (marked
unhealthy) and exited 0. Now, as Megatron-LM's ``--check-for-nan-in-loss-and-grad``
(on by default), the first non-finite iteration stops the run with exit status 3
and one line from rank 0 naming the iteration and the ranks whose own loss was
not finite; nothing is saved at that iteration. fp16 keeps its skip budget, and
``--no-check-for-nan-in-loss-and-grad`` turns the check off. The optional loss
spike guard (``--loss-spike-factor K --loss-spike-window N``) stops a loss that
jumps to K times its recent mean.
"""

from __future__ import annotations

import re

import pytest

from hybrid.checkpoint.directory import is_healthy
from hybrid.training import parse_args
from tests.faults.test_trainer_faults import MOCK, _main, _one_error_line, _world2

BLOW_UP = ["--lr", "1e6"]  # a step or two land (how many depends on the CPU's rounding), then the loss is NaN
STOP = re.compile(r"^hybrid-train: error: training diverged at iteration (\d+): the lm loss was nan on rank\(s\) "
                  r"([0-9, ]+)(, and the gradient norm nan)? \(--check-for-nan-in-loss-and-grad\); nothing was saved "
                  r"at this iteration; .*--lr.*--no-check-for-nan-in-loss-and-grad")


def test_fp32_stops_at_the_first_non_finite_iteration_and_saves_nothing_there(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    code, out, err = _main(MOCK + BLOW_UP + ["--train-iters", "30", "--save", save, "--save-interval", "1"],
                           monkeypatch, capsys)
    assert code == 3, out[-2000:] + "\n".join(err)
    assert len(err) == 1 and "Traceback" not in out, err
    stop = STOP.match(err[0])
    assert stop and stop.group(2) == "0", err[0]
    last = int(stop.group(1))
    assert 2 <= last <= 5, err[0]
    logged = [line for line in out.splitlines() if line.startswith("iteration")]
    assert len(logged) == last and "lm loss: n/a" in logged[-1]  # the stop is at the first bad iteration
    # every iteration before it was saved, healthy; the bad one was not
    saved = sorted(p.name for p in save.glob("iter_*"))
    assert saved == [f"iter_{i:07d}" for i in range(1, last)], saved
    assert all(is_healthy(save / name) for name in saved)
    assert "marked unhealthy" not in out


def test_with_async_save_the_save_in_flight_is_committed_not_abandoned(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    code, out, err = _main(MOCK + BLOW_UP + ["--train-iters", "30", "--save", save, "--save-interval", "1",
                                             "--async-save"], monkeypatch, capsys)
    assert code == 3 and len(err) == 1, out[-2000:] + "\n".join(err)
    stop = STOP.match(err[0])
    assert stop, err[0]
    last = int(stop.group(1))
    # the previous iteration's background save was in flight at the stop: committed, and latest names it
    assert (save / "latest").read_text().strip() == f"iter_{last - 1:07d}"
    assert all(is_healthy(save / f"iter_{i:07d}") for i in range(1, last))
    assert not (save / f"iter_{last:07d}").exists()


@pytest.mark.slow  # the one-process cases run by default; this one with pytest -m slow (the suite's budget)
def test_bf16_on_two_ranks_stops_with_one_line_naming_both(tmp_path):
    ranks = _world2(MOCK + BLOW_UP + ["--bf16", "--train-iters", "30"])
    line = _one_error_line(ranks, code=3)
    stop = STOP.match(line)
    assert stop and stop.group(2) == "0, 1", line  # data-parallel: each rank's own loss was NaN


def test_fp16_keeps_its_skip_budget(monkeypatch, capsys):
    code, _, err = _main(MOCK + BLOW_UP + ["--fp16", "--train-iters", "30", "--max-consecutive-skipped-steps", "3"],
                         monkeypatch, capsys)
    assert code == 3 and len(err) == 1, err
    assert re.search(r"training diverged at iteration \d+: 3 consecutive skipped steps", err[0]), err[0]


def test_the_flag_turns_the_check_on_and_off(monkeypatch, capsys):
    assert parse_args([]).run.check_for_nan_in_loss_and_grad  # on by default, as in Megatron-LM
    assert parse_args(["--check-for-nan-in-loss-and-grad"]).run.check_for_nan_in_loss_and_grad
    assert not parse_args(["--no-check-for-nan-in-loss-and-grad"]).run.check_for_nan_in_loss_and_grad
    # off: fp32 skips the non-finite steps within the skip budget, as before
    code, out, err = _main(MOCK + BLOW_UP + ["--train-iters", "5", "--no-check-for-nan-in-loss-and-grad"],
                           monkeypatch, capsys)
    assert code == 0, err
    assert "skipped: 1" in out and "iteration 5/5" in out


def test_the_loss_spike_guard_stops_a_jump_above_its_running_mean(monkeypatch, capsys):
    # --lr 1 takes this model's loss from 4.86 to about 27.8 at iteration 2: finite, 5.7x the one before
    spiking = MOCK + ["--lr", "1", "--train-iters", "6"]
    code, _, err = _main(spiking + ["--loss-spike-factor", "3", "--loss-spike-window", "1"], monkeypatch, capsys)
    assert code == 3 and len(err) == 1, err
    assert re.match(r"hybrid-train: error: training diverged at iteration 2: lm loss [0-9.]+ is [0-9.]+x the mean "
                    r"4\.8\d+ of the 1 iterations before it \(--loss-spike-factor 3, --loss-spike-window 1\)",
                    err[0]), err[0]
    # off by default
    assert parse_args([]).run.loss_spike_factor is None
    code, _, err = _main(spiking, monkeypatch, capsys)
    assert code == 0, err


def test_the_spike_guard_waits_for_a_full_window():
    from hybrid.training.loss_spike import LossSpikeGuard

    guard = LossSpikeGuard(factor=2.0, window=3)
    assert [guard.spike(x) for x in (1.0, 5.0, 1.0)] == [None, None, None]  # filling the window
    assert guard.spike(float("nan")) is None  # non-finite losses are the NaN check's, not the mean's
    assert guard.spike(14.1) == pytest.approx(7.0 / 3)  # above 2x the mean of 1, 5, 1
    assert guard.spike(4.6) is None  # below 2x it


def test_spike_settings_are_checked():
    with pytest.raises(Exception, match="loss_spike_factor"):
        parse_args(["--loss-spike-factor", "1"])
