"""checkpoint.save_16bit_model (DeepSpeed's stage3_gather_16bit_weights_on_model_save): each save also writes the
whole model in the training precision beside the shards, and the checkpoint still loads."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import hybrid
from hybrid.engine.checkpoint import MODEL_16BIT_FILE
from tests.engine.test_engine_single import MLP, batches


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_each_save_writes_the_model_in_16_bits(tmp_path, precision, dtype):
    torch.manual_seed(0)
    model = MLP()
    engine = hybrid.initialize(model, {"precision": precision, "optimizer": {"lr": 1e-2}, "steps_per_print": 0,
                                       "zero": {"stage": 1}, "checkpoint": {"save_16bit_model": True}})
    x, y = batches(1, 16)[0]
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
        engine.step()
    path = engine.save_checkpoint(tmp_path)
    weights = load_file(str(path / MODEL_16BIT_FILE))
    # the model's own 16-bit weights are its fp32 masters rounded: the file holds the same values
    expected = {name: p.detach() for name, p in model.named_parameters()}
    assert set(weights) >= set(expected)
    for name, p in expected.items():
        assert weights[name].dtype == dtype and torch.equal(weights[name], p), name
    # the extra file does not stop the checkpoint from loading
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
    engine.step()
    engine.load_checkpoint(path)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_without_the_key_no_16bit_file_is_written(tmp_path):
    engine = hybrid.initialize(MLP(), {"precision": "bf16", "steps_per_print": 0})
    path = engine.save_checkpoint(tmp_path)
    assert not (path / MODEL_16BIT_FILE).exists()
