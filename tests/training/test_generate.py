import pytest
import torch

from hybrid.topology import Topology
from hybrid.training.generate import _filter_logits, generate
from model_zoo import GPTConfig, GPTModel


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(_filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False]
    # top-p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it.
    assert torch.isfinite(_filter_logits(logits, 0, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter_logits(logits, 0, 0.9)).tolist() == [True, True, True, False]
    assert torch.isfinite(_filter_logits(logits, 0, 1.0)).all()


def test_greedy_generation_follows_the_argmax_and_stops_at_eod():
    config = GPTConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, seq_length=16)
    model = GPTModel(config, Topology.local(), seed=3).eval()
    out = generate(model, [1, 2, 3], 5, greedy=True)
    ids = [1, 2, 3]
    for _ in range(5):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[3:]
    assert generate(model, [1, 2, 3], 5, greedy=True, eod_id=out[0]) == out[:1]
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], 3)
