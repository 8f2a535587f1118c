"""Megatron-LM's --grad-reduce-in-bf16 is what hybrid's bf16 runs do: with bf16 parameters the gradients
accumulate in bf16 and the data-parallel reduce runs in bf16 (Megatron's gradient buffers then take the
parameters' dtype too). Two ranks, bf16, at ZeRO stage 0 (an all-reduce of the whole buffer) and 2 (a
reduce-scatter into each rank's partition): each rank's reduced gradient against the float64 sum of the two ranks'
own bf16 gradients (each computed again in plain torch).

The bound: the reduce adds 2 bf16 values and rounds the sum once to bf16 (u = 2^-8 of |sum|, within u (|g_0| +
|g_1|)); the 1/dp of the mean is applied later, in the optimizer's fp32 grad_factor. A wrong dtype (an fp32 sum),
a missing rank's term or a double count are far outside it."""

import numpy as np
import pytest
import torch

from hybrid import Topology
from hybrid.config.schema import OptimizerConfig, ZeroConfig
from hybrid.zero import build_zero_optimizer
from tests.multiproc import run_distributed

UB = torch.finfo(torch.bfloat16).eps / 2


def _reduced(stage):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    ref = torch.nn.Linear(64, 32).to(torch.bfloat16)
    ref.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    opt = build_zero_optimizer(model, Topology(), ZeroConfig(stage=stage), OptimizerConfig(lr=1e-3))
    rank = torch.distributed.get_rank()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    opt.backward(model(x).float().square().sum())
    opt.reducer.wait()
    ref(x).float().square().sum().backward()  # this rank's own gradient, in plain torch
    group = opt.groups[0]
    own = np.zeros(group.numel)
    for rec in group.records:
        own[rec.offset: rec.offset + rec.numel] = getattr(ref, rec.name).grad.double().flatten().numpy()
    mine = [(lo, hi) for s in range(len(group.segments))
            for lo, hi in [group.segments[s].chunk_range(opt.part, group.parts)]]
    reduced = torch.cat(opt.reducer.grad_chunks(0, opt.part)).double().numpy()
    dtype = str(opt.reducer.grads[0].dtype)
    opt.remove_hooks()
    return own, mine, reduced, dtype


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_gradients_are_reduced_in_bf16_within_one_rounding(stage):
    results = run_distributed(_reduced, 2, stage, timeout=120)
    assert all(dtype == "torch.bfloat16" for *_, dtype in results)
    exact = results[0][0] + results[1][0]
    bound = UB * (np.abs(results[0][0]) + np.abs(results[1][0]))
    for _, mine, reduced, _ in results:
        want = np.concatenate([exact[lo:hi] for lo, hi in mine])
        slack = np.concatenate([bound[lo:hi] for lo, hi in mine])
        assert reduced.size == want.size and np.abs(want).max() > 0
        assert (np.abs(reduced - want) <= slack).all(), float(np.max(np.abs(reduced - want) - slack))
    # and the sum did round: an fp32 reduce would match the exact sum everywhere
    assert any((np.abs(r[2] - np.concatenate([exact[lo:hi] for lo, hi in r[1]])) > 0).any() for r in results)
