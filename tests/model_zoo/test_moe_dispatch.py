"""The MoE dispatch's pieces (model_zoo.moe) against the plain compositions they replace, to the bit.

`_Combine` is the weighted sum of each token's expert outputs written as one autograd function (its backward
gathers each row's gradient from its token's); `run_experts_on_blocks` runs experts on rows that arrive in blocks
(one per source rank) without regrouping them. Both must give exactly what the plain composition gives, forward and
backward: the same products and sums in the same dtypes, so the comparisons are `torch.equal` on the bits, not a
tolerance. A wrong slot, a lost dropped row or a gradient summed in another order shows as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.tensor_parallel import init as tp_init
from hybrid.topology import Topology
from model_zoo.moe import Expert, _Combine, run_experts, run_experts_on_blocks
from tests.model_zoo.test_moe import small_config


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _composition(out, weights, assign, T, k):
    """The combine as plain differentiable ops: weighted rows copied into zeroed (token, choice) slots, summed over
    the choices."""
    weighted = out * weights.reshape(-1).index_select(0, assign).unsqueeze(1).to(out.dtype)
    slots = out.new_zeros(T * k, out.shape[1]).index_copy(0, assign, weighted)
    return slots.view(T, k, out.shape[1]).sum(1)


@pytest.mark.parametrize("dtype,k", [(torch.float32, 2), (torch.bfloat16, 2), (torch.float64, 3)])
def test_combine_matches_the_plain_composition_bit_for_bit(dtype, k):
    T, h = 40, 24
    g = torch.Generator().manual_seed(5)
    weights = torch.rand(T, k, generator=g, dtype=torch.float32 if dtype != torch.float64 else dtype)
    keep = torch.rand(T * k, generator=g) > 0.3  # about a third of the slots dropped
    expert_of = torch.randint(0, 4, (T * k,), generator=g)
    order = torch.sort(expert_of.masked_fill(~keep, 4), stable=True).indices  # kept grouped by expert, then dropped
    kept = int(keep.sum())
    assign, dropped = order[:kept], order[kept:]
    src = torch.div(assign, k, rounding_mode="floor")
    out = torch.randn(kept, h, generator=g).to(dtype)
    gy = torch.randn(T, h, generator=g).to(dtype)

    ref_out, ref_w = out.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = _composition(ref_out, ref_w, assign, T, k)
    ref.backward(gy)
    got_out, got_w = out.clone().requires_grad_(), weights.clone().requires_grad_()
    got = _Combine.apply(got_out, got_w, assign, src, dropped, k)
    got.backward(gy)

    assert dropped.numel() > 0 and _same_bits(got, ref)
    assert _same_bits(got_out.grad, ref_out.grad)
    assert _same_bits(got_w.grad, ref_w.grad)
    assert torch.equal(got_w.grad.reshape(-1)[dropped], torch.zeros(dropped.numel(), dtype=got_w.grad.dtype))


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_on_blocks_match_the_expert_major_concatenation(grouped):
    """Two source ranks' blocks per local expert (one of them empty) against run_experts on the rows regrouped
    expert-major (the gather the expert-parallel path no longer makes): outputs and every gradient."""
    cfg = small_config(hidden_size=16, ffn_hidden_size=32)
    topo = Topology.local()
    experts = [Expert(cfg, topo, 1, tp_init.normal(0.02), dtype=torch.float32) for _ in range(3)]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for e in experts:
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    sizes = [[3, 5], [0, 4], [6, 2]]  # [expert][source]
    rows = [[torch.randn(n, 16, generator=g) for n in own] for own in sizes]
    cot = [[torch.randn(n, 16, generator=g) for n in own] for own in sizes]

    def grads():
        out = {}
        for j, e in enumerate(experts):
            for name, p in e.named_parameters():
                out[f"{j}.{name}"] = p.grad
                p.grad = None
        return out

    flat = [b.clone().requires_grad_() for own in rows for b in own]
    ref = run_experts(torch.cat(flat), [sum(n) for n in sizes], experts, grouped)
    ref.backward(torch.cat([c for own in cot for c in own]))
    ref_grads = grads()

    blocks = [b.clone().requires_grad_() for own in rows for b in own]
    nested = [blocks[0:2], blocks[2:4], blocks[4:6]]
    got = run_experts_on_blocks(nested, experts, grouped)
    torch.autograd.backward([o for own in got for o in own], [c for own in cot for c in own])

    assert [[o.shape[0] for o in own] for own in got] == sizes
    assert _same_bits(torch.cat([o for own in got for o in own]), ref)
    for a, b in zip(blocks, flat):
        assert _same_bits(a.grad, b.grad)
    for name, gr in grads().items():
        assert _same_bits(gr, ref_grads[name]), name
