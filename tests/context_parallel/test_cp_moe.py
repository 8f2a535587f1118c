"""Mixture of Experts under context parallelism (issue 50 x issue 49): an MoE layer whose sequences are split over
the cp ranks computes what one process computes on the whole sequences.

Routing is per token, so each cp rank routes its own chunks as one process would; what spans a sequence is summed
over ``"cp"`` (model_zoo/moe.py): the balancing loss's statistics (``aux_loss`` and ``seq_aux_loss``: a product of
two means over the sequence's tokens, not a sum of per-chunk terms), the z-loss's token count, the load that moves
the expert bias, and the capacity, which keeps per sequence and expert the highest-weight assignments of the
*whole* sequence (the routing is gathered over ``"cp"`` for it: a per-chunk capacity would keep other tokens).

Layer level, float64 (F64_REL as tests/model_zoo/test_moe.py argues), against one process on the whole batch:
the output and the input gradient on each rank's tokens, every parameter's gradient (summed over the ranks that
hold it, as ZeRO's dp x cp reduction does; every gradient here carries the factor cp the model's loss gives it,
hybrid.context_parallel.loss), the dropped count and the per-expert loads. Training level (slow): a tiny MoE GPT
trained 10 AdamW steps at CP2 x DP2 and CP2 x EP2 against plain PyTorch (tests/engine/parity_training.py).
"""

from __future__ import annotations

import pytest
import torch

from hybrid import param_meta
from hybrid.context_parallel.split import local_positions
from hybrid.topology import Topology
from tests.engine.parity_training import MOE, WORLD, check, reference, train
from tests.model_zoo.test_moe import build_layer, close, inputs, small_config
from tests.multiproc import run_distributed

CAPACITY = {"moe_expert_capacity_factor": 0.8}  # drops some assignments of these sequences


def _rows(topo: Topology, s: int) -> torch.Tensor:
    """This rank's positions of a sequence of ``s``: its cp chunks, then its TP share of them (sequence
    parallelism splits the cp rank's local sequence)."""
    mine = local_positions(s, topo.cp_size, topo.cp_rank)
    share = len(mine) // topo.tp_size
    return mine[topo.tp_rank * share:(topo.tp_rank + 1) * share]


def _worker(tp: int, cp: int, ep: int, overrides: dict, batch: int):
    topo = Topology(tp=tp, cp=cp, ep=ep)
    cfg = small_config(sequence_parallel=tp > 1, **overrides)
    layer = build_layer(cfg, topo)
    x, cot = inputs(cfg, batch)
    rows = _rows(topo, cfg.seq_length)
    x_local = x[rows].clone().requires_grad_()
    y = layer(x_local)
    (y * cot[rows] * cp).sum().backward()  # the model's loss carries the factor cp in backward
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        # ZeRO's reduction: over the ranks holding the parameter, divided by dp x cp
        topo.comm.all_reduce(g, "edp" if param_meta.is_expert(p) else "dp_cp")
        grads[n] = ((g / (topo.dp_size * cp)).numpy(), param_meta.get_tp_meta(p))
    # numpy arrays travel back by value (a tensor would by a shared-memory handle the exiting child closes)
    return dict(y=y.detach().numpy(), xg=(x_local.grad / cp).numpy(), rows=rows.tolist(), grads=grads, tp_rank=topo.tp_rank,
                dropped=float(layer.stats.dropped), counts=layer.stats.tokens_per_expert.numpy(),
                bias_load=_bias_load(layer))


def _bias_load(layer) -> list:
    """The load the expert bias moves by: this step's assignments summed over ``token_axes`` (as
    ``update_expert_bias`` sums them)."""
    load = layer.stats.step_tokens.clone()
    for axis in layer.token_axes:
        layer.topology.comm.all_reduce(load, axis)
    return load.tolist()


def _check(tp: int, cp: int, ep: int, world: int, overrides: dict, batch: int = 3):
    cfg = small_config(**overrides)
    ref = build_layer(cfg, Topology.local())
    x, cot = inputs(cfg, batch)
    x = x.clone().requires_grad_()
    y_ref = ref(x)
    (y_ref * cot).sum().backward()
    g_ref = {n: p.grad for n, p in ref.named_parameters()}
    results = run_distributed(_worker, world, tp, cp, ep, overrides, batch)
    seen = set()
    for res in results:
        rows = torch.tensor(res["rows"])
        assert close(torch.from_numpy(res["y"]), y_ref.detach()[rows])
        assert close(torch.from_numpy(res["xg"]), x.grad[rows])
        for name, (g, meta) in res["grads"].items():
            assert close(torch.from_numpy(g), param_meta.shard(g_ref[name], meta, tp, res["tp_rank"])), name
            seen.add(name)
        assert res["bias_load"] == ref.stats.step_tokens.tolist()  # the whole batch's, on every rank
    assert seen == set(g_ref)
    # each rank counts its own tokens: the counts add up to one process's, dropped assignments included
    assert sum(r["dropped"] for r in results) == float(ref.stats.dropped)
    assert torch.equal(torch.from_numpy(sum(r["counts"] for r in results)), ref.stats.tokens_per_expert)
    if "moe_expert_capacity_factor" in overrides:
        assert float(ref.stats.dropped) > 0  # the capacity bites: the test sees which assignments each keeps


def test_cp2_moe_layer_with_capacity_matches_one_process():
    _check(tp=1, cp=2, ep=1, world=2, overrides=CAPACITY)


@pytest.mark.slow
@pytest.mark.parametrize("tp,cp,ep,world,overrides", [
    (1, 2, 2, 2, CAPACITY),  # the experts shared out over the two cp ranks: tokens cross the chunks' owners
    (1, 4, 1, 4, {**CAPACITY, "moe_router_load_balancing_type": "seq_aux_loss"}),  # CP4, per-sequence balancing
    (2, 2, 1, 4, CAPACITY),  # CP2 x TP2, sequence parallel, experts split over TP
    (2, 2, 2, 4, {**CAPACITY, "expert_tensor_parallel_size": 1}),  # CP2 x TP2 x EP2, experts whole per TP rank
    (1, 2, 1, 2, {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
                  "moe_aux_loss_coeff": 0.0}),  # aux-loss-free balancing: the bias's load over cp
])
def test_cp_moe_layouts_match_one_process(tp, cp, ep, world, overrides):
    _check(tp=tp, cp=cp, ep=ep, world=world, overrides=overrides)


@pytest.mark.slow  # ~45 s each at world 4
@pytest.mark.parametrize("ep", [1, 2], ids=["cp2xdp2", "cp2xdp2-ep2"])
def test_cp2_moe_gpt_trains_as_one_process(ep):
    """The tiny MoE GPT (dropless, balancing and z-losses on) 10 AdamW steps at CP2 x DP2 (ZeRO-1), its experts
    on every rank or shared out over 2 ep ranks (the ep groups span cp ranks), against plain PyTorch."""
    runs = run_distributed(train, WORLD, 1, 1, ep, 1, {}, 2, MOE, timeout=300)
    check(runs, reference({}, MOE), {}, MOE)
