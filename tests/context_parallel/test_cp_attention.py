"""Context-parallel attention (hybrid.context_parallel) against plain single-process SDPA on the whole sequence.

Every comparison runs in float64: the ring and the all-to-all only reorder the same sums (the log-sum-exp rule
is exact algebra), so any two evaluations agree within gamma(k) * sum|terms| with u = 2^-53 and k the sequence
length (tests/numerics.py): about 1e-14 relative at these sizes, far below the 1e-9 bound used here, while a
block attended under the wrong mask, a lost dK/dV partial or a misplaced chunk errs by O(1e-2) or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid.context_parallel import (check_attention, check_heads, check_seq_length, context_parallel_attention,
                                     gather_sequence, local_positions, split_for_rank, split_sequence)
from hybrid.topology import Topology
from tests.multiproc import run_distributed

F64_REL = 1e-9


def close(got: torch.Tensor, ref: torch.Tensor, rel: float = F64_REL) -> bool:
    return tuple(got.shape) == tuple(ref.shape) and \
        (got - ref).abs().max().item() <= rel * max(1.0, ref.abs().max().item())


def document_ids(b: int, s: int) -> torch.Tensor:
    """``[b, s]`` packed documents whose boundaries fall inside chunks, so that documents span the chunks of
    different ranks (and sample 1 is one document over the whole sequence except a short tail)."""
    ends = [[s // 3 + 1, s // 2 + 3, s], [s - 3, s]]
    ids = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        start = 0
        for n, end in enumerate(ends[i % 2]):
            ids[i, start:end] = n
            start = end
    return ids


def problem(b: int, nq: int, ng: int, s: int, d: int, docs: bool, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, ng, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, ng, s, d, generator=g, dtype=torch.float64)
    cot = torch.randn(b, nq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, cot, (document_ids(b, s) if docs else None)


def reference(q, k, v, cot, docs):
    """Plain SDPA on the whole sequence in one process: out and the q, k, v gradients of <out, cot>."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    if docs is not None:
        mask = (mask & (docs.unsqueeze(2) == docs.unsqueeze(1))).unsqueeze(1)  # [b, 1, s, s]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    (out * cot).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _worker(comm_type: str, shape, docs: bool):
    """One cp rank: its split of the problem through context_parallel_attention, forward and backward; returns
    the gathered output and this rank's input gradients, plus the split/gather round trip of the inputs."""
    topo = Topology(cp=torch.distributed.get_world_size())
    q, k, v, cot, ids = problem(*shape, docs)
    local = [split_for_rank(t, topo, 2).clone().requires_grad_() for t in (q, k, v)]
    local_ids = None if ids is None else split_for_rank(ids, topo, 1)
    out = context_parallel_attention(*local, topo, comm_type, document_ids=local_ids)
    (out * split_for_rank(cot, topo, 2)).sum().backward()
    whole = gather_sequence(out.detach(), topo, 2)
    round_trip = [torch.equal(gather_sequence(t.detach(), topo, 2), full) for t, full in zip(local, (q, k, v))]
    # numpy: a tensor would travel through shared memory that the exiting child takes away
    return whole.numpy(), [t.grad.numpy() for t in local], round_trip


def check_layout(comm_type: str, cp: int, b=2, nq=4, ng=2, s=16, d=8, docs=True):
    shape = (b, nq, ng, s, d)
    results = run_distributed(_worker, cp, comm_type, shape, docs)
    ref_out, *ref_grads = reference(*problem(*shape, docs))
    for rank, (whole, grads, round_trip) in enumerate(results):
        whole, grads = torch.from_numpy(whole), [torch.from_numpy(g) for g in grads]
        assert all(round_trip), f"rank {rank}: gather(split(x)) != x"
        assert close(whole, ref_out), f"rank {rank}: output differs"
        for name, got, ref in zip("qkv", grads, ref_grads):
            assert close(got, split_sequence(ref, cp, rank, 2)), f"rank {rank}: d{name} differs"


def test_ring_cp2_with_documents_and_gqa_matches_one_process():
    check_layout("p2p", 2)


@pytest.mark.slow
@pytest.mark.parametrize("comm_type,cp,nq,ng,docs", [
    ("p2p", 2, 4, 4, False),  # plain causal, no GQA
    ("p2p", 4, 4, 2, False),
    ("p2p", 4, 4, 2, True),
    ("a2a", 2, 4, 2, False),
    ("a2a", 2, 4, 2, True),
    ("a2a", 4, 4, 2, True),  # fewer key/value groups than cp ranks: replicated before the all-to-all
])
def test_layouts_match_one_process(comm_type, cp, nq, ng, docs):
    check_layout(comm_type, cp, nq=nq, ng=ng, s=32 if cp == 4 else 16, docs=docs)


def _gather_grad_worker(grad: str):
    topo = Topology(cp=torch.distributed.get_world_size())
    x = torch.arange(2 * 8 * 3, dtype=torch.float64).view(2, 8, 3)  # [b, s, h]
    local = split_for_rank(x, topo, 1).clone().requires_grad_()
    whole = gather_sequence(local, topo, 1, grad=grad)
    weight = torch.arange(8, dtype=torch.float64).view(1, 8, 1) + topo.cp_rank  # differs per rank
    (whole * weight).sum().backward()
    return local.grad.numpy()


@pytest.mark.slow
def test_gather_sequence_backward_slices_or_sums():
    for grad, expect in (("slice", lambda r: torch.arange(8.0) + r), ("sum", lambda r: 2 * torch.arange(8.0) + 1)):
        for rank, g in enumerate(run_distributed(_gather_grad_worker, 2, grad)):
            assert torch.equal(torch.from_numpy(g), split_sequence(expect(rank).double().view(1, 8, 1).expand(2, 8, 3), 2, rank, 1))


def test_split_positions_and_round_trip_in_one_process():
    s, cp = 16, 4
    x = torch.randn(3, s, 2)
    parts = [split_sequence(x, cp, r, 1) for r in range(cp)]
    positions = [local_positions(s, cp, r) for r in range(cp)]
    assert positions[1].tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    assert sorted(torch.cat(positions).tolist()) == list(range(s))
    for part, pos in zip(parts, positions):
        assert torch.equal(part, x[:, pos])
    # every rank does equal causal work: the sum of its positions (+1 each) is the same
    assert len({int((p + 1).sum()) for p in positions}) == 1


def test_cp1_entry_point_is_plain_attention():
    q, k, v, cot, ids = problem(2, 4, 2, 12, 8, True)
    ref_out, *ref_grads = reference(q, k, v, cot, ids)
    local = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, Topology(), "p2p", document_ids=ids)
    (out * cot).sum().backward()
    assert close(out, ref_out)
    assert all(close(t.grad, r) for t, r in zip(local, ref_grads))


def test_bad_settings_are_refused_in_one_line():
    cases = [
        (lambda: check_seq_length(100, 4), "--seq-length 100 must be divisible by 2 x --context-parallel-size = 8"),
        (lambda: check_heads(6, 2, 4), "the 6 attention heads per tensor-parallel rank"),
        (lambda: check_heads(8, 3, 2), "the 3 key/value groups (--num-query-groups over TP)"),
        (lambda: check_attention("allgather", 2), "--cp-comm-type 'allgather'"),
        (lambda: check_attention("p2p", 2, 0.1), "--attention-dropout 0.1"),
        (lambda: local_positions(10, 2, 0), "--seq-length 10"),
    ]
    for call, text in cases:
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert text in message and "\n" not in message, message
    check_heads(8, 2, 4)  # groups replicated: accepted
    check_heads(8, 4, 4)
