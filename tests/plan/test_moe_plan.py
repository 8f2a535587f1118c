"""The planner on Mixture-of-Experts models: parameter counts, expert state over edp, the token all-to-alls,
routed-token activations, and the layouts with expert parallelism."""

import pytest
import torch

from hybrid.compression import SCALE_BYTES
from hybrid.layout import ParallelLayout
from hybrid.plan import Candidate, Choices, Cluster, TrainingSetup, estimate_memory, plan
from hybrid.plan.comm_volume import moe_volume
from hybrid.plan.estimate import expert_layout, zero_layout
from hybrid.plan.layouts import enumerate_layouts
from hybrid.plan.model_memory import flat_layout, shard_shapes
from hybrid.plan.moe import (expert_parallel_sizes, moe_layer_activation_bytes, received_rows,
                             split_expert_shapes)
from hybrid.topology import Topology
from model_zoo import GPTModel, count_model_parameters, get_preset
from model_zoo.config import DISPATCH_BLOCK
from model_zoo.flops import (active_parameters, count_parameters, expert_parameters, flops_per_token,
                             matmul_parameters)
from tests.multiproc import run_distributed

# tiny-moe by hand: h=128, 4 layers, 8 heads (no grouping), SwiGLU, no biases, untied, RMSNorm, V=4096,
# 4 experts of f'=256, top-2, every layer MoE.
#   attention per layer: qkv 128*384 = 49152, out 128*128 = 16384, two norms 256      -> 65792
#   router 4*128 = 512; one expert 2*256*128 + 256*128 = 98304, four 393216
#   layer 65792 + 512 + 393216 = 459520; 4 layers 1838080; embeddings 2*4096*128 = 1048576; final norm 128
HAND_TOTAL = 4 * (65792 + 512 + 4 * 98304) + 2 * 4096 * 128 + 128  # 2,886,784
HAND_ACTIVE = 4 * (65792 + 512 + 2 * 98304) + 2 * 4096 * 128 + 128  # 2,100,352: 2 of 4 experts
HAND_EXPERTS = 4 * 4 * 98304  # 1,572,864
# N_matmul: per layer qkv + out 65536, router 512, two experts 196608; the head 4096*128
HAND_MATMUL = 4 * (65536 + 512 + 2 * 98304) + 4096 * 128  # 1,574,912


def test_tiny_moe_counts_by_hand_and_built_model():
    cfg = get_preset("tiny-moe")
    assert count_parameters(cfg) == HAND_TOTAL == 2_886_784
    assert active_parameters(cfg) == HAND_ACTIVE
    assert expert_parameters(cfg) == HAND_EXPERTS
    assert matmul_parameters(cfg) == HAND_MATMUL
    assert flops_per_token(cfg) == 6 * HAND_MATMUL + 12 * 4 * cfg.seq_length * 128
    model = GPTModel(cfg, Topology.local(), device="meta")
    assert count_model_parameters(model, 1) == HAND_TOTAL
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert experts == HAND_EXPERTS


@pytest.mark.parametrize("name,rounded,active", [("mixtral-8x7b", "46.7", "12.9"), ("qwen3-30b-a3b", "30.5", "3.3")])
def test_published_moe_sizes(name, rounded, active):
    """The model cards: Mixtral 46.7B total, 12.9B active; Qwen3-30B-A3B 30.5B total, 3.3B active (3.35B,
    which its card truncates rather than rounds: the check takes the card's digits as a lower bound)."""
    cfg = get_preset(name)
    assert f"{count_parameters(cfg) / 1e9:.1f}" == rounded
    n = active_parameters(cfg) / 1e9
    assert f"{n:.1f}" == active or int(n * 10) / 10 == float(active)


def test_dense_model_counts_unchanged():
    cfg = get_preset("llama3-8b")
    assert count_parameters(cfg) == active_parameters(cfg) == 8_030_261_248
    assert expert_parameters(cfg) == 0


def test_expert_shapes_split_over_ep_and_state_over_edp():
    cfg = get_preset("tiny-moe")
    shapes = shard_shapes(cfg, 1)
    assert sum(s.numel for s in shapes) == HAND_TOTAL
    dense, experts = split_expert_shapes(shapes, cfg, ep=2, ep_rank=0)
    assert sum(s.numel for s in experts) == HAND_EXPERTS // 2  # experts 0 and 1 of each layer
    assert {s.name.split(".")[4] for s in experts} == {"0", "1"}
    assert sum(s.numel for s in dense) == HAND_TOTAL - HAND_EXPERTS
    _, other = split_expert_shapes(shapes, cfg, ep=2, ep_rank=1)
    assert {s.name.split(".")[4] for s in other} == {"2", "3"}

    # ZeRO-1 over dp=4 with ep=2: dense state over 4 ranks, expert state over edp = 2
    cand = Candidate(ParallelLayout(tp=1, dp=4, ep=2, zero_stage=1, precision="bf16"))
    setup = TrainingSetup()
    dense_flat, expert_flat = zero_layout(cfg, cand, setup), expert_layout(cfg, cand, setup)
    assert dense_flat.unpadded == HAND_TOTAL - HAND_EXPERTS and dense_flat.dp == 4
    assert expert_flat.unpadded == HAND_EXPERTS // 2 and expert_flat.dp == 2
    mem = estimate_memory(cfg, cand, setup)
    assert mem.state.weights == 2 * (dense_flat.numel + expert_flat.numel)
    assert mem.state.optimizer_states == 8 * (dense_flat.numel // 4 + expert_flat.numel // 2)
    assert mem.state.master == 4 * (dense_flat.numel // 4 + expert_flat.numel // 2)
    # the same flat layout the optimizer would build from the hand-split shapes
    assert expert_flat.numel == flat_layout(experts, 2, "bf16", setup.bucket_size).numel


def test_all_to_all_bytes_by_hand():
    cfg = get_preset("tiny-moe")  # s=128, h=128, k=2
    cand = Candidate(ParallelLayout(tp=1, dp=4, ep=2, zero_stage=1, precision="bf16"), micro_batch=2)
    report = moe_volume(cfg, cand, micro_batches=3)
    tokens_k_h_p = 128 * 2 * 2 * 128 * 2  # T = s * mb = 256 tokens, k = 2 rows each, h = 128, bf16
    for op in ("moe_dispatch", "moe_combine", "moe_dispatch_grad", "moe_combine_grad"):
        entry = report[f"{op}/ep"]
        assert entry["calls"] == 3 * 4  # micro-batches x MoE layers
        assert entry["payload_bytes"] == 12 * tokens_k_h_p
        assert entry["peer_bytes"] == 12 * tokens_k_h_p // 2  # balanced: half to the other ep rank
        assert entry["wire_bytes"] == 12 * tokens_k_h_p // 2  # (ep - 1) / ep leaves the rank
    full = moe_volume(cfg, Candidate(cand.parallel, micro_batch=2, recompute="full"), micro_batches=3)
    assert full["moe_dispatch/ep"]["calls"] == 2 * 12 and full["moe_dispatch_grad/ep"]["calls"] == 12
    assert moe_volume(cfg, Candidate(ParallelLayout(tp=1, dp=4, ep=1)), 1) == {}  # ep = 1: no all-to-all


def test_all_to_all_crosses_nodes_where_the_ep_group_does():
    cfg = get_preset("qwen3-30b-a3b")
    cluster = Cluster(gpus=32, gpus_per_node=8, gpu_memory=80 << 30)
    evals = plan(cfg, cluster, 256, choices=Choices(tp=[1], stages=[1], offloads=["none"], recomputes=["full"],
                                                       micro_batches=[1], ep=[8, 16]))
    by_ep = {e.candidate.parallel.ep: e for e in evals}
    # ep=8 at tp=1: eight consecutive ranks, one node; ep=16 spans two nodes: 8 of each rank's 15 peers are away
    assert by_ep[8].ep_wire_bytes > 0 and by_ep[8].ep_inter_node_bytes == 0
    per_rank = by_ep[16].ep_wire_bytes - by_ep[16].comm["all_to_all/ep"]["wire_bytes"]
    crossing = by_ep[16].ep_inter_node_bytes - 8 * 8 * by_ep[16].comm["all_to_all/ep"]["peer_bytes"]
    assert crossing == pytest.approx(8 * per_rank * 8 / 15)


def test_routed_rows_typical_and_worst():
    cfg = get_preset("tiny-moe")  # E=4, k=2
    assert received_rows(cfg, 256, ep=2, case="typical") == 512
    assert received_rows(cfg, 256, ep=2, case="worst") == 2 * 256 * 2  # min(k, E/ep) = 2 of this rank's experts
    assert received_rows(cfg, 256, ep=4, case="worst") == 4 * 256 * 1  # one expert per rank
    assert received_rows(cfg, 256, ep=1, case="worst") == 512  # one rank holds all: nothing to pile up
    capped = cfg.replace(moe_expert_capacity_factor=1.0)  # ceil(1.0 * 128 * 2 / 4) = 64 per sequence
    assert received_rows(capped, 256, ep=4, case="worst", micro_batch=2) == 4 * 2 * 1 * 64
    typical = moe_layer_activation_bytes(cfg, 2, 1, False, 2, ep=2)
    worst = moe_layer_activation_bytes(cfg, 2, 1, False, 2, ep=4, case="worst")
    # router 8TE + 12Tk, experts pRh + 2*2*p*R*f', combine pTkh at T=256, R=512 (typical)
    assert typical == 8 * 256 * 4 + 12 * 256 * 2 + 2 * 512 * 128 + 4 * 2 * 512 * 256 + 2 * 256 * 2 * 128
    assert worst > typical


def test_ep_layouts_divide_dp_and_experts_and_rank():
    cfg = get_preset("mixtral-8x7b")  # 8 experts
    cluster = Cluster(gpus=48, gpus_per_node=8, gpu_memory=80 << 30)  # dp=48 at tp=1: 16 and 3 divide it
    layouts = enumerate_layouts(cfg, cluster, 96, Choices(tp=[1, 2], stages=[1], offloads=["none"],
                                                          recomputes=["full"], micro_batches=[1]))
    eps = {(c.dp, c.parallel.ep) for c in layouts}
    assert eps == {(48, 1), (48, 2), (48, 4), (48, 8), (24, 1), (24, 2), (24, 4), (24, 8)}  # not 3, 6, 12, 16...
    assert expert_parallel_sizes(cfg, 12) == [1, 2, 4]
    assert expert_parallel_sizes(get_preset("llama3-8b"), 16) == [1]  # a dense model
    assert all(int(c.zero_stage) != 3 for c in enumerate_layouts(cfg, cluster, 96, Choices(tp=[1])))


def test_dense_plan_unchanged_by_moe_support():
    cfg = get_preset("gpt2-small")
    cluster = Cluster(gpus=8, gpus_per_node=8, gpu_memory=32 << 30)
    evals = plan(cfg, cluster, 64, choices=Choices(tp=[1, 2], stages=[1], offloads=["none"], recomputes=["none"],
                                                   micro_batches=[1]))
    assert all(e.candidate.parallel.ep == 1 and not e.moe and e.ep_wire_bytes == 0 for e in evals)
    assert all("/ep" not in k and "/edp" not in k for e in evals for k in e.comm)
    assert all(e.memory.routed_worst == 0 for e in evals)


def _a2a_worker(ep: int, quantized: bool = False):
    cfg = get_preset("tiny-moe", num_layers=2, seq_length=16, moe_quantized_dispatch=quantized)
    topo = Topology(tp=1, ep=ep)
    torch.manual_seed(0)
    model = GPTModel(cfg, topo)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1 + topo.dp_rank))
    model(ids, labels=ids).backward()
    report = topo.comm.report()
    return {k: dict(v) for k, v in report.items() if k.endswith("/ep")}


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8-dispatch"])
def test_all_to_all_bytes_match_the_communicator(quantized):
    """A real step at ep=2 on 2 ranks (fp32, micro-batch 2 of 16 tokens, 2 MoE layers): the dispatch sends
    every chosen row, exactly the formula's payload; the combine returns what each rank's experts received, which
    adds up over the ep group to the same. With int8 dispatch each row travels packed, and the formula says so."""
    pytest.importorskip("model_zoo.moe")
    cfg = get_preset("tiny-moe", num_layers=2, seq_length=16, moe_quantized_dispatch=quantized)
    results = run_distributed(_a2a_worker, 2, 2, quantized)
    cand = Candidate(ParallelLayout(tp=1, dp=2, ep=2, precision="fp32"), micro_batch=2)
    planned = moe_volume(cfg, cand, micro_batches=1)
    for op in ("moe_dispatch", "moe_combine_grad"):  # the rows this rank routed: exactly T k h p per call
        for res in results:
            assert res[f"{op}/ep"]["calls"] == planned[f"{op}/ep"]["calls"] == 2
            assert res[f"{op}/ep"]["payload_bytes"] == planned[f"{op}/ep"]["payload_bytes"]
    for op in ("moe_combine", "moe_dispatch_grad"):  # what each rank's experts received: the sum is the formula's
        assert sum(r[f"{op}/ep"]["payload_bytes"] for r in results) == 2 * planned[f"{op}/ep"]["payload_bytes"]
    # bytes to the other rank: the ranks' sum is the balanced figure's only on average, so compare the totals of
    # dispatch leaving and combine arriving, which are the same rows
    sent = sum(r["moe_dispatch/ep"]["wire_bytes"] for r in results)
    returned = sum(r["moe_combine/ep"]["wire_bytes"] for r in results)
    assert sent == returned > 0
    if quantized:  # int8 values and one fp32 scale per block (h = 128: whole blocks) against 4 bytes a value
        plain = moe_volume(cfg.replace(moe_quantized_dispatch=False), cand, micro_batches=1)
        ratio = planned["moe_dispatch/ep"]["payload_bytes"] / plain["moe_dispatch/ep"]["payload_bytes"]
        assert cfg.hidden_size % DISPATCH_BLOCK == 0 and ratio == (DISPATCH_BLOCK + SCALE_BYTES) / (DISPATCH_BLOCK * 4)
