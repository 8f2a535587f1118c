"""Tensor-parallel pieces that need no peers: loss, recompute RNG replay, init, and error messages."""

import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hybrid import param_meta
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hybrid.tensor_parallel.norms import LayerNorm, RMSNorm
from hybrid.tensor_parallel.random import RNGTracker, checkpoint
from hybrid.topology import Topology
from tests.numerics import cross_entropy_bounds, layer_norm_bound, max_ratio, unit_roundoff

LOCAL = Topology.local()


def _fake_topology(tp: int, rank: int = 0):
    # Constructors only read the sizes; enough to exercise their validation.
    return types.SimpleNamespace(tp_size=tp, tp_rank=rank, pp_rank=0)


# ---- cross entropy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_torch(eps, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 3, 40, generator=g) * 4).to(dtype).requires_grad_(True)
    target = torch.randint(0, 37, (5, 3), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target, LOCAL, vocab_size=37, label_smoothing=eps)
    # Against torch in float64 on the same (exactly widened) logits, within the fp32 rounding bound.
    ref_logits = logits.detach().double()[..., :37].requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, 37), target.reshape(-1), label_smoothing=eps,
                          reduction="none").view(5, 3)
    weights = torch.randn(5, 3, generator=g)
    loss_bound, grad_bound = cross_entropy_bounds(logits, target, 37, eps, grad_weight=weights)
    assert max_ratio(loss, ref, loss_bound) <= 1
    (loss * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    assert logits.grad.dtype == dtype
    if dtype != torch.float32:  # the fp32 gradient is rounded to the logits' dtype last
        grad_bound = grad_bound + unit_roundoff(dtype) * (ref_logits.grad.abs() + grad_bound)
    assert max_ratio(logits.grad[..., :37], ref_logits.grad, grad_bound) <= 1
    assert torch.equal(logits.grad[..., 37:], torch.zeros_like(logits.grad[..., 37:]))  # padding never predicted


def test_cross_entropy_reductions_and_mask():
    # The reductions run the same ops on the same per-token losses as these lines: equal to the bit.
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(4, 6, 16, generator=g), torch.randint(0, 16, (4, 6), generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.5).float()
    per_token = vocab_parallel_cross_entropy(logits, target, LOCAL)
    assert torch.equal(vocab_parallel_cross_entropy(logits, target, LOCAL, reduction="sum"), per_token.sum())
    assert torch.equal(vocab_parallel_cross_entropy(logits, target, LOCAL, loss_mask=mask, reduction="mean"),
                       (per_token * mask).sum() / mask.sum())
    assert torch.equal(vocab_parallel_cross_entropy(logits, target, LOCAL, loss_mask=mask), per_token * mask)


def test_cross_entropy_errors():
    logits, target = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target shape \\(2, 4\\) must equal"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), LOCAL)
    with pytest.raises(ValueError, match="vocab_size=9 must be in \\[1, 8\\]"):
        vocab_parallel_cross_entropy(logits, target, LOCAL, vocab_size=9)
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\)"):
        vocab_parallel_cross_entropy(logits, target, LOCAL, label_smoothing=1.0)
    with pytest.raises(ValueError, match="target ids must lie in \\[0, vocab_size=6\\)"):
        vocab_parallel_cross_entropy(logits, target + 7, LOCAL, vocab_size=6)
    with pytest.raises(ValueError, match="reduction must be one of"):
        vocab_parallel_cross_entropy(logits, target, LOCAL, reduction="avg")


# ---- RNG tracker and recompute -------------------------------------------------------------------------
def _dropout_fn(tracker, w):
    def fn(x):
        with tracker.fork("tp"):
            h = F.dropout(x @ w, 0.5, training=True)
        with tracker.fork("shared"):
            return F.dropout(torch.tanh(h), 0.5, training=True)
    return fn


def _run(wrap, tracker, w, x):
    tracker.set_states({})
    w.grad = None
    y = wrap(_dropout_fn(tracker, w), x)
    # Later layers draw from the streams before backward reaches this one.
    with tracker.fork("tp"), tracker.fork("shared"):
        torch.rand(7)
    states_before_backward = tracker.get_states()
    y.sum().backward()
    return y.detach(), w.grad.clone(), states_before_backward


def test_checkpoint_replays_tracker_streams():
    tracker = RNGTracker(3, LOCAL)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 8, generator=g).requires_grad_(True), torch.randn(4, 8, generator=g)
    y_ref, g_ref, _ = _run(lambda f, x: f(x), tracker, w, x)
    y_ck, g_ck, states = _run(lambda f, x: checkpoint(f, x, tracker=tracker), tracker, w, x)
    assert torch.equal(y_ref, y_ck) and torch.equal(g_ref, g_ck)
    # The recompute put the streams back where backward found them.
    after = tracker.get_states()
    assert after.keys() == states.keys() and all(torch.equal(after[k], states[k]) for k in after)
    # Without the replay the recomputed masks would differ: the check above is not vacuous.
    _, g_plain, _ = _run(lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False), tracker, w, x)
    assert not torch.equal(g_ref, g_plain)


def test_tracker_rejects_unknown_stream():
    with pytest.raises(ValueError, match="unknown random stream 'data'"):
        with RNGTracker(0, LOCAL).fork("data"):
            pass


# ---- layout-invariant init --------------------------------------------------------------------------------
def test_seed_for_is_pinned():
    # The initial weights of every saved run hang on this value: sha256-based, so it does not
    # depend on the process (Python's own hash() is salted per process) and must never change.
    assert tp_init.seed_for(7, "layers.0.attention.qkv_proj.weight") == 13844323363424681115
    assert tp_init.seed_for(7, "a") != tp_init.seed_for(7, "b") != tp_init.seed_for(8, "b")


def test_local_init_tensor_is_a_shard_of_the_full_tensor():
    layer = ColumnParallelLinear(8, 24, _fake_topology(4, 2), stride=3)
    piece = tp_init.local_init_tensor(layer.weight, "w", 0, tp_size=4, tp_rank=2)
    full = tp_init.full_init_tensor(layer.weight, "w", 0, tp_size=4)
    assert full.shape == (24, 8) and piece.shape == (6, 8)
    assert torch.equal(piece, torch.cat([full[2 * 2:2 * 2 + 2], full[8 + 4:8 + 6], full[16 + 4:16 + 6]]))


def test_materialize_keeps_shared_parameters_shared():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = VocabParallelEmbedding(10, 4, LOCAL, device="meta")
            self.b = nn.Module()
            self.b.weight = self.a.weight

    m = tp_init.materialize(Tied(), 0, LOCAL, device="cpu")
    assert m.a.weight is m.b.weight and not m.a.weight.is_meta
    assert param_meta.get_tp_meta(m.a.weight).logical_size == 10
    assert tp_init.get_initializer(m.a.weight).kind == "normal"


def test_initializer_errors():
    with pytest.raises(ValueError, match="unknown initializer kind 'uniform'"):
        tp_init.Initializer("uniform")
    with pytest.raises(ValueError, match="no recorded initializer"):
        tp_init.materialize(nn.Linear(2, 2), 0, LOCAL)


# ---- layer construction errors ----------------------------------------------------------------------------
def test_layer_errors_name_the_divisibility():
    with pytest.raises(ValueError, match="out_features=12 must be divisible by stride\\*tp = 3\\*8 = 24"):
        ColumnParallelLinear(4, 12, _fake_topology(8), stride=3)
    with pytest.raises(ValueError, match="in_features=10 must be divisible by the tensor-parallel size tp=4"):
        RowParallelLinear(10, 4, _fake_topology(4))
    with pytest.raises(ValueError, match="gather_output=True with stride=2"):
        ColumnParallelLinear(4, 8, LOCAL, stride=2, gather_output=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(4, 4, LOCAL, input_is_parallel=False, sequence_parallel=True)


def test_vocab_padding_per_tp_size():
    for tp, rank in ((1, 0), (2, 1), (4, 3), (8, 5)):
        emb = VocabParallelEmbedding(50257, 4, _fake_topology(tp, rank), device="meta")
        assert emb.padded_size % (128 * tp) == 0 and emb.padded_size - 50257 < 128 * tp
        assert emb.weight.shape == (emb.padded_size // tp, 4)


# ---- norms ---------------------------------------------------------------------------------------------------
def test_norms_match_reference_formulas():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 16, generator=g).to(torch.bfloat16)
    rms = tp_init.materialize(RMSNorm(16, LOCAL, eps=1e-6), 0, LOCAL)
    with torch.no_grad():
        rms.weight.normal_(generator=g)
    x32 = x.float()
    ref = rms.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms(x), ref)
    ln = tp_init.materialize(LayerNorm(16, LOCAL, eps=1e-5), 0, LOCAL)
    x64 = x32.double()
    ref = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    assert max_ratio(ln(x32), ref, layer_norm_bound(x32, None, None, 1e-5)) <= 1
