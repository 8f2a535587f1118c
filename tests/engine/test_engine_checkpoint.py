"""engine.save_checkpoint / engine.load_checkpoint on a plain nn.Module: resuming is exact."""

import pytest
import torch

import hybrid
from hybrid.topology import Topology


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))


def _engine(stage=1, offload="none", async_save=False, bucket_size=None):
    zero = {"stage": stage, "persistence_threshold": 16} if stage == 3 else {"stage": stage}
    zero["offload_optimizer"] = offload
    if bucket_size is not None:
        zero["bucket_size"] = bucket_size
    config = {"zero": zero, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
              "scheduler": {"type": "cosine", "warmup_iters": 1, "decay_iters": 8, "min_lr": 1e-3},
              "micro_batch_size": 4, "gradient_accumulation_steps": 2, "clip_grad": 1.0,
              "checkpoint": {"async_save": async_save}}
    return hybrid.initialize(_model(), config, topology=Topology.local())


def _train(engine, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps * 2):
        x = torch.randn(4, 8, generator=g)
        loss = (engine(x) - x.sum(1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "cpu")])
def test_save_then_load_continues_exactly(tmp_path, stage, offload, async_save):
    straight = _engine(stage, offload, async_save)
    _train(straight, 3, seed=1)
    straight.save_checkpoint(tmp_path)
    with straight.gathered_parameters():
        at_save = [p.detach().clone() for p in straight.module.parameters()]
    after = _train(straight, 3, seed=2)  # a background save may still be writing: it wrote its own copy
    if async_save:
        assert straight.wait_checkpoint().iteration == 3

    resumed = _engine(stage, offload)
    info = resumed.load_checkpoint(tmp_path)
    assert info["iteration"] == 3 and resumed.global_step == 3
    assert _train(resumed, 3, seed=2) == after
    with straight.gathered_parameters(), resumed.gathered_parameters():
        for a, b in zip(straight.module.parameters(), resumed.module.parameters()):
            assert torch.equal(a, b)

    weights_only = _engine(stage, offload)
    weights_only.load_checkpoint(tmp_path, load_optimizer=False)
    assert weights_only.global_step == 0
    with weights_only.gathered_parameters():
        for a, b in zip(weights_only.module.parameters(), at_save):
            assert torch.equal(a, b)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_state_saved_with_other_flat_segments_is_resharded_on_load(tmp_path, stage, monkeypatch):
    # Another zero.bucket_size cuts the flat groups into other segments, so each partition holds its elements
    # elsewhere: the same layout's load goes through resharding, and the run continues like the one that saved.
    import hybrid.engine.reshard as reshard_on_load
    from hybrid.checkpoint import CheckpointReader

    calls, original = [], reshard_on_load.load_resharded
    monkeypatch.setattr(reshard_on_load, "load_resharded", lambda *a, **k: (calls.append(1), original(*a, **k)))
    straight = _engine(stage)
    _train(straight, 3, seed=1)
    straight.save_checkpoint(tmp_path)
    after = _train(straight, 3, seed=2)

    same = _engine(stage)
    same.load_checkpoint(tmp_path)
    assert calls == [] and _train(same, 3, seed=2) == after  # the same segments: the exact path

    resumed = _engine(stage, bucket_size=10)  # elements: a segment per parameter
    assert "segment" in resumed.optimizer.index_mismatch(CheckpointReader(tmp_path).stage_param_index(0))
    info = resumed.load_checkpoint(tmp_path)
    assert calls == [1] and info["iteration"] == 3 and resumed.global_step == 3
    # The same elementwise steps on the same values; only the gradient norm's sums run over other padding and
    # blocks, a relative difference of at most about n * eps (n = 161 elements, eps = 6e-8) in the clip factor.
    assert _train(resumed, 3, seed=2) == pytest.approx(after, rel=1e-5)
