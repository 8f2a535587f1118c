"""A GPT whose sequences are split over the context-parallel ranks computes what one process computes.

A float64 model (its cross entropy runs in fp32 whatever the dtype): the bounds are tests/numerics.py's
transformer_bound for that dtype, orders below what a misplaced chunk, a wrong position or a missing reduction
does (O(1e-2)).
"""

from __future__ import annotations

import pytest
import torch

from hybrid.topology import Topology
from model_zoo.config import GPTConfig
from model_zoo.gpt import GPTModel
from tests.multiproc import run_distributed
from tests.numerics import record, transformer_bound

BASE = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_query_groups=2, seq_length=16,
            position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, init_std=0.05)


def _batch():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, BASE["vocab_size"], (3, BASE["seq_length"]), generator=g)
    labels = torch.randint(0, BASE["vocab_size"], (3, BASE["seq_length"]), generator=g)
    mask = (torch.rand(3, BASE["seq_length"], generator=g) > 0.2).double()
    documents = torch.tensor([[0] * 5 + [1] * 11, [0] * 16, [0] * 2 + [1] * 9 + [2] * 5])
    return ids, labels, mask, documents


def _run(topo: Topology, overrides: dict, documents: bool):
    cfg = GPTConfig(**{**BASE, "sequence_parallel": topo.tp_size > 1, **overrides})
    model = GPTModel(cfg, topo, dtype=torch.float64, seed=3)
    ids, labels, mask, docs = _batch()
    loss = model(ids, labels=labels, loss_mask=mask, document_ids=docs if documents else None)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if topo.cp_size > 1:  # each cp rank holds a partial sum, carrying the factor cp (hybrid.context_parallel.loss)
            topo.comm.all_reduce(g, "cp")
            g /= topo.cp_size
        grads[name] = g.numpy()
    return float(loss.detach()), grads


def _worker(tp: int, cp: int, overrides: dict, documents: bool):
    topo = Topology(tp=tp, cp=cp)
    return _run(topo, overrides, documents)


def _check(world: int, tp: int, cp: int, overrides: dict, documents: bool):
    from hybrid import param_meta

    ref_loss, ref_grads = _run(Topology.local(), overrides, documents)
    ref_model = GPTModel(GPTConfig(**{**BASE, **overrides}), Topology.local(), dtype=torch.float64, seed=3)
    metas = {n: param_meta.get_tp_meta(p) for n, p in ref_model.named_parameters()}
    cfg = GPTConfig(**{**BASE, **overrides})
    tokens = 3 * cfg.seq_length
    loss_rel = transformer_bound(cfg, tokens, part="loss", dtype=torch.float64)
    grad_rel = transformer_bound(cfg, tokens, part="grads", dtype=torch.float64)
    for rank, (loss, grads) in enumerate(run_distributed(_worker, world, tp, cp, overrides, documents)):
        assert record(abs(loss - ref_loss) / (loss_rel * abs(ref_loss))) <= 1
        for name, g in grads.items():
            meta, full = metas[name], torch.from_numpy(ref_grads[name])
            if meta.logical_size is not None:  # the padded vocabulary: shard pads the logical rows again
                full = full.narrow(meta.dim, 0, meta.logical_size)
            want = param_meta.shard(full, meta, tp, rank % tp)
            err = (torch.from_numpy(g) - want).abs().max().item()
            assert record(err / (grad_rel * max(want.abs().max().item(), 1e-30))) <= 1, name


def test_cp2_ring_with_documents_matches_one_process():
    _check(2, 1, 2, {}, documents=True)


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,cp,overrides,documents", [
    (4, 1, 4, {}, False),  # CP4 ring
    (2, 1, 2, {"cp_comm_type": "a2a"}, True),  # CP2 all-to-all
    (4, 2, 2, {}, True),  # CP2 x TP2 with sequence parallelism
    (2, 1, 2, {"position": "learned", "norm": "layernorm", "mlp": "gelu", "max_position_embeddings": 16}, False),
])
def test_cp_layouts_match_one_process(world, tp, cp, overrides, documents):
    _check(world, tp, cp, overrides, documents)


def _documents_apart(cp: int, comm_type: str):
    """This rank's logits for two packed documents, then with every token of the first changed: ``(a, b, docs)``
    with ``docs`` the rank's own document ids (its chunks' positions, in its local order)."""
    from hybrid.context_parallel.split import split_for_rank

    topo = Topology(cp=cp)
    cfg = GPTConfig(**{**BASE, "cp_comm_type": comm_type})
    model = GPTModel(cfg, topo, dtype=torch.float64, seed=3).eval()
    first, s = 6, BASE["seq_length"]  # the first document's 6 tokens span chunk 0 and part of chunk 1
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, s), generator=g)
    changed = tokens.clone()
    changed[:, :first] = (tokens[:, :first] + 1 + torch.randint(0, cfg.vocab_size - 2, (2, first), generator=g)) \
        % cfg.vocab_size  # every one differs
    docs = torch.tensor([[0] * first + [1] * (s - first)] * 2)
    positions = torch.cat([torch.arange(first), torch.arange(s - first)])[None].expand(2, -1)
    with torch.no_grad():
        a, b = (model(t, position_ids=positions, document_ids=docs) for t in (tokens, changed))
    return a.numpy(), b.numpy(), split_for_rank(docs, topo, seq_dim=1).numpy()  # plain arrays cross processes


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_changing_the_first_document_changes_no_logit_of_the_second_under_cp(comm_type):
    """Issue 50's document acceptance with context parallelism: at CP2 the two documents' tokens are spread over
    both ranks' chunks; replacing every token of the first leaves each of the second's logits bit-identical on
    every rank (a masked key gets weight exactly 0, and both runs add the same terms in the same order)."""
    seen_first = 0
    for a, b, docs in run_distributed(_documents_apart, 2, 2, comm_type, timeout=120):
        a, b, docs = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(docs)
        second = docs == 1
        assert second.any()
        assert torch.equal(a[second], b[second])
        if (docs == 0).any():
            seen_first += 1
            assert not torch.equal(a[docs == 0], b[docs == 0])  # the change itself is seen
    assert seen_first >= 1
