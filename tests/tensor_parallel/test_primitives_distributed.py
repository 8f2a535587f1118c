"""Each tensor-parallel primitive against plain single-process PyTorch, on 4 gloo ranks.

One spawn runs every check at TP=2 and TP=4 and returns, per check, the
largest ratio of the deviation from a float64 single-process reference to the
rounding bound derived for it in :mod:`tests.numerics` (or a boolean); the
tests assert the ratios are <= 1. Pure data movement (scatter, gather,
lookups) has a zero bound: it must be exact.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid import param_meta
from hybrid.tensor_parallel import mappings as m
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.gather import gather_full, gather_pieces
from hybrid.tensor_parallel.init import materialize
from hybrid.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hybrid.tensor_parallel.random import RNGTracker
from hybrid.topology import Topology
from model_zoo import GPTConfig, GPTModel
from tests.multiproc import run_distributed
from tests.numerics import (ELEMENTARY, EXACT, U, cross_entropy_bounds, linear_bounds, masked_mean_bound, matmul_bound,
                            max_ratio, sum_bound)

S, B, H = 8, 2, 8


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mapping_checks(topo: Topology, out: dict, tag: str) -> None:
    n, r = topo.tp_size, topo.tp_rank
    full = _randn(0, S, B, H)
    per_rank = [_randn(100 + i, S, B, H) for i in range(n)]  # rank i's own tensor, known to every rank
    stacked = torch.stack(per_rank)
    total = stacked.double().sum(0)  # exact for 2 or 4 terms
    # The all-reduce adds them in its own order. With only 1-3 additions the worst case (a sum
    # just above a power of two) is reached: ratios near 1 are expected here and cannot pass it.
    total_bound = sum_bound(stacked, 0)

    def run(fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x, topo)
        y.backward(grad)
        return y.detach(), x.grad

    def seq(t):
        return t.chunk(n, 0)[r]

    y, gx = run(m.copy_to_tp_region, full, per_rank[r])
    out[f"{tag}/copy"] = max(max_ratio(y, full, EXACT), max_ratio(gx, total, total_bound))
    y, gx = run(m.reduce_from_tp_region, per_rank[r], full)
    out[f"{tag}/reduce"] = max(max_ratio(y, total, total_bound), max_ratio(gx, full, EXACT))

    chunks = [g.chunk(n, dim=-1)[i] for i, g in enumerate(per_rank)]
    y, gx = run(m.scatter_to_tp_region, full, chunks[r])
    out[f"{tag}/scatter_last"] = max(max_ratio(y, full.chunk(n, -1)[r], EXACT),
                                     max_ratio(gx, torch.cat(chunks, -1), EXACT))
    y, gx = run(m.gather_from_tp_region, full.chunk(n, -1)[r], per_rank[r])
    out[f"{tag}/gather_last"] = max(max_ratio(y, full, EXACT),
                                    max_ratio(gx, per_rank[r].chunk(n, -1)[r], EXACT))

    seq_chunks = [g.chunk(n, dim=0)[i] for i, g in enumerate(per_rank)]
    y, gx = run(m.scatter_to_sequence_parallel_region, full, seq_chunks[r])
    out[f"{tag}/scatter_seq"] = max(max_ratio(y, seq(full), EXACT), max_ratio(gx, torch.cat(seq_chunks, 0), EXACT))
    y, gx = run(m.gather_from_sequence_parallel_region, seq(full), per_rank[r])
    out[f"{tag}/gather_seq"] = max(max_ratio(y, full, EXACT), max_ratio(gx, seq(total), seq(total_bound)))
    y, gx = run(lambda x, t: m.gather_from_sequence_parallel_region(x, t, reduce_scatter_grad=False),
                seq(full), full)
    out[f"{tag}/gather_seq_split_grad"] = max(max_ratio(y, full, EXACT), max_ratio(gx, seq(full), EXACT))
    y, gx = run(m.reduce_scatter_to_sequence_parallel_region, per_rank[r], seq_chunks[r])
    out[f"{tag}/reduce_scatter_seq"] = max(max_ratio(y, seq(total), seq(total_bound)),
                                           max_ratio(gx, torch.cat(seq_chunks, 0), EXACT))


def _grad_ratios(layer, ref, topo, bounds) -> float:
    """Each parameter's gathered gradient against the float64 reference's, one bound per parameter."""
    local = Topology.local()
    params = list(zip(layer.parameters(), ref.parameters()))
    assert len(params) == len(bounds)
    return max(max_ratio(gather_full(p.grad, param_meta.get_tp_meta(p), topo),
                         gather_full(q.grad, param_meta.get_tp_meta(q), local), bound)
               for (p, q), bound in zip(params, bounds))


def _param_bounds(bounds: dict) -> list:
    return [bounds["grad_weight"]] + ([] if bounds["grad_bias"] is None else [bounds["grad_bias"]])


# GELU (erf form) in a chain: it passes its input's error on times its slope, |gelu'| <= 1.13 (the
# maximum, at x = sqrt(2)), and its backward also sees the input's error through |gelu''| <= 2 phi(0)
# < 0.8. Its own rounding: erf and exp err by a few ulp of numbers of order one, which
# 0.5 * h * (1 + erf) turns into an absolute error of a few u times (|gelu(h)| + |h|) (measured: 3 u),
# and gelu' = Phi(h) + h phi(h) into a few u times 1 + |h| phi(h) <= 1.25 (measured: 4.6 u).
GELU_LIP, GELU_CURV = 1.13, 0.8


def _gelu_grad64(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(h / math.sqrt(2))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)


def _layer_checks(topo: Topology, out: dict, tag: str) -> None:
    n, r, local = topo.tp_size, topo.tp_rank, Topology.local()
    x_full, weight_out = _randn(1, S, B, H), _randn(2, S, B, 12)

    def pair(cls, *args, **kw):
        """The TP layer (fp32) and a single-process float64 copy of the same initial weights."""
        layer = materialize(cls(*args, topo, **kw), 3, topo)
        ref_kw = {k: v for k, v in kw.items() if k != "sequence_parallel"}
        ref = materialize(cls(*args, local, **ref_kw), 3, local).double()
        return layer, ref

    def fwd_bwd(module, x, grad):
        x = x.clone().requires_grad_(True)
        y = module(x)
        (y * grad).sum().backward()
        return y.detach(), x

    def fwd_bwd64(module, x, grad):
        return fwd_bwd(module, x.double(), grad.double())

    def layer_ratio(layer, ref, x, grad):
        y, xg = fwd_bwd(layer, x, grad)
        yr, xr = fwd_bwd64(ref, x, grad)
        bounds = linear_bounds(x, ref.weight, ref.bias, grad)
        return max(max_ratio(y, yr, bounds["y"]), max_ratio(xg.grad, xr.grad, bounds["grad_x"]),
                   _grad_ratios(layer, ref, topo, _param_bounds(bounds)))

    # Column, gathered output: x.grad sums 12 outputs, split over the ranks and all-reduced.
    out[f"{tag}/column"] = layer_ratio(*pair(ColumnParallelLinear, H, 12, gather_output=True), x_full, weight_out)

    # Column with stride 3: the local output is this rank's piece of each of the 3 blocks.
    col3, ref3 = pair(ColumnParallelLinear, H, 12, stride=3)
    meta3 = param_meta.TPMeta(dim=2, stride=3)
    y3_ref, y3_bound = ref3(x_full.double()).detach(), matmul_bound(x_full, ref3.weight.t(), bias=ref3.bias)
    out[f"{tag}/column_stride3"] = max_ratio(col3(x_full).detach(), param_meta.shard(y3_ref, meta3, n, r),
                                             param_meta.shard(y3_bound, meta3, n, r))

    # Row, input split here: each output sums 12 products, 12/tp per rank, then all-reduced.
    x12, w8 = _randn(4, S, B, 12), _randn(5, S, B, H)
    out[f"{tag}/row"] = layer_ratio(*pair(RowParallelLinear, 12, H, input_is_parallel=False), x12, w8)

    # Sequence-parallel column -> GELU -> row block: [s/tp, b, h] in and out. The bounds follow
    # the chain to first order: GELU passes its input's error on (times its slope) and adds its own.
    col, col_ref = pair(ColumnParallelLinear, H, 12, sequence_parallel=True)
    row, row_ref = pair(RowParallelLinear, 12, H, sequence_parallel=True)
    x = x_full.chunk(n, 0)[r].clone().requires_grad_(True)
    y = row(F.gelu(col(x)))
    (y * w8.chunk(n, 0)[r]).sum().backward()
    xr = x_full.double().requires_grad_(True)
    yr = row_ref(F.gelu(col_ref(xr)))
    (yr * w8.double()).sum().backward()
    with torch.no_grad():
        h = col_ref(x_full.double())
        a = F.gelu(h)
        e_h = matmul_bound(x_full, col_ref.weight.t(), bias=col_ref.bias)
        e_a = GELU_LIP * e_h + ELEMENTARY * U * (a.abs() + h.abs())
        row_b = linear_bounds(a, row_ref.weight, row_ref.bias, w8, x_err=e_a)
        g_a = w8.double() @ row_ref.weight
        g_h = g_a * _gelu_grad64(h)
        e_gh = (GELU_LIP * row_b["grad_x"] + g_a.abs() * (GELU_CURV * e_h + 1.25 * ELEMENTARY * U)
                + U * g_h.abs())
        col_b = linear_bounds(x_full, col_ref.weight, col_ref.bias, g_h, grad_y_err=e_gh)

    def seq(t):
        return t.chunk(n, 0)[r]

    out[f"{tag}/sp_block"] = max(max_ratio(y.detach(), seq(yr.detach()), seq(row_b["y"])),
                                 max_ratio(x.grad, seq(xr.grad), seq(col_b["grad_x"])),
                                 _grad_ratios(col, col_ref, topo, _param_bounds(col_b)),
                                 _grad_ratios(row, row_ref, topo, _param_bounds(row_b)))
    out[f"{tag}/sp_row_bias_grad_identical"] = all(
        torch.equal(p, row.bias.grad) for p in gather_pieces(row.bias.grad, topo))

    # Vocab-parallel embedding: ids from every shard (and the last real id). Each output row is one
    # stored row plus exact zeros from the other ranks, and the ids are distinct, so each gradient
    # row is one upstream row: forward and backward must be exact.
    vocab = 250
    ids = torch.arange(0, vocab, 16)  # 16 ids spread over every shard, plus the last real id
    ids[-1] = vocab - 1
    ids = ids.view(S, B)
    for sp in (False, True):
        emb, emb_ref = pair(VocabParallelEmbedding, vocab, H, sequence_parallel=sp)
        y = emb(ids)
        yr = emb_ref(ids)
        g = _randn(6, S, B, H)
        (y * (g.chunk(n, 0)[r] if sp else g)).sum().backward()
        (yr * g.double()).sum().backward()
        expect = yr.detach().chunk(n, 0)[r] if sp else yr.detach()
        local_rows = emb.weight.shape[0]
        first_padded = max(0, min(local_rows, vocab - r * local_rows))
        out[f"{tag}/embedding_sp{int(sp)}"] = max(max_ratio(y.detach(), expect, EXACT),
                                                  _grad_ratios(emb, emb_ref, topo, [EXACT]))
        out[f"{tag}/embedding_sp{int(sp)}_padded_grad_zero"] = bool((emb.weight.grad[first_padded:] == 0).all())


def _cross_entropy_checks(topo: Topology, out: dict, tag: str) -> None:
    n, r = topo.tp_size, topo.tp_rank
    vocab = 250
    padded = -(-vocab // (128 * n)) * 128 * n  # 256 at tp=2; 512 at tp=4, where ranks 2 and 3 hold only padding
    full = _randn(7, S, B, padded) * 3.0  # padded columns hold garbage that must be ignored
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(8))
    mask = (torch.rand(S, B, generator=torch.Generator().manual_seed(9)) > 0.3).float()
    for eps in (0.0, 0.1):
        logits = full.chunk(n, -1)[r].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(logits, target, topo, vocab_size=vocab, label_smoothing=eps,
                                            loss_mask=mask, reduction="mean")
        loss.backward()
        ref_logits = full.double().requires_grad_(True)
        per_tok = F.cross_entropy(ref_logits[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                                  label_smoothing=eps, reduction="none").view(S, B)
        ref_loss = (per_tok * mask).sum() / mask.sum()
        ref_loss.backward()
        tok_bound, grad_bound = cross_entropy_bounds(full, target, vocab, eps, grad_weight=mask / mask.sum())
        grad_bound = F.pad(grad_bound, (0, padded - vocab))  # padding columns: exactly zero
        out[f"{tag}/ce_eps{eps}"] = max(
            max_ratio(loss.detach(), ref_loss.detach(), masked_mean_bound(per_tok, tok_bound, mask)),
            max_ratio(logits.grad, ref_logits.grad.chunk(n, -1)[r], grad_bound.chunk(n, -1)[r]))
        first_padded = max(0, min(logits.shape[-1], vocab - r * logits.shape[-1]))
        out[f"{tag}/ce_eps{eps}_padded_grad_zero"] = bool((logits.grad[..., first_padded:] == 0).all())


def _rng_checks(topo: Topology, out: dict, tag: str) -> None:
    tracker = RNGTracker(5, topo)
    before = torch.get_rng_state()
    with tracker.fork("tp"):
        a = torch.rand(16)
    with tracker.fork("shared"):
        b = torch.rand(16)
    out[f"{tag}/rng_default_untouched"] = torch.equal(before, torch.get_rng_state())
    pa, pb = gather_pieces(a, topo), gather_pieces(b, topo)
    out[f"{tag}/rng_tp_differs"] = all(not torch.equal(pa[0], p) for p in pa[1:])
    out[f"{tag}/rng_shared_same"] = all(torch.equal(pb[0], p) for p in pb[1:])
    again = RNGTracker(5, topo)
    with again.fork("tp"):
        out[f"{tag}/rng_reproducible"] = torch.equal(torch.rand(16), a)


def _model_error_checks(topo: Topology, out: dict, tag: str) -> None:
    cfg = GPTConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=4, seq_length=16,
                    sequence_parallel=True)
    model = GPTModel(cfg, topo)
    ids = torch.zeros(2, 15 if topo.tp_size == 2 else 14, dtype=torch.long)
    try:
        model(ids)
        out[f"{tag}/sp_seq_error"] = "no error"
    except ValueError as e:
        out[f"{tag}/sp_seq_error"] = str(e)


def _worker():
    out = {}
    for tp in (2, 4):
        topo = Topology(tp=tp)
        tag = f"tp{tp}"
        _mapping_checks(topo, out, tag)
        _layer_checks(topo, out, tag)
        _cross_entropy_checks(topo, out, tag)
        _rng_checks(topo, out, tag)
        _model_error_checks(topo, out, tag)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=180)


def _values(results, suffixes):
    for rank, res in enumerate(results):
        for key, value in res.items():
            if key.split("/", 1)[1] in suffixes:
                yield rank, key, value


MAPPINGS = ("copy", "reduce", "scatter_last", "gather_last", "scatter_seq", "gather_seq", "gather_seq_split_grad",
            "reduce_scatter_seq")


def _assert_within_bounds(found, count=None):
    """Every ratio of deviation to derived bound is <= 1 (0 where the bound demands exactness)."""
    assert found and (count is None or len(found) == count)
    for rank, key, ratio in found:
        assert ratio <= 1.0, f"rank {rank} {key}: error is {ratio:.3g} x its rounding bound"


@pytest.mark.parametrize("check", MAPPINGS)
def test_mapping_forward_and_backward(results, check):
    _assert_within_bounds(list(_values(results, (check,))), 4 * 2)


@pytest.mark.parametrize("check", ("column", "column_stride3", "row", "sp_block", "embedding_sp0", "embedding_sp1"))
def test_layers_match_single_process(results, check):
    _assert_within_bounds(list(_values(results, (check,))), 4 * 2)


@pytest.mark.parametrize("check", ("ce_eps0.0", "ce_eps0.1"))
def test_vocab_parallel_cross_entropy_matches_torch(results, check):
    _assert_within_bounds(list(_values(results, (check,))), 4 * 2)


def test_boolean_properties(results):
    names = ("sp_row_bias_grad_identical", "embedding_sp0_padded_grad_zero", "embedding_sp1_padded_grad_zero",
             "ce_eps0.0_padded_grad_zero", "ce_eps0.1_padded_grad_zero", "rng_default_untouched",
             "rng_tp_differs", "rng_shared_same", "rng_reproducible")
    found = list(_values(results, names))
    assert len(found) == 4 * 2 * len(names)
    for rank, key, ok in found:
        assert ok is True, f"rank {rank}: {key} failed"


def test_sequence_parallel_rejects_indivisible_sequence(results):
    for rank, key, msg in _values(results, ("sp_seq_error",)):
        assert "divisible by the tensor-parallel size" in msg and "sequence_parallel" in msg, (rank, key, msg)
