"""Attention inside packed documents (``--reset-attention-mask``): the per-document SDPA of
model_zoo.document_attention against SDPA with the dense same-document causal mask (float64, forward and
backward), its dropout stream, its peak memory against the dense mask's, and the model-level acceptance of
issue 50: changing every token of the first packed document changes no logit of the second."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_zoo.document_attention import dense_document_attention, document_attention, document_segments
from tests.numerics import ELEMENTARY, U64, gamma

ROOT = Path(__file__).resolve().parents[2]


def _ids(lengths_per_sample):
    """document_ids [b, s] from each sample's document lengths (every sample the same total)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                        for lengths in lengths_per_sample])


def _bound(q, k, v, scale_terms: torch.Tensor) -> float:
    """Both sides compute each softmax row over the same keys in float64, in other orders and blockings: a
    score is a d-term dot product, a row's normaliser an s-term sum, an output or gradient entry a sum of at
    most s + d products of such terms (the backward's dS = P * (dP - rowsum(dO * O)) chains two more); exp and
    the division add ELEMENTARY roundings each. So every entry lies within gamma(4 (s + d) + 2 ELEMENTARY) of
    the sum of the absolute values of its terms, bounded by ``scale_terms`` (the largest such sum)."""
    s, d = q.shape[2], q.shape[3]
    return gamma(4 * (s + d) + 2 * ELEMENTARY, U64) * float(scale_terms)


@pytest.mark.parametrize("heads,groups,lengths", [
    (4, 4, [[5, 1, 7, 3], [16]]),             # several documents, one of length 1; a sample of one document
    (4, 2, [[1, 1, 1, 13], [8, 8]]),          # GQA; documents of length 1 in a row; two of equal length
    (6, 1, [[3, 3, 3, 3, 4], [2, 6, 1, 7]]),  # multi-query; lengths shared between the samples
    (2, 2, [[16], [16]]),                     # no boundary: the plain causal path
])
def test_per_document_sdpa_equals_the_dense_mask_forward_and_backward(heads, groups, lengths):
    g = torch.Generator().manual_seed(heads * 10 + groups)
    b, s, d = len(lengths), sum(lengths[0]), 8
    ids = _ids(lengths)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, groups, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, groups, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    gqa = heads != groups
    got = document_attention(q, k, v, ids, enable_gqa=gqa)
    ref = dense_document_attention(q, k, v, ids, enable_gqa=gqa)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    # the terms' sizes: |q||k| per score (times the softmax scale), |v| and |dO| per output / gradient entry
    big = max(float(t.detach().abs().max()) for t in (q, k, v, grad_out))
    terms = (s + d) * big ** 2 * (1 + d ** 0.5 * big ** 2)
    bound = _bound(q, k, v, torch.tensor(terms))
    assert float((got - ref).detach().abs().max()) <= bound
    for name, a, r in zip("qkv", got_grads, ref_grads):
        assert float((a - r).abs().max()) <= bound, name
    # a mistake is far above the bound: attending across one boundary moves the first sample's outputs
    crossed = dense_document_attention(q, k, v, torch.zeros_like(ids), enable_gqa=gqa)
    if len(lengths[0]) > 1:
        assert float((crossed - ref).detach().abs().max()) > 1e3 * bound


def test_the_segments_are_the_runs_of_equal_ids_and_decreasing_ids_are_refused():
    starts, lengths = document_segments(_ids([[2, 1, 3], [6]]))
    assert starts.tolist() == [0, 2, 3, 6] and lengths.tolist() == [2, 1, 3, 6]
    # ids need not start at 0 nor be consecutive; a new sample starts a document even with the same id
    starts, lengths = document_segments(torch.tensor([[4, 4, 9], [9, 9, 9]]))
    assert starts.tolist() == [0, 2, 3] and lengths.tolist() == [2, 1, 3]
    with pytest.raises(ValueError, match="must not decrease along a sample"):
        document_segments(torch.tensor([[0, 1, 0]]))
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"document_ids must be \[b, s\] = \[1, 3\]"):
        document_attention(q, q, q, torch.zeros(1, 4, dtype=torch.long))


def test_dropout_draws_from_the_trackers_tp_stream():
    from hybrid import Topology
    from hybrid.tensor_parallel.random import RNGTracker

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 4, generator=g) for _ in range(3))
    ids = _ids([[5, 7], [3, 9]])

    def run(seed_default: int):
        torch.manual_seed(seed_default)  # the default generator must not matter
        tracker = RNGTracker(1234, Topology.local())
        return document_attention(q, k, v, ids, dropout_p=0.5, tracker=tracker)

    first, again, other_default = run(0), run(0), run(99)
    assert torch.equal(first, again) and torch.equal(first, other_default)
    plain = document_attention(q, k, v, ids)
    assert not torch.allclose(first, plain)  # dropout acted
    # dropped probabilities stay inside the documents: the first document's outputs ignore the rest
    v2 = v.clone()
    v2[:, :, 5:] += 100.0
    torch.manual_seed(0)
    changed = document_attention(q, k, v2, ids, dropout_p=0.5, tracker=RNGTracker(1234, Topology.local()))
    assert torch.equal(changed[0, :, :5], first[0, :, :5])


# The peak resident memory of one forward and backward, above the memory before the call (KiB): VmHWM is reset
# first (clear_refs 5), as tests/faults/test_converter_bounds.py measures.
PEAK = """
import sys, torch
from model_zoo.document_attention import dense_document_attention, document_attention

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

form, s, docs, heads, groups, d = sys.argv[1], *map(int, sys.argv[2:7])
g = torch.Generator().manual_seed(0)
q = torch.randn(1, heads, s, d, generator=g, requires_grad=True)
k, v = (torch.randn(1, groups, s, d, generator=g, requires_grad=True) for _ in range(2))
ids = (torch.arange(s) * docs // s)[None]
attend = document_attention if form == "segments" else dense_document_attention
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
attend(q, k, v, ids, enable_gqa=heads != groups).sum().backward()
print(status("VmHWM:") - before)
"""


def peak_kib(form: str, seq: int, docs: int = 8, heads: int = 4, groups: int = 2, head_dim: int = 32) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PEAK, form, str(seq), str(docs), str(heads), str(groups),
                           str(head_dim)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_per_document_attention_peaks_far_below_the_dense_mask():
    seq, heads, head_dim = 4096, 4, 32
    segments, dense = peak_kib("segments", seq), peak_kib("dense", seq)
    # The dense form holds at least its boolean mask (s x s bytes; the causal and same-document masks it is
    # built from are as large). The per-document form holds copies of q, k, v, the output and their
    # gradients: a few dozen [s, heads, d] float32 tensors, about 2 MiB each here, nothing of s x s.
    assert dense * 1024 >= seq * seq, dense
    qkv_bytes = seq * heads * head_dim * 4
    assert segments * 1024 <= 16 * qkv_bytes, (segments, qkv_bytes)
    assert segments * 3 < dense, (segments, dense)


def test_changing_the_first_document_changes_no_logit_of_the_second():
    """Issue 50's acceptance, without context parallelism: two documents packed into one sample; every token of
    the first replaced, the second's logits stay bit-identical; without the document ids they move."""
    from hybrid import Topology
    from model_zoo import GPTConfig, GPTModel

    torch.manual_seed(0)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2, seq_length=24, vocab_size=64,
                    position="rope")
    model = GPTModel(cfg, Topology.local()).eval()
    first, second = 10, 14
    tokens = torch.randint(0, 64, (2, first + second))
    ids = _ids([[first, second]] * 2)
    positions = torch.cat([torch.arange(first), torch.arange(second)])[None].expand(2, -1)
    changed = tokens.clone()
    changed[:, :first] = (tokens[:, :first] + 1 + torch.randint(0, 62, (2, first))) % 64  # every one differs
    assert (changed[:, :first] != tokens[:, :first]).all()
    with torch.no_grad():
        a = model(tokens, position_ids=positions, document_ids=ids)
        b = model(changed, position_ids=positions, document_ids=ids)
        leaky_a = model(tokens, position_ids=positions)
        leaky_b = model(changed, position_ids=positions)
    assert torch.equal(a[:, first:], b[:, first:])
    assert not torch.equal(a[:, :first], b[:, :first])
    assert not torch.allclose(leaky_a[:, first:], leaky_b[:, first:])


if __name__ == "__main__":  # python -m tests.model_zoo.test_document_attention SEQ [DOCS]: the two peaks in MiB
    seq_arg, docs_arg = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8
    for form_arg in ("segments", "dense"):
        print(f"{form_arg}: s={seq_arg} documents={docs_arg} peak above the inputs "
              f"{peak_kib(form_arg, seq_arg, docs_arg) / 1024:.1f} MiB")
