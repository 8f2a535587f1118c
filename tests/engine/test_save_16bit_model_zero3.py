"""checkpoint.save_16bit_model at ZeRO stage 3 on two ranks (DeepSpeed's stage3_gather_16bit_weights_on_model_save):
the file holds every whole parameter, equal to the weights the ranks gather (engine.gathered_parameters), which are
the bf16 parameters themselves, so equality is exact."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hybrid
from hybrid import Topology
from tests.engine.test_engine_single import MLP, batches
from tests.multiproc import run_distributed


def _train_and_save(folder):
    from safetensors.torch import load_file

    from hybrid.engine.checkpoint import MODEL_16BIT_FILE

    torch.manual_seed(0)
    model = MLP()
    engine = hybrid.initialize(model, {"precision": "bf16", "optimizer": {"lr": 1e-2}, "steps_per_print": 0,
                                       "zero": {"stage": 3, "persistence_threshold": 0},
                                       "checkpoint": {"save_16bit_model": True}}, topology=Topology())
    x, y = batches(1, 16)[0]
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    path = engine.save_checkpoint(folder)
    with engine.gathered_parameters():
        gathered = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}
    saved = {n: t.float().numpy() for n, t in load_file(str(path / MODEL_16BIT_FILE)).items()}
    dtypes = {str(t.dtype) for t in load_file(str(path / MODEL_16BIT_FILE)).values()}
    return gathered, saved, dtypes


@pytest.mark.slow  # two processes
def test_two_ranks_at_zero_3_write_every_whole_parameter(tmp_path):
    results = run_distributed(_train_and_save, 2, str(tmp_path), timeout=180)
    for gathered, saved, dtypes in results:
        assert dtypes == {"torch.bfloat16"} and set(saved) == set(gathered)
        for name, value in gathered.items():
            assert saved[name].shape == value.shape and np.array_equal(saved[name], value), name
