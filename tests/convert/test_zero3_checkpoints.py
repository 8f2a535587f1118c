"""ZeRO-3 checkpoints through the trainer, on 4 gloo ranks, fp32 unless named, in one spawn.

* A stage-3 run at TP=2 x DP=2 trains like the stage-2 run of the same layout,
  and resuming it from its own checkpoint is bit-identical to not stopping
  (bf16 at TP=1 x DP=4 too: the weights are the rounded fp32 masters).
* Its checkpoint continues at TP=1 x DP=4 under stage 1 and, resharded
  offline, at TP=4 x DP=1 under stage 0; a stage-2 checkpoint continues under
  stage 3 at TP=1 x DP=4. Each matches the uninterrupted run within 1e-5.
* A weights-only load (--finetune) into stage 3 starts from the saved weights
  exactly, and the fp32 export of a stage-3 checkpoint equals the gathered model.
"""

import os

import numpy as np
import pytest
from safetensors.torch import load_file

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.fp32 import export_fp32
from tests.convert.test_layout_change import (K, SMALL_MODEL, _assert_losses_close, _assert_weights_close, _layout,
                                              _run)
from tests.multiproc import run_distributed


def _all_runs(root):
    import torch.distributed as dist

    from hybrid.convert.reshard import reshard_checkpoint

    out = {}
    s2, s3, bf16 = (os.path.join(root, d) for d in ("s2", "s3", "bf16"))
    save_at_k = ["--save-interval", str(K)]
    out["s2"] = _run(SMALL_MODEL + _layout(2, 2) + ["--save", s2] + save_at_k)
    out["s3"] = _run(SMALL_MODEL + _layout(2, 3) + ["--save", s3] + save_at_k)
    s2_k, s3_k = (os.path.join(d, f"iter_{K:07d}") for d in (s2, s3))
    out["s3_resume"] = _run(SMALL_MODEL + _layout(2, 3) + ["--load", s3_k])
    out["s3_to_tp1_s1"] = _run(SMALL_MODEL + _layout(1, 1) + ["--load", s3_k])
    out["s2_to_tp1_s3"] = _run(SMALL_MODEL + _layout(1, 3) + ["--load", s2_k])
    if dist.get_rank() == 0:
        reshard_checkpoint(s3_k, os.path.join(root, "offline"), target_tp=4, target_dp=1, target_zero_stage=0)
    dist.barrier()
    out["s3_offline_tp4_s0"] = _run(SMALL_MODEL + _layout(4, 0) + ["--load", os.path.join(root, "offline")])
    out["finetune_s3"] = _run(SMALL_MODEL + _layout(1, 3) + ["--load", s2_k, "--finetune"], weights_before=True)
    out["bf16"] = _run(SMALL_MODEL + _layout(1, 3) + ["--bf16", "--save", bf16] + save_at_k)
    out["bf16_resume"] = _run(SMALL_MODEL + _layout(1, 3) + ["--bf16", "--load", os.path.join(bf16, f"iter_{K:07d}")])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3_ckpt")
    return run_distributed(_all_runs, 4, str(root), timeout=280)[0], root


def _assert_identical(a, b):
    assert a["losses"] == b["losses"][K:]
    assert a["weights"].keys() == b["weights"].keys()
    assert all(np.array_equal(a["weights"][n], b["weights"][n]) for n in b["weights"])


def test_stage3_trains_like_stage2_and_resumes_bit_exactly(runs):
    out, root = runs
    _assert_losses_close(out["s3"]["losses"][:K], out["s2"]["losses"][:K])
    _assert_weights_close(out["s3"]["weights"], out["s2"]["weights"])
    assert CheckpointReader(root / "s3" / f"iter_{K:07d}").layout.zero_stage == 3
    assert out["s3_resume"]["iterations"] == list(range(K + 1, 2 * K + 1))
    _assert_identical(out["s3_resume"], out["s3"])


def test_bf16_stage3_resumes_bit_exactly(runs):
    out, _ = runs
    _assert_identical(out["bf16_resume"], out["bf16"])


@pytest.mark.parametrize("key", ["s3_to_tp1_s1", "s2_to_tp1_s3", "s3_offline_tp4_s0"])
def test_stage3_checkpoints_load_into_any_layout_and_back(runs, key):
    out, _ = runs
    reference = out["s3"] if key.startswith("s3") else out["s2"]
    assert out[key]["iterations"] == list(range(K + 1, 2 * K + 1))
    _assert_losses_close(out[key]["losses"], reference["losses"][K:])
    _assert_weights_close(out[key]["weights"], reference["weights"])


def test_weights_only_load_into_stage3_starts_from_the_saved_weights(runs):
    out, root = runs
    saved = load_file(export_fp32(root / "s2" / f"iter_{K:07d}", root / "s2_k.safetensors"))
    before = out["finetune_s3"]["before"]
    assert before.keys() == saved.keys()
    assert all(np.array_equal(before[n], saved[n].numpy()) for n in saved)
    assert out["finetune_s3"]["iterations"] == list(range(1, 2 * K + 1))


def test_fp32_export_of_a_stage3_checkpoint_equals_the_gathered_model(runs):
    out, root = runs
    got = load_file(export_fp32(root / "s3", root / "s3_final.safetensors"))
    want = out["s3"]["weights"]
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[n].numpy(), want[n]) for n in want)
