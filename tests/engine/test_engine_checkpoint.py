"""engine.save_checkpoint / engine.load_checkpoint on a plain nn.Module: resuming is exact."""

import pytest
import torch

import hybrid
from hybrid.topology import Topology


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))


def _engine(stage=1, offload="none", async_save=False):
    zero = {"stage": stage, "persistence_threshold": 16} if stage == 3 else {"stage": stage}
    zero["offload_optimizer"] = offload
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
