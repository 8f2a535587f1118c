"""--wandb-project: an offline W&B run holds the same scalars at the same steps as TensorBoard's event file."""

import glob
import os

import numpy as np
import pytest

from hybrid.config import ConfigError
from hybrid.monitor import CHECKPOINT_TAGS, TEST_TAGS, TRAIN_TAGS, VALID_TAGS, wandb_writer
from tests.monitor.tiny_run import SMALL, train
from tests.monitor.wandb_log import history
from tests.multiproc import run_distributed


def _offline(monkeypatch, tmp_path):
    """No mode, no API key, no stored login: the run must go offline by itself."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def _tensorboard(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _same(tb, wb):
    """The same tags, at the same steps, with the same values (TensorBoard keeps float32; W&B the float64 it was
    given)."""
    assert set(wb) == set(tb)
    for tag, points in tb.items():
        assert sorted(wb[tag]) == sorted(points), tag
        assert all(np.float32(wb[tag][step]) == value for step, value in points.items()), tag


def _wandb(run_file):
    """tag -> {iteration: value}, from the history rows (W&B's own keys, ``_step`` and the like, left out)."""
    out = {}
    for row in history(run_file):
        step = row[wandb_writer.STEP_KEY]
        for tag, value in row.items():
            if not tag.startswith("_") and tag != wandb_writer.STEP_KEY:
                out.setdefault(tag, {})[step] = value
    return out


@pytest.mark.slow
def test_the_trainer_logs_to_both(tmp_path, monkeypatch):
    """The trainer at world 1 (its wiring: the flags, the run folder under --wandb-save-dir): training,
    validation and checkpoint tags, the same in both."""
    pytest.importorskip("wandb")
    _offline(monkeypatch, tmp_path)
    board, save, runs = str(tmp_path / "tb"), str(tmp_path / "ckpt"), str(tmp_path / "wb")
    run_distributed(train, 1, SMALL + [
        "--train-iters", "4", "--global-batch-size", "1", "--log-interval", "1", "--eval-interval", "2",
        "--eval-iters", "1", "--save", save, "--save-interval", "2", "--async-save", "--tensorboard-dir", board,
        "--wandb-project", "hybrid-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", runs], timeout=120)
    (run_file,) = glob.glob(os.path.join(runs, "wandb", "offline-run-*", "run-*.wandb"))
    tb, wb = _tensorboard(board), _wandb(run_file)
    assert {"train/lm_loss", "valid/lm_loss", "checkpoint/bytes"} <= set(tb)
    _same(tb, wb)
    assert sorted(tb["train/lm_loss"]) == [1, 2, 3, 4] and sorted(tb["checkpoint/bytes"]) == [2, 4]


def test_offline_run_holds_what_tensorboard_holds(tmp_path, monkeypatch):
    """The monitor with both sinks, offline: every train tag at every log step, validation, test, and a
    background save of iteration 2 reported after iteration 4 was logged (W&B's own step counter would drop
    it; the iteration axis keeps it at 2, as TensorBoard does). Read back, the two hold the same scalars."""
    pytest.importorskip("wandb")
    from hybrid.monitor import IterationMetrics, TrainingMonitor

    _offline(monkeypatch, tmp_path)
    with TrainingMonitor(train_iters=4, log_interval=1, is_logging_rank=True, seq_length=16, world_size=1,
                         tensorboard_dir=str(tmp_path / "tb"), print_fn=lambda line: None,
                         wandb_project="p", wandb_dir=str(tmp_path / "wb")) as monitor:
        for it in range(1, 5):
            monitor.record(IterationMetrics(iteration=it, consumed_samples=it, lm_loss=5.0 - it / 3,
                                            learning_rate=1e-3 * it, batch_size=1, iteration_time_s=0.1 * it,
                                            grad_norm=1.0 + it))
            if it % 2 == 0:
                monitor.record_evaluation("valid", it, 4.5 - it / 10)
        monitor.record_evaluation("test", 4, 4.2)
        monitor.record_checkpoint(2, blocking_s=0.25, write_s=1.5, nbytes=1000)
    (run_file,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    tb, wb = _tensorboard(str(tmp_path / "tb")), _wandb(run_file)
    assert wb["checkpoint/write_s"] == tb["checkpoint/write_s"] == {2: 1.5}
    _same(tb, wb)
    assert set(tb) == set(TRAIN_TAGS) - {"train/params_norm", "train/num_zeros", "train/tflops_per_device",
                                         "train/mfu"} | set(VALID_TAGS) | set(TEST_TAGS) | set(CHECKPOINT_TAGS)
    assert sorted(tb["train/lm_loss"]) == [1, 2, 3, 4] and sorted(tb["valid/ppl"]) == [2, 4]


def test_the_mode(tmp_path):
    netrc = tmp_path / "netrc"
    assert wandb_writer.wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"})[0] == "disabled"
    assert wandb_writer.wandb_mode({"WANDB_API_KEY": "k"})[0] == "online"
    assert wandb_writer.wandb_mode({"NETRC": str(netrc)})[0] == "offline"  # no file
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_writer.wandb_mode({"NETRC": str(netrc)})[0] == "online"
    assert wandb_writer.wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})[0] == \
        "offline"  # a key for another host


def test_without_the_package_the_flag_is_refused_in_one_line(monkeypatch):
    from hybrid.training import parse_args
    from hybrid.training.torch_profiler import check_settings

    real = wandb_writer.importlib.util.find_spec
    monkeypatch.setattr(wandb_writer.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = parse_args(SMALL + ["--train-iters", "2", "--wandb-project", "p"])
    with pytest.raises(ConfigError) as raised:
        check_settings(cfg, world_size=1)
    text = str(raised.value)
    assert "\n" not in text and "pip install 'hybrid[wandb]'" in text and "--wandb-project" in text
