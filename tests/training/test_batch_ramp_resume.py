"""The trainer with a batch-size ramp-up: run length in samples, and resuming mid-ramp (world 4, gloo, fp32).

One spawn runs the three trainers, through the trainer's Python entry points (``parse_args``, ``validate``,
``Trainer(args).train()``):

* the straight run at DP 4 (ZeRO 1), ``--rampup-batch-size 4 4 24 --global-batch-size 12 --micro-batch-size 1
  --train-samples 100``, saving every 4 iterations;
* the same flags resumed from its ``iter_0000004`` (mid-ramp) in the same layout;
* the same resumed at TP 2 x DP 2.

The ramp by hand: ``n = (12 - 4) / 4 = 2`` increments, so the step that starts after ``c`` consumed samples takes
``min(4 + 4 * floor(c * 2 / 24), 12) = min(4 + 4 * floor(c / 12), 12)`` samples; the run takes every whole global
batch that fits in 100 samples:

    iteration          1   2   3   4   5   6   7   8   9  10  11
    global batch       4   4   4   8   8  12  12  12  12  12  12
    consumed after     4   8  12  20  28  40  52  64  76  88 100

(a 12th step would need 112 samples). Iteration 4, where the resumed runs start, is inside the ramp: the next
step still takes 8 samples, only the one after reaches 12.
"""

import json
import os

import pytest

from tests.hand_lr import warmup_cosine
from tests.multiproc import run_distributed

SIZES = [4, 4, 4, 8, 8, 12, 12, 12, 12, 12, 12]
CONSUMED = [4, 8, 12, 20, 28, 40, 52, 64, 76, 88, 100]  # after each iteration
ITERS = len(SIZES)
SAVE_AT = 4  # --save-interval: checkpoints at 4 and 8, and the final one at 11
LR, MIN_LR, WARMUP_SAMPLES, TRAIN_SAMPLES = 1e-3, 1e-4, 8, 100
RAMP = ["--rampup-batch-size", "4", "4", "24", "--global-batch-size", "12", "--micro-batch-size", "1",
        "--train-samples", str(TRAIN_SAMPLES)]
# A warmup + cosine schedule in samples; its decay length is derived from --train-samples (100).
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--vocab-size", "512", "--mock-data", "--lr", str(LR), "--min-lr", str(MIN_LR),
               "--lr-decay-style", "cosine", "--lr-warmup-samples", str(WARMUP_SAMPLES), "--log-interval", "100",
               "--eval-interval", "0", "--weight-decay", "0.1", "--clip-grad", "1.0"]
DP4 = ["--tensor-model-parallel-size", "1", "--zero-stage", "1"]
TP2_DP2 = ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]


def lr_hand(consumed):
    """The rate of the step that starts after ``consumed`` samples: linear warmup over 8 samples, then cosine
    decay to MIN_LR at 100 samples."""
    return warmup_cosine(consumed, LR, MIN_LR, WARMUP_SAMPLES, TRAIN_SAMPLES)


def _train(argv):
    """One trainer run; returns what it reports per iteration (the monitor's records) and its final counts."""
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(argv)
    validate(args, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    records = []
    record = trainer.monitor.record

    def recording(metrics):  # every iteration's figures, as the console line shows them
        records.append((metrics.iteration, metrics.batch_size, metrics.consumed_samples, metrics.learning_rate))
        return record(metrics)

    trainer.monitor.record = recording
    start = {"iteration": trainer.iteration, "consumed": trainer.consumed_samples,
             "accum": trainer.engine.gradient_accumulation_steps, "train_iters": trainer.train_iters}
    last = trainer.train()
    return {"history": trainer.history, "records": records, "start": start, "last": last,
            "consumed": trainer.consumed_samples, "dp": trainer.topology.dp_size, "tp": trainer.topology.tp_size}


def _runs(save_dir):
    at = os.path.join(save_dir, f"iter_{SAVE_AT:07d}")
    return {"straight": _train(SMALL_MODEL + RAMP + DP4 + ["--save", save_dir, "--save-interval", str(SAVE_AT)]),
            "same_layout": _train(SMALL_MODEL + RAMP + DP4 + ["--load", at]),
            "tp2_dp2": _train(SMALL_MODEL + RAMP + TP2_DP2 + ["--load", at])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("ramp") / "ckpt"
    return run_distributed(_runs, 4, str(save_dir), timeout=300), save_dir


def _metadata(save_dir, iteration):
    with open(os.path.join(save_dir, f"iter_{iteration:07d}", "metadata.json")) as f:
        return json.load(f)


def _expected_records(first):
    """(iteration, global batch, consumed after, learning rate) of iterations ``first``.. by hand."""
    return [(i + 1, SIZES[i], CONSUMED[i], lr_hand(CONSUMED[i] - SIZES[i])) for i in range(first, ITERS)]


def _assert_records(got, want):
    assert [r[:3] for r in got] == [r[:3] for r in want]
    for (it, *_, lr), (*_, want_lr) in zip(got, want):
        assert lr == pytest.approx(want_lr, rel=1e-12), it


def test_train_samples_with_a_ramp_takes_the_hand_computed_iterations(runs):
    results, save_dir = runs
    for r in results:
        straight = r["straight"]
        assert straight["dp"] == 4
        assert straight["start"] == {"iteration": 0, "consumed": 0, "accum": 1, "train_iters": ITERS}
        assert straight["last"] == ITERS
        assert [it for it, _ in straight["history"]] == list(range(1, ITERS + 1))
        assert straight["consumed"] == TRAIN_SAMPLES
        # every iteration's global batch, consumed count and learning rate (in samples) as computed by hand
        _assert_records(straight["records"], _expected_records(0))
    # every rank reports the same DP-averaged losses
    assert all(r["straight"]["history"] == results[0]["straight"]["history"] for r in results)
    # the checkpoints record the samples consumed up to them
    assert {d for d in os.listdir(save_dir) if d.startswith("iter_")} == {"iter_0000004", "iter_0000008",
                                                                           "iter_0000011"}
    for iteration in (4, 8, 11):
        meta = _metadata(save_dir, iteration)
        assert meta["consumed_samples"] == CONSUMED[iteration - 1], (iteration, meta["consumed_samples"])


def test_resume_mid_ramp_in_the_same_layout_is_bit_identical(runs):
    results, _ = runs
    for r in results:
        straight, resumed = r["straight"], r["same_layout"]
        # it starts where the checkpoint left off: 20 samples, the next global batch 8 (2 micro-batches per rank)
        assert resumed["start"] == {"iteration": SAVE_AT, "consumed": 20, "accum": 2, "train_iters": ITERS}
        assert [it for it, _ in resumed["history"]] == list(range(SAVE_AT + 1, ITERS + 1))
        assert resumed["consumed"] == TRAIN_SAMPLES
        _assert_records(resumed["records"], _expected_records(SAVE_AT))
        # Bit-identical, not approximately equal.
        assert [loss for _, loss in resumed["history"]] == [loss for _, loss in straight["history"][SAVE_AT:]]


# Across layouts the arithmetic is the same but for its order (TP splits the matmuls and the loss over two ranks;
# DP 2 instead of 4 adds the micro-batch gradients in another order), so the losses agree to rounding rather than
# bit for bit. The first resumed step starts from bit-identical weights, so its loss differs by the forward's
# rounding alone: tests/numerics.transformer_bound puts the normwise worst case at 1.4e-4 relative for this model,
# and the errors it has been measured against are at most 5e-3 of such bounds (~7e-7). Later steps add what Adam
# makes of the gradients' rounding. The bound is that of the layout-change suite (tests/convert/
# test_layout_change.py, 1e-5 relative on every loss after a reshard): measured here, the losses are 0 or one
# fp32 ulp (7.6e-8 relative) apart. Resuming on the wrong samples is far outside it: a resume whose sample count
# restarted at 0 (the library patched in a scratch run) moved the seven losses by 6e-4 to 4.6e-2 relative, and on
# this mock data consecutive iterations' losses differ by 3e-4 to 4e-3.
CROSS_LAYOUT_TOL = 1e-5


def test_resume_mid_ramp_in_another_layout_continues_the_ramp(runs):
    results, _ = runs
    for r in results:
        straight, resumed = r["straight"], r["tp2_dp2"]
        assert (resumed["tp"], resumed["dp"]) == (2, 2)
        # the same 20 samples consumed, the same next global batch of 8: now 4 micro-batches per DP rank
        assert resumed["start"] == {"iteration": SAVE_AT, "consumed": 20, "accum": 4, "train_iters": ITERS}
        assert [it for it, _ in resumed["history"]] == list(range(SAVE_AT + 1, ITERS + 1))
        assert resumed["consumed"] == TRAIN_SAMPLES
        _assert_records(resumed["records"], _expected_records(SAVE_AT))
        for (it, got), (_, want) in zip(resumed["history"], straight["history"][SAVE_AT:]):
            assert abs(got - want) <= CROSS_LAYOUT_TOL * abs(want), (it, got, want)
