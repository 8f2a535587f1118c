"""The attention core computes its softmax in fp32 for bf16 and fp16 inputs, which Megatron's
``--attention-softmax-in-fp32`` asks for (hybrid accepts that flag for this reason).

The reference is float64 attention of the same rounded q, k, v. Megatron's fp32 softmax computes the
probabilities ``p`` in fp32 and rounds them to the input format before multiplying by v, as flash
kernels do; with fp32 sums that leaves, per output element, at most half a unit in the last place of
the output format (the final rounding), plus ``eps/2 * sum_i p_i |v_i|`` (the rounded probabilities),
plus the fp32 sums' error, below ``s * eps32 * max|v|`` for ``s`` keys. A softmax in the low format
rounds the scores before the exponential, and with scores of the size used here misses that bound by
far: the test computes that path too, to show the bound tells the two apart.
"""

import pytest
import torch

SEQ, HEADS, HEAD_DIM, BATCH = 256, 4, 16, 2


def _bound(reference: torch.Tensor, probs: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element: half an ulp of ``dtype`` at the reference's magnitude, the probabilities' rounding
    (``probs``: the exact ones), and the fp32 sums' error."""
    eps = torch.finfo(dtype).eps
    ulp = torch.exp2(torch.floor(torch.log2(reference.abs().clamp_min(torch.finfo(dtype).tiny)))) * eps
    return 0.5 * ulp + 0.5 * eps * (probs @ v.abs()) + SEQ * torch.finfo(torch.float32).eps * v.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_attention_core_keeps_its_softmax_in_fp32(dtype):
    from hybrid import Topology
    from model_zoo import GPTConfig, GPTModel

    cfg = GPTConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_heads=HEADS, seq_length=SEQ, vocab_size=64)
    attention = GPTModel(cfg, Topology.local(), dtype=dtype).layers[0].attention.eval()  # no dropout
    g = torch.Generator().manual_seed(0)
    # scores of a few units: a probability rounded to bf16/fp16 then costs more than the output's rounding
    q, k, v = (3 * torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = (q.double() @ k.double().transpose(-1, -2)) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    exact = probs @ v.double()
    bound = _bound(exact, probs, v.double(), dtype)

    got = attention._core(q, k, v).double()
    assert ((got - exact).abs() <= bound).all(), float(((got - exact).abs() / bound).max())

    low_softmax = (torch.softmax(scores.to(dtype), dim=-1).double() @ v.double()).to(dtype).double()
    assert ((low_softmax - exact).abs() > bound).any()
