"""Deterministic per-rank checkpoint contents shared by the checkpoint tests."""

from __future__ import annotations

import os
import signal
from typing import Any, Dict

import torch

from hybrid.checkpoint import save_checkpoint
from hybrid.layout import ParallelLayout


def model_shard(tp_rank: int, scale: float = 1.0) -> Dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s weights: identical on every DP rank of that TP rank."""
    g = torch.Generator().manual_seed(1000 + tp_rank)
    return {
        "embedding.weight": (torch.randn(16, 8, generator=g) * scale).to(torch.bfloat16),
        "layers.0.qkv.weight": torch.randn(12, 8, generator=g) * scale,
        "layers.0.qkv.bias": torch.randn(12, generator=g) * scale,
        "layers.0.proj.weight": (torch.randn(8, 4, generator=g) * scale).t(),  # non-contiguous
        "final_norm.weight": torch.ones(8) * scale,
    }


def optimizer_shard(tp_rank: int, dp_rank: int, step: int = 3) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(2000 + 10 * tp_rank + dp_rank)
    return {
        "flat": {"master": torch.randn(40, generator=g), "exp_avg": torch.randn(40, generator=g),
                 "exp_avg_sq": torch.rand(40, generator=g)},
        "step": step,
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "name": "decay"}],
    }


def manifest_fields(iteration: int) -> Dict[str, Any]:
    return {
        "consumed_samples": 16 * iteration,
        "model_config": {"num_layers": 1, "hidden_size": 8, "vocab_size": 32},
        "param_index": {"layers.0.qkv.weight": {"shape": [24, 8], "tp_dim": 0, "tp_stride": 3,
                                                "offset": 0, "numel": 96}},
        "trainer_state": {"lr_scheduler": {"num_steps": iteration}, "loss_scaler": {"scale": 1.0}},
    }


def save_rank(save_dir, iteration: int, layout: ParallelLayout, coord, *, gather=None,
              keep_last=None, scale: float = 1.0):
    kwargs = {} if gather is None else {"all_gather_object": gather}
    return save_checkpoint(save_dir, iteration, layout, coord,
                           model_state=model_shard(coord.tp, scale),
                           optimizer_state=optimizer_shard(coord.tp, coord.dp, step=iteration),
                           rank_state={"rng": torch.tensor([coord.tp, coord.dp, iteration])},
                           keep_last=keep_last, **kwargs, **manifest_fields(iteration))


def kill_self_after(nbytes: int) -> None:
    """Make this process die by SIGKILL once it has written ``nbytes`` checkpoint bytes."""
    from hybrid.checkpoint import atomic

    written = [0]
    original = atomic.AtomicHashedFile.write

    def write(self, data):
        view = memoryview(data).cast("B")
        room = nbytes - written[0]
        if view.nbytes >= room:
            original(self, view[:max(room, 0)])
            self._file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        written[0] += view.nbytes
        return original(self, view)

    atomic.AtomicHashedFile.write = write


def assert_state_equal(actual, expected, where="state") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where
