"""Checkpoints written by earlier releases still load (``tests/fixtures``).

Each fixture holds TP=2 x DP=2 trainer checkpoints at iteration 3 under ZeRO-1
and ZeRO-3, written by ``tests/fixtures/make_legacy_checkpoint.py`` at the
commit it is named after (:data:`~tests.fixtures.make_legacy_checkpoint.FIXTURES`:
58779ff, before the ZeRO interface, configuration tree and layout type were
redesigned; 68fb09c, before the grid, the model description and the engine's
checkpoint edges were). No golden numbers are stored: the checks compare
today's code with itself around the old files.

* Same layout: resuming the old checkpoint and training 2 steps gives
  bit-identical losses to resuming it, re-saving it at once with today's code,
  and continuing from the re-saved copy; and the re-saved optimizer files hold
  the old partitions bit for bit (master weights, moments, step).
* Another layout: the ZeRO-1 checkpoint continues under ZeRO-3 and ZeRO-2 at
  TP=1 x DP=4 (resharded on load), within 1e-5 relative of the same-layout
  continuation (the layout-change standard of tests/convert).
"""

import os
import shutil

import pytest
import torch

from tests.fixtures.make_legacy_checkpoint import FIXTURES, MODEL, OUT
from tests.multiproc import run_distributed

TOL = 1e-5
NEWEST = list(FIXTURES)[-1]  # FIXTURES lists the commits oldest first


def _trainer(argv):
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(argv + ["--lr-decay-style", "cosine"])  # the 5-step cosine decay the comment in _argv means
    validate(args, world_size=int(os.environ["WORLD_SIZE"]))
    return Trainer(args)


def _run(argv):
    trainer = _trainer(argv)
    trainer.train()
    return trainer.history


def _argv(stage, tp, iters, *extra):
    out = [a for a in MODEL]
    out[out.index("--train-iters") + 1] = str(iters)
    out[out.index("--tensor-model-parallel-size") + 1] = str(tp)
    # the fixture was saved with a 3-step decay; keep the configured 5-step one at the saved position
    return out + ["--zero-stage", str(stage), "--override-opt-param-scheduler", *extra]


def _same_layout(legacy, resave_dir, stage):
    straight = _run(_argv(stage, 2, 5, "--load", legacy))
    trainer = _trainer(_argv(stage, 2, 5, "--load", legacy, "--save", resave_dir))
    trainer.save()  # at iteration 3, before any step: today's files for the old state
    trainer.engine.close()
    resumed = _run(_argv(stage, 2, 5, "--load", resave_dir))
    return straight, resumed


def _same_and_other_layouts(legacy):
    """The same-layout continuation (the reference) and continuations under ZeRO-2 and ZeRO-3 at TP=1 x DP=4."""
    reference = _run(_argv(1, 2, 5, "--load", legacy))
    return reference, {stage: _run(_argv(stage, 1, 5, "--load", legacy)) for stage in (2, 3)}


# Stage 3's exact resaves, and the older fixtures' (58779ff's ZeRO-1 files still continue in other layouts below),
# run with the slow tests (pytest -m slow), for the suite's time budget.
@pytest.mark.parametrize("commit", [c if c == NEWEST else pytest.param(c, marks=pytest.mark.slow) for c in FIXTURES])
@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_legacy_checkpoint_resumes_and_resaves_exactly(tmp_path, stage, commit):
    legacy = os.path.join(FIXTURES[commit], f"zero{stage}")
    copy = str(tmp_path / "legacy")
    shutil.copytree(legacy, copy)  # loading must not need to write into the fixture
    resave = str(tmp_path / "resaved")
    results = run_distributed(_same_layout, 4, copy, resave, stage, timeout=240)
    straight, resumed = results[0]
    assert [it for it, _ in straight] == [4, 5]
    assert resumed == straight
    old_dir, new_dir = os.path.join(copy, "iter_0000003"), os.path.join(resave, "iter_0000003")
    for name in sorted(os.listdir(old_dir)):
        if not name.startswith("optim_"):
            continue
        old = torch.load(os.path.join(old_dir, name), weights_only=True)
        new = torch.load(os.path.join(new_dir, name), weights_only=True)
        assert old["step"] == new["step"] and old["global_steps"] == new["global_steps"]
        for g_old, g_new in zip(old["groups"], new["groups"]):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(g_old[key], g_new[key]), f"{name} {key}"


@pytest.mark.slow  # the default run keeps the exact resume-and-resave of the legacy checkpoint
def test_legacy_zero1_checkpoint_continues_in_other_layouts(tmp_path):
    copy = str(tmp_path / "legacy")
    shutil.copytree(os.path.join(OUT, "zero1"), copy)
    reference, others = run_distributed(_same_and_other_layouts, 4, copy, timeout=240)[0]
    for stage, history in others.items():
        assert [it for it, _ in history] == [4, 5]
        for (_, a), (_, b) in zip(history, reference):
            assert abs(a - b) <= TOL * abs(b), f"stage {stage}: {a} vs {b}"
