"""The MoE layer (model_zoo.moe) against plain PyTorch references, and its expert-parallel layouts against one process.

Layer-level comparisons run in float64: any two orders of the same sums then agree within
gamma(k) * sum|terms| with u = 2^-53 (tests/numerics.py), far below the 1e-9 relative bound used here,
while a wrong route, a lost token or a missing reduction errs by O(1e-2) or more.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid import param_meta
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.random import RNGTracker
from hybrid.topology import Topology
from model_zoo.config import GPTConfig, parse_moe_layer_freq
from model_zoo.gpt import GPTModel
from model_zoo.moe import AuxLossScale, MoELayer, balancing_loss, capacity, keep_mask, moe_layers, route, z_loss
from tests.multiproc import run_distributed
from tests.numerics import ELEMENTARY, U, matmul_bound, max_ratio

F64_REL = 1e-9  # float64: orders of magnitude above gamma(k) u64 for these sizes, far below a real mistake
PREFIX = "layers.0.mlp."


def small_config(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, seq_length=8, ffn_hidden_size=24,
                position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, num_experts=4,
                moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    base.update(overrides)
    return GPTConfig(**base)


def build_layer(config: GPTConfig, topo: Topology, seed: int = 7, dtype=torch.float64) -> MoELayer:
    layer = MoELayer(config, topo, RNGTracker(seed, topo), AuxLossScale(), tp_init.normal(0.02), device="cpu",
                     dtype=dtype)
    tp_init.materialize(layer, seed, topo, prefix=PREFIX)
    return layer.train()


def inputs(config: GPTConfig, batch: int, seed: int = 3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(config.seq_length, batch, config.hidden_size, generator=g, dtype=dtype)
    cot = torch.randn(config.seq_length, batch, config.hidden_size, generator=g, dtype=dtype)
    return x, cot


def close(got: torch.Tensor, ref: torch.Tensor, rel: float = F64_REL) -> bool:
    return (got - ref).abs().max().item() <= rel * max(1.0, ref.abs().max().item())


# ---- routing pieces against plain loops ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    {},  # softmax renormalised over the top k (Mixtral, Qwen3-MoE)
    {"moe_router_pre_softmax": True},  # softmax over all experts, not renormalised (Qwen2-MoE)
    {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5},  # DeepSeek-V3
])
def test_route_matches_a_per_token_reference(overrides):
    cfg = small_config(num_experts=6, moe_router_topk=3, **overrides)
    logits = torch.randn(20, 6, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64) * 0.1
    r = route(logits, cfg, bias)
    for t in range(20):
        scores = torch.softmax(logits[t], 0) if cfg.moe_router_score_function == "softmax" else logits[t].sigmoid()
        chosen = sorted(range(6), key=lambda e: -(scores[e] + bias[e]).item())[:3]
        w = scores[chosen]
        if cfg.moe_router_score_function == "sigmoid" or not cfg.moe_router_pre_softmax:
            w = w / w.sum()
        w = w * (cfg.moe_router_topk_scaling_factor or 1.0)
        assert r.experts[t].tolist() == chosen
        assert torch.allclose(r.weights[t], w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("overrides,with_bias", [
    ({"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5}, True),  # DeepSeek-V3
    ({}, False),  # softmax renormalised over the chosen k: Megatron-Core ranks the groups by the logits
    ({"moe_router_pre_softmax": True}, False),  # softmax over all experts: by the softmax scores
])
def test_group_limited_routing_matches_a_per_token_reference(overrides, with_bias):
    """--moe-router-num-groups 4 --moe-router-group-topk 2 with top-4 of 8 experts: each token ranks its 4 groups of
    2 by the sum of their top 4 // 2 = 2 values, keeps the best 2 groups, and takes its 4 experts from them."""
    E, G, g, k = 8, 4, 2, 4
    cfg = small_config(num_experts=E, moe_router_topk=k, moe_router_num_groups=G, moe_router_group_topk=g,
                       **overrides)
    assert cfg.validate() is cfg
    logits = torch.randn(40, E, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(E, dtype=torch.float64) * 0.1 if with_bias else None
    r = route(logits, cfg, bias)
    plain = route(logits, cfg.replace(moe_router_num_groups=None, moe_router_group_topk=None), bias)
    sigmoid = cfg.moe_router_score_function == "sigmoid"
    for t in range(40):
        scores = logits[t].sigmoid() if sigmoid else torch.softmax(logits[t], 0)
        select = scores + (bias if with_bias else 0)
        key = logits[t] if not sigmoid and not cfg.moe_router_pre_softmax and not with_bias else select
        per_group = E // G
        rank = [sum(sorted(key[j * per_group:(j + 1) * per_group].tolist(), reverse=True)[:k // g]) for j in range(G)]
        groups = sorted(range(G), key=lambda j: -rank[j])[:g]
        allowed = [e for e in range(E) if e // per_group in groups]
        chosen = sorted(allowed, key=lambda e: -select[e].item())[:k]
        assert r.experts[t].tolist() == chosen
        w = scores[chosen]
        if sigmoid or not cfg.moe_router_pre_softmax:
            w = w / w.sum()
        assert torch.allclose(r.weights[t], w * (cfg.moe_router_topk_scaling_factor or 1.0), rtol=1e-12, atol=0)
    # the groups matter on these logits: some token's experts differ from unlimited routing's
    assert not torch.equal(r.experts, plain.experts)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_per_sequence_what_the_policy_says(policy):
    s, b, k, E, cap = 10, 3, 2, 4, 3
    g = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(s * b)]).view(s, b, k)
    weights = torch.rand(s, b, k, generator=g, dtype=torch.float64)
    keep = keep_mask(experts, weights, E, cap, policy)
    for seq in range(b):
        for e in range(E):
            slots = [(p, j) for p in range(s) for j in range(k) if experts[p, seq, j] == e]
            if policy == "probs":
                slots.sort(key=lambda pj: (-weights[pj[0], seq, pj[1]].item(), pj))
            kept = set(slots[:cap])
            for p, j in slots:
                assert bool(keep[p, seq, j]) == ((p, j) in kept)


def test_balancing_and_z_loss_formulas():
    E, k, T = 4, 2, 8
    probs = torch.full((T, E), 1.0 / E, dtype=torch.float64)
    experts = torch.tensor([[t % E, (t + 1) % E] for t in range(T)])
    assert balancing_loss(probs, experts, E, tokens=T).item() == pytest.approx(1.0)  # balanced: 1
    collapsed = torch.zeros((T, E), dtype=torch.float64)
    collapsed[:, :2] = 0.5
    assert balancing_loss(collapsed, torch.tensor([[0, 1]] * T), E, tokens=T).item() == pytest.approx(2.0)
    logits = torch.randn(T, E, dtype=torch.float64)
    assert z_loss(logits).item() == pytest.approx((torch.logsumexp(logits, -1) ** 2).mean().item())
    assert capacity(small_config(moe_expert_capacity_factor=1.5), 8) == math.ceil(1.5 * 8 * 2 / 4)


def test_layer_matches_a_plain_token_loop():
    cfg = small_config(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                       moe_expert_capacity_factor=0.75)
    layer = build_layer(cfg, Topology.local())
    x, _ = inputs(cfg, batch=3)
    y = layer(x)
    # the reference: route every token, drop by the capacity rule, run each kept expert on it, add the shared one
    logits = x.reshape(-1, 16) @ layer.router.weight.t()
    r = route(logits, cfg)
    keep = keep_mask(r.experts.view(8, 3, 2), r.weights.view(8, 3, 2), 4, capacity(cfg, 8), "probs").reshape(-1, 2)
    ref = torch.zeros_like(x).reshape(-1, 16)
    for t in range(ref.shape[0]):
        for j in range(2):
            if keep[t, j]:
                ex = layer.experts.get_submodule(str(int(r.experts[t, j])))
                gate, up = (x.reshape(-1, 16)[t] @ ex.in_proj.weight.t()).chunk(2)
                ref[t] += r.weights[t, j] * ((F.silu(gate) * up) @ ex.out_proj.weight.t())
    xs = x.reshape(-1, 16)
    sh = layer.shared_expert
    gate, up = (xs @ sh.in_proj.weight.t()).chunk(2, dim=-1)
    ref += torch.sigmoid(xs @ layer.shared_expert_gate.weight.t()) * ((F.silu(gate) * up) @ sh.out_proj.weight.t())
    assert close(y.reshape(-1, 16), ref)
    assert int(layer.stats.dropped) == int((~keep).sum()) > 0
    assert layer.stats.tokens_per_expert.sum().item() == 8 * 3 * 2


def test_grouped_experts_off_16_byte_strides_run_the_loop():
    """An expert width torch._grouped_mm cannot take (f' = 5 fp32: 20-byte rows; its own error is "strides
    should be multiple of 16 bytes") runs the loop: the same arithmetic, so bit-identical output and grads."""
    cfg = small_config(ffn_hidden_size=5)
    topo = Topology.local()
    looped, grouped = build_layer(cfg, topo, dtype=torch.float32), \
        build_layer(cfg.replace(moe_grouped_gemm=True), topo, dtype=torch.float32)
    x, cot = inputs(cfg, batch=2, dtype=torch.float32)
    ys = []
    for layer in (looped, grouped):
        y = layer(x)
        (y * cot).sum().backward()
        ys.append(y.detach())
    assert torch.equal(ys[0], ys[1])
    for a, b in zip(looped.parameters(), grouped.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_grouped_and_looped_experts_agree():
    """fp32 (torch._grouped_mm takes no float64): both within the first-order rounding bound of a float64 loop."""
    cfg = small_config()
    topo = Topology.local()
    looped, grouped = build_layer(cfg, topo), build_layer(cfg.replace(moe_grouped_gemm=True), topo)
    exact = build_layer(cfg, topo)  # float64
    looped.float(), grouped.float()
    x, cot = inputs(cfg, batch=2)
    outs, grads = [], []
    for layer, dtype in ((looped, torch.float32), (grouped, torch.float32), (exact, torch.float64)):
        xi = x.to(dtype).requires_grad_()
        y = layer(xi)
        (y * cot.to(dtype)).sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    # Forward: each routed output is w * (act(x W_in^T) W_out^T); bound the two products and the activation to
    # first order (numerics.matmul_bound, ELEMENTARY per silu), the weighted sum over k as one more product+sum.
    tokens = x.reshape(-1, 16)
    logits = tokens @ exact.router.weight.t()
    r = route(logits, cfg)
    bound = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(2):
            ex = exact.experts.get_submodule(str(int(r.experts[t, j])))
            mid = tokens[t:t + 1] @ ex.in_proj.weight.t()
            mid_err = matmul_bound(tokens[t:t + 1], ex.in_proj.weight.t())
            gate, up = mid.chunk(2, -1)
            g_err, u_err = mid_err.chunk(2, -1)
            act = F.silu(gate) * up
            act_err = 1.1 * up.abs() * g_err + F.silu(gate).abs() * u_err + (ELEMENTARY + 1) * U * act.abs()
            out = act @ ex.out_proj.weight.t()
            bound[t] += (r.weights[t, j] * (matmul_bound(act, ex.out_proj.weight.t(), a_err=act_err)
                                            + 3 * U * out.abs()))[0]
    bound = bound.view_as(outs[2])
    assert max_ratio(outs[0], outs[2], bound) <= 1 and max_ratio(outs[1], outs[2], bound) <= 1
    # Backward, normwise: u times the reduction lengths along the chain (h, 2f, f, and the tokens summed into each
    # weight's gradient), with the O(1) gains of tests/numerics.transformer_bound's estimate.
    rel = U * (16 + 2 * 24 + 24 + 2 * tokens.shape[0] + 4 * ELEMENTARY)
    for a, b, ref in zip(grads[0], grads[1], grads[2]):
        scale = ref.abs().max().item()
        assert (a.double() - ref).abs().max().item() <= rel * scale
        assert (b.double() - ref).abs().max().item() <= rel * scale


def test_the_model_builds_moe_layers_where_the_pattern_says_and_trains():
    cfg = small_config(num_layers=4, moe_layer_freq=parse_moe_layer_freq("([0]*1+[1]*3)"), vocab_size=64)
    model = GPTModel(cfg, Topology.local(), dtype=torch.float32)
    assert [i for i, _ in moe_layers(model)] == [1, 2, 3]
    ids = torch.randint(0, 64, (2, 8))
    loss = model(ids, labels=ids)
    loss.backward()
    router = model.layers.by_index(1).mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_evaluation_routes_without_counting():
    """In eval mode a layer's statistics (the monitor's, and the step's loads the expert bias reads) stay as
    training left them."""
    cfg = small_config()
    layer = build_layer(cfg, Topology.local())
    x, _ = inputs(cfg, batch=2)
    layer(x)
    counts, step = layer.stats.tokens_per_expert.clone(), layer.stats.step_tokens.clone()
    with torch.no_grad():
        layer.eval()(x)
    assert torch.equal(layer.stats.tokens_per_expert, counts) and torch.equal(layer.stats.step_tokens, step)
    assert layer.stats.micro_batches == 1


def test_the_balancing_loss_reaches_the_router_gradient():
    """With only the balancing loss as objective (zero cotangent), the router still gets its gradient, scaled by
    the model's aux-loss scale."""
    cfg = small_config(moe_z_loss_coeff=None)
    layer = build_layer(cfg, Topology.local())
    x, _ = inputs(cfg, batch=2)
    layer(x).sum().mul(0).backward()
    g1 = layer.router.weight.grad.clone()
    assert g1.abs().sum() > 0
    layer.router.weight.grad = None
    layer.aux_scale.value = 3.0
    layer(x).sum().mul(0).backward()
    assert close(layer.router.weight.grad, 3.0 * g1)


# ---- expert parallelism against one process -----------------------------------------------------------------
def _reference(config: GPTConfig, dp: int, batch: int):
    """One process: the layer on each dp rank's micro-batch in turn (the balancing loss is per micro-batch)."""
    layer = build_layer(config, Topology.local())
    x, cot = inputs(config, batch)
    x = x.clone().requires_grad_()
    outs = []
    for d in range(dp):
        sl = slice(d * batch // dp, (d + 1) * batch // dp)
        y = layer(x[:, sl])
        (y * cot[:, sl]).sum().backward()
        outs.append(y.detach())
    return torch.cat(outs, dim=1), x.grad, {n: p.grad for n, p in layer.named_parameters()}, layer.stats


def _layout_worker(tp: int, ep: int, overrides: dict, batch: int, dtype=torch.float64):
    topo = Topology(tp=tp, ep=ep)
    cfg = small_config(sequence_parallel=tp > 1, **overrides)
    layer = build_layer(cfg, topo, dtype=dtype)
    x, cot = inputs(cfg, batch, dtype=dtype)
    dp, s = topo.dp_size, cfg.seq_length
    bs, ss = slice(topo.dp_rank * batch // dp, (topo.dp_rank + 1) * batch // dp), \
        slice(topo.tp_rank * s // tp, (topo.tp_rank + 1) * s // tp)
    x_local = x[ss, bs].clone().requires_grad_()
    y = layer(x_local)
    (y * cot[ss, bs]).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.double()
        topo.comm.all_reduce(g, "edp" if param_meta.is_expert(p) else "dp")
        grads[n] = (g.numpy(), param_meta.get_tp_meta(p))
    report = topo.comm.report()
    # numpy arrays travel back by value (a tensor would by a shared-memory handle the exiting child closes)
    return dict(y=y.detach().double().numpy(), xg=x_local.grad.double().numpy(), grads=grads, bs=bs, ss=ss, tp_rank=topo.tp_rank,
                dispatched=report.get("moe_dispatch/ep", {}).get("calls", 0), dropped=float(layer.stats.dropped),
                wire=sum(v["wire_bytes"] for k, v in report.items() if k.startswith("moe_")),
                counts=layer.stats.tokens_per_expert.numpy())


def _check_layout(tp: int, ep: int, world: int, overrides: dict, batch: int = 4):
    cfg = small_config(**overrides)
    y_ref, xg_ref, g_ref, stats_ref = _reference(cfg, world // tp, batch)
    results = run_distributed(_layout_worker, world, tp, ep, overrides, batch)
    seen = set()
    for res in results:
        assert close(torch.from_numpy(res["y"]), y_ref[res["ss"], res["bs"]])
        assert close(torch.from_numpy(res["xg"]), xg_ref[res["ss"], res["bs"]])
        for name, (g, meta) in res["grads"].items():
            assert close(torch.from_numpy(g), param_meta.shard(g_ref[name], meta, tp, res["tp_rank"])), name
            seen.add(name)
        assert res["dispatched"] == (1 if ep > 1 else 0)
    assert seen == set(g_ref)  # every expert lives on some rank
    dropped = sum(r["dropped"] for r in results)
    assert dropped == float(stats_ref.dropped)
    # each TP rank counts its own sequence shard: the ranks' counts add up to the one process's
    assert torch.equal(torch.from_numpy(sum(r["counts"] for r in results)), stats_ref.tokens_per_expert)


def test_ep2_matches_one_process():
    _check_layout(tp=1, ep=2, world=2, overrides={})


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,overrides", [
    (1, 4, {}),  # EP4
    (1, 2, {"moe_expert_capacity_factor": 0.8}),  # EP2 x DP2 with token dropping
    (2, 2, {}),  # EP2 x TP2, experts split over TP, sequence parallel
    (2, 2, {"expert_tensor_parallel_size": 1, "moe_expert_capacity_factor": 0.8,
            "moe_router_load_balancing_type": "seq_aux_loss"}),  # experts whole on each TP rank
    (1, 2, {"moe_grouped_gemm": True, "moe_shared_expert_intermediate_size": 8}),
])
def test_layouts_match_one_process(tp, ep, overrides):
    _check_layout(tp=tp, ep=ep, world=4, overrides=overrides)


def test_quantized_dispatch_moves_under_0_3x_the_bytes_and_stays_close():
    """int8 blocks of 64 with an fp32 scale each: 1 + 4/64 bytes per fp32 value (0.27x) over the four exchanges
    (dispatch and combine, forward and backward). Each dequantized value is within half a step, 1/254 of its
    block's largest magnitude; through the two hops and one expert MLP (gains of O(1)) the layer's output stays
    within a few of those steps."""
    wide = {"hidden_size": 128}  # an fp32 model whose rows fill whole blocks, as real hidden sizes do
    plain = run_distributed(_layout_worker, 2, 1, 2, wide, 4, torch.float32)
    packed = run_distributed(_layout_worker, 2, 1, 2, {**wide, "moe_quantized_dispatch": True}, 4, torch.float32)
    assert sum(r["wire"] for r in packed) <= 0.3 * sum(r["wire"] for r in plain)
    for a, b in zip(plain, packed):
        y, yq = torch.from_numpy(a["y"]), torch.from_numpy(b["y"])
        err = (yq - y).abs().max().item() / y.abs().max().item()
        assert 0 < err <= 8 / 254


def test_bad_moe_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="--moe-router-topk 5 must lie in"):
        small_config(moe_router_topk=5).validate()
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor 0.0 must be > 0"):
        small_config(moe_expert_capacity_factor=0.0).validate()
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        small_config().validate(2)
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        small_config(bias=True).validate()
    with pytest.raises(ValueError, match="moe-layer-freq"):
        parse_moe_layer_freq("__import__('os')")
