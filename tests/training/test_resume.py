"""Resuming in the same layout is exact: losses after --load are bit-identical to an uninterrupted run."""

import os

import pytest

from tests.multiproc import run_distributed

SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--vocab-size", "512", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
               "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "100", "--eval-interval", "0",
               "--weight-decay", "0.1", "--clip-grad", "1.0"]


def _train(argv):
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(argv)
    validate(args, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    trainer.train()
    return trainer.history, trainer.run_profile


def _straight_then_resumed(save_dir, zero_stage, k, extra=()):
    # --async-save is how the saving run saves; the resumed run saves nothing (and may not ask for it)
    saving = [a for a in extra if a in ASYNC]
    layout = ["--tensor-model-parallel-size", "2", "--zero-stage", str(zero_stage),
              *(a for a in extra if a not in saving)]
    straight = _train(SMALL_MODEL + layout + saving + ["--train-iters", str(2 * k), "--save", save_dir,
                                                       "--save-interval", str(k)])
    resumed = _train(SMALL_MODEL + layout + ["--train-iters", str(2 * k),
                                             "--load", os.path.join(save_dir, f"iter_{k:07d}")])
    return straight, resumed


# quantized: the weights every rank computes with are the dequantized gather of the masters, so a resume
# that restores the masters must gather them again the same way
QUANTIZED = ("--zero-quantized-gradients", "int4", "--zero-quantized-weights", "int8")


# Saving synchronously and in the background (--async-save) both resume exactly; each layout runs with one of
# them in the default run (the process start-up dominates), the other under -m slow.
ASYNC = ("--async-save",)


@pytest.mark.parametrize("zero_stage,extra", [
    pytest.param(1, (), id="z1"), pytest.param(2, ASYNC, id="z2-async"), pytest.param(2, QUANTIZED, id="z2-quantized", marks=pytest.mark.slow),
    pytest.param(1, ASYNC, id="z1-async", marks=pytest.mark.slow), pytest.param(2, (), id="z2", marks=pytest.mark.slow),
    pytest.param(2, QUANTIZED + ASYNC, id="z2-quantized-async", marks=pytest.mark.slow)])
def test_resume_is_bit_identical(tmp_path, zero_stage, extra):
    k = 3
    results = run_distributed(_straight_then_resumed, 4, str(tmp_path / "ckpt"), zero_stage, k, extra,
                              timeout=240)
    (straight, profile), (resumed, _) = results[0]
    assert [it for it, _ in straight] == list(range(1, 2 * k + 1))
    assert [it for it, _ in resumed] == list(range(k + 1, 2 * k + 1))
    # Bit-identical, not approximately equal.
    assert [loss for _, loss in resumed] == [loss for _, loss in straight[k:]]
    # Every rank saw the same DP-averaged losses.
    assert all([h for h, _ in r] == [h for h, _ in results[0]] for r in results)
    # The closing profile: iterations after the first, exposed communication within the iteration, every rank's RSS.
    assert profile["iterations_measured"] == 2 * k - 1
    assert 0 < profile["exposed_comm_ms_median"] < profile["iteration_ms_median"]
    assert profile["compute_ms_median"] == pytest.approx(
        profile["iteration_ms_median"] - profile["exposed_comm_ms_median"], abs=0.01)
    assert len(profile["peak_rss_mib"]) == 4 and all(m > 50 for m in profile["peak_rss_mib"])
