"""The trainer settings stored in checkpoints read the same in today's nested form and the earlier flat one."""

import json
from pathlib import Path

import pytest

from hybrid.config import config_from_dict, saved_setting, saved_tree, to_plain

LEGACY = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_checkpoint"


def _legacy_args(stage):
    meta = json.loads((LEGACY / f"zero{stage}" / "iter_0000003" / "metadata.json").read_text())
    return meta["trainer_state"]["client"]["args"]


@pytest.mark.parametrize("stage", [1, 3])
def test_legacy_flat_args_read_as_keys(stage):
    args = _legacy_args(stage)
    assert "zero_bucket_size" in args  # the earlier, flat form
    expected = {"zero.stage": stage, "zero.bucket_size": 25_000_000, "zero.offload_optimizer": "none",
                "tensor_parallel_size": 2, "micro_batch_size": 1, "global_batch_size": 4, "run.train_iters": 3,
                "optimizer.lr": 1e-3, "optimizer.betas": [0.9, 0.999], "scheduler.type": "cosine",
                "scheduler.warmup_iters": 1, "loss_scaling.initial_scale_power": 16, "model.num_layers": 1,
                "data.mock": True, "data.path": []}
    for key, value in expected.items():
        assert saved_setting(args, key) == value, key
    # unset (null) and never-stored settings fall back to the caller's default
    assert saved_setting(args, "data.tokenizer_model", "none") == "none"
    assert saved_setting(args, "precision") is None  # bf16: false, fp16: false set nothing
    assert saved_setting(args, "use_fused_kernels", True) is True  # no_fused_kernels: false sets nothing
    assert saved_setting(args, "scheduler.decay_iters") is None


def test_nested_args_read_as_keys():
    cfg = config_from_dict({"zero": {"stage": 2, "bucket_size": 1000}, "micro_batch_size": 2,
                                  "data": {"tokenizer_model": "tok.model"}})
    args = to_plain(cfg)
    assert saved_tree(args) == args
    assert saved_setting(args, "zero.bucket_size") == 1000
    assert saved_setting(args, "data.tokenizer_model") == "tok.model"
    assert saved_setting(args, "micro_batch_size") == 2
    assert saved_setting(args, "global_batch_size", 8) == 8
    assert saved_setting(None, "zero.stage", 0) == 0 and saved_tree({}) == {}
