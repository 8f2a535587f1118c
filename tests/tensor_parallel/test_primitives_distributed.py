"""Each tensor-parallel primitive against plain single-process PyTorch, on 4 gloo ranks.

One spawn runs every check at TP=2 and TP=4 and returns, per check, the
largest deviation from the single-process reference (or a boolean); the tests
assert on them.
"""

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

S, B, H = 8, 2, 8
TOL = 1e-6


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _err(got, ref) -> float:
    return (got - ref).abs().max().item() if got.shape == ref.shape else float("inf")


def _mapping_checks(topo: Topology, out: dict, tag: str) -> None:
    n, r = topo.tp_size, topo.tp_rank
    full = _randn(0, S, B, H)
    per_rank = [_randn(100 + i, S, B, H) for i in range(n)]  # rank i's own tensor, known to every rank
    total = sum(per_rank)

    def run(fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x, topo)
        y.backward(grad)
        return y.detach(), x.grad

    y, gx = run(m.copy_to_tp_region, full, per_rank[r])
    out[f"{tag}/copy"] = max(_err(y, full), _err(gx, total))
    y, gx = run(m.reduce_from_tp_region, per_rank[r], full)
    out[f"{tag}/reduce"] = max(_err(y, total), _err(gx, full))

    chunks = [g.chunk(n, dim=-1)[i] for i, g in enumerate(per_rank)]
    y, gx = run(m.scatter_to_tp_region, full, chunks[r])
    out[f"{tag}/scatter_last"] = max(_err(y, full.chunk(n, -1)[r]), _err(gx, torch.cat(chunks, -1)))
    y, gx = run(m.gather_from_tp_region, full.chunk(n, -1)[r], per_rank[r])
    out[f"{tag}/gather_last"] = max(_err(y, full), _err(gx, per_rank[r].chunk(n, -1)[r]))

    seq_chunks = [g.chunk(n, dim=0)[i] for i, g in enumerate(per_rank)]
    y, gx = run(m.scatter_to_sequence_parallel_region, full, seq_chunks[r])
    out[f"{tag}/scatter_seq"] = max(_err(y, full.chunk(n, 0)[r]), _err(gx, torch.cat(seq_chunks, 0)))
    y, gx = run(m.gather_from_sequence_parallel_region, full.chunk(n, 0)[r], per_rank[r])
    out[f"{tag}/gather_seq"] = max(_err(y, full), _err(gx, total.chunk(n, 0)[r]))
    y, gx = run(lambda x, t: m.gather_from_sequence_parallel_region(x, t, reduce_scatter_grad=False),
                full.chunk(n, 0)[r], full)
    out[f"{tag}/gather_seq_split_grad"] = max(_err(y, full), _err(gx, full.chunk(n, 0)[r]))
    y, gx = run(m.reduce_scatter_to_sequence_parallel_region, per_rank[r], seq_chunks[r])
    out[f"{tag}/reduce_scatter_seq"] = max(_err(y, total.chunk(n, 0)[r]), _err(gx, torch.cat(seq_chunks, 0)))


def _grad_errs(layer, ref, topo) -> float:
    local = Topology.local()
    errs = [_err(gather_full(p.grad, param_meta.get_tp_meta(p), topo),
                 gather_full(q.grad, param_meta.get_tp_meta(q), local))
            for p, q in zip(layer.parameters(), ref.parameters())]
    return max(errs)


def _layer_checks(topo: Topology, out: dict, tag: str) -> None:
    n, r, local = topo.tp_size, topo.tp_rank, Topology.local()
    x_full, weight_out = _randn(1, S, B, H), _randn(2, S, B, 12)

    def pair(cls, *args, **kw):
        layer = materialize(cls(*args, topo, **kw), 3, topo)
        ref_kw = {k: v for k, v in kw.items() if k != "sequence_parallel"}
        ref = materialize(cls(*args, local, **ref_kw), 3, local)
        return layer, ref

    def fwd_bwd(module, x):
        x = x.clone().requires_grad_(True)
        y = module(x)
        return y, x

    # Column, gathered output.
    col, ref = pair(ColumnParallelLinear, H, 12, gather_output=True)
    y, x = fwd_bwd(col, x_full)
    yr, xr = fwd_bwd(ref, x_full)
    (y * weight_out).sum().backward()
    (yr * weight_out).sum().backward()
    out[f"{tag}/column"] = max(_err(y.detach(), yr.detach()), _err(x.grad, xr.grad), _grad_errs(col, ref, topo))

    # Column with stride 3: the local output is this rank's piece of each of the 3 blocks.
    col3, ref3 = pair(ColumnParallelLinear, H, 12, stride=3)
    y3 = col3(x_full)
    out[f"{tag}/column_stride3"] = _err(
        y3.detach(), param_meta.shard(ref3(x_full).detach(), param_meta.TPMeta(dim=2, stride=3), n, r))

    # Row, input split here.
    row, ref = pair(RowParallelLinear, 12, H, input_is_parallel=False)
    x12, w8 = _randn(4, S, B, 12), _randn(5, S, B, H)
    y, x = fwd_bwd(row, x12)
    yr, xr = fwd_bwd(ref, x12)
    (y * w8).sum().backward()
    (yr * w8).sum().backward()
    out[f"{tag}/row"] = max(_err(y.detach(), yr.detach()), _err(x.grad, xr.grad), _grad_errs(row, ref, topo))

    # Sequence-parallel column -> row block: [s/tp, b, h] in and out.
    col, col_ref = pair(ColumnParallelLinear, H, 12, sequence_parallel=True)
    row, row_ref = pair(RowParallelLinear, 12, H, sequence_parallel=True)
    x = x_full.chunk(n, 0)[r].clone().requires_grad_(True)
    y = row(F.gelu(col(x)))
    (y * w8.chunk(n, 0)[r]).sum().backward()
    xr = x_full.clone().requires_grad_(True)
    yr = row_ref(F.gelu(col_ref(xr)))
    (yr * w8).sum().backward()
    out[f"{tag}/sp_block"] = max(_err(y.detach(), yr.detach().chunk(n, 0)[r]), _err(x.grad, xr.grad.chunk(n, 0)[r]),
                                 _grad_errs(col, col_ref, topo), _grad_errs(row, row_ref, topo))
    out[f"{tag}/sp_row_bias_grad_identical"] = all(
        torch.equal(p, row.bias.grad) for p in gather_pieces(row.bias.grad, topo))

    # Vocab-parallel embedding: ids from every shard (and the last real id).
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
        (yr * g).sum().backward()
        expect = yr.detach().chunk(n, 0)[r] if sp else yr.detach()
        local_rows = emb.weight.shape[0]
        first_padded = max(0, min(local_rows, vocab - r * local_rows))
        out[f"{tag}/embedding_sp{int(sp)}"] = max(_err(y.detach(), expect), _grad_errs(emb, emb_ref, topo))
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
        ref_logits = full.clone().requires_grad_(True)
        per_tok = F.cross_entropy(ref_logits[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                                  label_smoothing=eps, reduction="none").view(S, B)
        ref_loss = (per_tok * mask).sum() / mask.sum()
        ref_loss.backward()
        out[f"{tag}/ce_eps{eps}"] = max(_err(loss.detach(), ref_loss.detach()),
                                        _err(logits.grad, ref_logits.grad.chunk(n, -1)[r]))
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


@pytest.mark.parametrize("check", MAPPINGS)
def test_mapping_forward_and_backward(results, check):
    found = list(_values(results, (check,)))
    assert len(found) == 4 * 2
    for rank, key, err in found:
        assert err <= TOL, f"rank {rank} {key}: error {err}"


@pytest.mark.parametrize("check", ("column", "column_stride3", "row", "sp_block", "embedding_sp0", "embedding_sp1"))
def test_layers_match_single_process(results, check):
    for rank, key, err in _values(results, (check,)):
        assert err <= TOL, f"rank {rank} {key}: error {err}"


@pytest.mark.parametrize("check", ("ce_eps0.0", "ce_eps0.1"))
def test_vocab_parallel_cross_entropy_matches_torch(results, check):
    found = list(_values(results, (check,)))
    assert len(found) == 8
    for rank, key, err in found:
        assert err <= TOL, f"rank {rank} {key}: error {err}"


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
