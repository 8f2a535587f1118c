import math
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybrid.monitor import (CHECKPOINT_TAGS, HPARAMS_TAG, TEST_TAGS, TRAIN_TAGS, VALID_TAGS, IterationMetrics,
                            MemoryStats, PeakFlops, TrainingMonitor)

SEQ, WORLD, BATCH, FLOPS_PER_TOKEN, PEAK = 64, 4, 8, 3.0e9, 2.0
MEMORY = MemoryStats("rss", 300 * 2**20, 500 * 2**20)


def _metrics(i: int, **over) -> IterationMetrics:
    base = dict(iteration=i, consumed_samples=i * BATCH, lm_loss=10.0 - 0.5 * i,
                learning_rate=1e-4 * i, batch_size=BATCH, iteration_time_s=0.05 * (1 + i % 3),
                grad_norm=2.0 + i, loss_scale=65536.0, skipped=False, params_norm=100.0 + i, num_zeros=10 * i)
    base.update(over)
    return IterationMetrics(**base)


def _run(tmp_path, is_logging_rank=True, train_iters=12, log_interval=5):
    lines = []
    mon = TrainingMonitor(train_iters=train_iters, log_interval=log_interval,
                          is_logging_rank=is_logging_rank, seq_length=SEQ, world_size=WORLD,
                          flops_per_token=FLOPS_PER_TOKEN, peak=PeakFlops(PEAK, "user", "test"),
                          tensorboard_dir=str(tmp_path / "tb"), print_fn=lines.append,
                          memory_fn=lambda device: MEMORY)
    metrics = []
    with mon:
        mon.announce()
        mon.log_hparams({"lr": 3e-4, "tensor-model-parallel-size": 2, "data-path": "a|b"})
        for i in range(1, train_iters + 1):
            over = {}
            if i == 2:
                over = dict(skipped=True, loss_scale=32768.0)
            if i == 3:
                over = dict(lm_loss=math.nan, grad_norm=math.nan)
            m = _metrics(i, **over)
            metrics.append(m)
            mon.record(m)
            if i % 6 == 0:
                mon.record_evaluation("valid", i, 3.0 + 1.0 / i)
        mon.record_evaluation("test", train_iters, 3.5)
    mon.close()  # a second close is harmless
    return lines, metrics


def _events(tmp_path) -> EventAccumulator:
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    return acc


def test_every_tag_present_finite_at_the_right_steps(tmp_path):
    _run(tmp_path)
    acc = _events(tmp_path)
    tags = acc.Tags()
    assert set(tags["scalars"]) == set(TRAIN_TAGS) | set(VALID_TAGS) | set(TEST_TAGS)
    assert len(TRAIN_TAGS) + len(VALID_TAGS) + len(TEST_TAGS) == 18
    for tag in TRAIN_TAGS:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [5, 10, 12], tag
        assert all(math.isfinite(e.value) for e in events), tag
    for tag in VALID_TAGS:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [6, 12], tag
        assert all(math.isfinite(e.value) for e in events), tag
    for tag in TEST_TAGS:
        assert [e.step for e in acc.Scalars(tag)] == [12], tag
    assert f"{HPARAMS_TAG}/text_summary" in tags["tensors"]
    text = acc.Tensors(f"{HPARAMS_TAG}/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| tensor-model-parallel-size | 2 |" in text and "a\\|b" in text


def test_scalar_values_match_hand_computation(tmp_path):
    _, metrics = _run(tmp_path)
    acc = _events(tmp_path)
    value = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    # Interval 1..5: iteration 2 skipped, 3 NaN -> loss mean over 1, 4, 5.
    expected_loss = (9.5 + 8.0 + 7.5) / 3
    assert value["train/lm_loss"][5] == pytest.approx(expected_loss, rel=1e-6)
    assert value["train/skipped_iters"] == {5: 1.0, 10: 0.0, 12: 0.0}
    times = [m.iteration_time_s for m in metrics[:5]]
    assert value["train/iteration_time_s"][5] == pytest.approx(sum(times) / 5, rel=1e-6)
    tokens_per_sec = 5 * BATCH * SEQ / sum(times)
    assert value["train/tokens_per_sec"][5] == pytest.approx(tokens_per_sec, rel=1e-6)
    tflops = FLOPS_PER_TOKEN * tokens_per_sec / WORLD / 1e12
    assert value["train/tflops_per_device"][5] == pytest.approx(tflops, rel=1e-6)
    assert value["train/mfu"][5] == pytest.approx(tflops / PEAK, rel=1e-6)
    assert value["train/lr"][10] == pytest.approx(1e-3, rel=1e-6)
    assert value["train/grad_norm"][12] == pytest.approx(14.0, rel=1e-6)
    assert value["train/params_norm"][10] == pytest.approx(110.0, rel=1e-6)  # the interval's last iteration
    assert value["train/num_zeros"] == {5: 50.0, 10: 100.0, 12: 120.0}
    assert value["train/loss_scale"][5] == 65536.0
    assert value["train/batch_size"][12] == BATCH
    assert value["memory/allocated_bytes"][5] == pytest.approx(MEMORY.allocated_bytes, rel=1e-6)
    assert value["memory/peak_bytes"][5] == pytest.approx(MEMORY.peak_bytes, rel=1e-6)
    assert value["valid/lm_loss"][6] == pytest.approx(3.0 + 1 / 6, rel=1e-6)
    assert value["valid/ppl"][12] == pytest.approx(math.exp(3.0 + 1 / 12), rel=1e-6)
    assert value["test/lm_loss"] == {12: 3.5} and value["test/ppl"][12] == pytest.approx(math.exp(3.5), rel=1e-6)
    # The last, partial interval (11..12) averages its own two iterations.
    assert value["train/lm_loss"][12] == pytest.approx((4.5 + 4.0) / 2, rel=1e-6)


LINE = re.compile(
    r"^iteration +(\d+)/12 \| consumed samples: (\d+) \| global batch size: \d+ \| lm loss: (\S+) \| lr: \S+ \| "
    r"grad norm: \S+ \| num zeros: (\d+) \| params norm: (\S+) \| loss scale: \S+ \| skipped: (\d+) \| nan: (\d+) \| "
    r"iteration time: [\d.]+ ms \| tokens/s: \d+ \| TFLOP/s/device: \S+ \| "
    r"MFU: [\d.]+% \(user peak\) \| mem rss [\d.]+ GiB \| peak rss [\d.]+ GiB$")


def test_console_lines(tmp_path):
    lines, _ = _run(tmp_path)
    assert lines[0].startswith("MFU peak: 2 TFLOP/s per device (user: test)")
    train = [line for line in lines if line.startswith("iteration")]
    valid = [line for line in lines if line.startswith("validation")]
    assert len(train) == 3 and len(valid) == 2
    parsed = [LINE.match(line) for line in train]
    assert all(parsed), train
    assert [int(p.group(1)) for p in parsed] == [5, 10, 12]
    assert [int(p.group(2)) for p in parsed] == [40, 80, 96]
    assert float(parsed[0].group(3)) == pytest.approx((9.5 + 8.0 + 7.5) / 3, rel=1e-6)
    assert [(p.group(4), p.group(5)) for p in parsed] == [("50", "105.000"), ("100", "110.000"), ("120", "112.000")]
    assert [(p.group(6), p.group(7)) for p in parsed] == [("1", "1"), ("0", "0"), ("0", "0")]
    assert valid[0] == f"validation at iteration 6 | lm loss: {3 + 1 / 6:.6E} | " \
                       f"lm loss PPL: {math.exp(3 + 1 / 6):.6E}"
    assert lines[-1] == f"test at iteration 12 | lm loss: {3.5:.6E} | lm loss PPL: {math.exp(3.5):.6E}"


def test_params_norm_and_zeros_appear_only_when_measured(tmp_path):
    lines = []
    mon = TrainingMonitor(train_iters=2, log_interval=1, is_logging_rank=True, seq_length=SEQ, world_size=WORLD,
                          flops_per_token=None, peak=None, tensorboard_dir=str(tmp_path / "tb"),
                          print_fn=lines.append, memory_fn=lambda device: MEMORY)
    with mon:
        mon.record(_metrics(1, params_norm=None, num_zeros=None))
        mon.record(_metrics(2, params_norm=None, num_zeros=0))  # no zero at all is still a count
    train = [line for line in lines if line.startswith("iteration")]
    assert "num zeros" not in train[0] and "params norm" not in train[0]
    assert "| num zeros: 0 | loss scale" in train[1]
    acc = _events(tmp_path)
    assert "train/params_norm" not in acc.Tags()["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("train/num_zeros")] == [(2, 0.0)]


def test_non_logging_rank_is_silent_and_writes_nothing(tmp_path):
    lines, _ = _run(tmp_path, is_logging_rank=False)
    assert lines == []
    assert not (tmp_path / "tb").exists()


def test_interval_of_only_bad_iterations_reports_no_loss(tmp_path):
    lines = []
    mon = TrainingMonitor(train_iters=2, log_interval=2, is_logging_rank=True, seq_length=SEQ,
                          world_size=1, tensorboard_dir=str(tmp_path / "tb"), print_fn=lines.append)
    mon.record(_metrics(1, skipped=True))
    mon.record(_metrics(2, lm_loss=math.inf))
    mon.close()
    assert "lm loss: n/a" in lines[0] and "TFLOP/s/device: n/a" in lines[0] and "MFU: n/a" in lines[0]
    acc = _events(tmp_path)
    assert "train/lm_loss" not in acc.Tags()["scalars"]  # nothing finite to write
    assert "train/tokens_per_sec" in acc.Tags()["scalars"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="log_interval"):
        TrainingMonitor(train_iters=10, log_interval=0, is_logging_rank=True, seq_length=8,
                        world_size=1)


def test_checkpoint_scalars_at_the_saved_iterations(tmp_path):
    with TrainingMonitor(train_iters=10, log_interval=5, is_logging_rank=True, seq_length=SEQ, world_size=WORLD,
                         tensorboard_dir=str(tmp_path / "tb"), print_fn=lambda line: None,
                         memory_fn=lambda device: MEMORY) as mon:
        mon.record_checkpoint(4, 0.25, 3.5, 123456)
        mon.record_checkpoint(8, 0.5, 4.0, 654321)
    acc = _events(tmp_path)
    assert set(acc.Tags()["scalars"]) == set(CHECKPOINT_TAGS)
    values = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in CHECKPOINT_TAGS}
    assert values == {"checkpoint/blocking_s": [(4, 0.25), (8, 0.5)], "checkpoint/write_s": [(4, 3.5), (8, 4.0)],
                      "checkpoint/bytes": [(4, 123456.0), (8, 654321.0)]}
    silent = TrainingMonitor(train_iters=10, log_interval=5, is_logging_rank=False, seq_length=SEQ, world_size=WORLD,
                             tensorboard_dir=str(tmp_path / "quiet"))
    silent.record_checkpoint(4, 0.25, 3.5, 1)  # other ranks write nothing
    silent.close()
    assert not (tmp_path / "quiet").exists()
