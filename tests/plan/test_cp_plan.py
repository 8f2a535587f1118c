"""The planner with context parallelism: the 1/cp activation share plus the ring's blocks in flight, the ring's
bytes by hand, the overlap rule, the layouts the rules refuse, and dense output without cp unchanged."""

import json

import pytest

from hybrid.layout import LayoutError, ParallelLayout
from hybrid.plan import Candidate, Choices, Cluster, TrainingSetup, estimate_memory
from hybrid.plan.activations import activation_bytes
from hybrid.plan.cli import main
from hybrid.plan.context_parallel import (block_bytes, cp_problem_at, ring_bytes_per_layer, ring_in_flight,
                                          ring_overlap)
from hybrid.plan.layouts import enumerate_layouts, evaluate
from hybrid.plan.links import LinkSpec
from model_zoo import get_preset
from tests.plan.harness import train_step

GIB = 2**30
# Llama-3-8B: h=4096, 32 layers, 32 query heads of d=128, 8 key/value groups.
LLAMA = get_preset("llama3-8b").replace(seq_length=131072)


def test_activation_share_is_one_cp_th_plus_the_ring_blocks():
    cfg = get_preset("llama-tiny").replace(seq_length=4096)  # h=128, 8 heads, no grouping, RoPE, no dropout
    cluster = Cluster(gpus=8, gpus_per_node=8, gpu_memory=80 * GIB)
    setup = TrainingSetup()
    whole = activation_bytes(cfg, 1, precision="bf16").total
    for cp in (2, 4, 8):
        candidate = Candidate(ParallelLayout(tp=1, dp=8 // cp, zero_stage=1, precision="bf16"), cp=cp)
        e = evaluate(cfg, candidate, cluster, setup, global_batch=8 // cp)
        # every saved tensor is per token of the rank's s/cp (no s^2 term without the math kernel)
        assert e.memory.activations.total * cp == whole
        # the same layout with dp x cp data ranks on s/cp-token sequences, plus the ring's buffers
        plain = estimate_memory(cfg.replace(seq_length=4096 // cp),
                                Candidate(ParallelLayout(tp=1, dp=8, zero_stage=1, precision="bf16")), setup, 1)
        S = 4096 // cp
        B = 2 * 1 * S * 8 * 16 * 2  # [2, mb, g, S, d] in bf16
        dq = S * 8 * 16 * 4  # the running dq, fp32
        assert block_bytes(cfg, 1, 1, cp, "bf16") == B
        ring = ring_in_flight(cfg, 1, 1, cp, "bf16")
        assert (ring.forward, ring.backward) == (2 * B, 2 * B + 2 * 2 * B + dq)
        # the ring's buffers count at the last layer's attention: every layer's saved bytes and the buffers
        # (backward: and the layer's incoming gradient, p S h), or the plain peak (the loss's) when larger
        layers = plain.state.device_total + plain.activations.total - plain.activations.head
        assert e.memory.forward_peak == max(plain.forward_peak, layers + 2 * B)
        assert e.memory.backward_peak == max(plain.backward_peak, layers + 2 * B + 4 * B + dq + 2 * S * 128)
        # ZeRO-1 over dp x cp = 8 ranks whatever cp: the optimizer state does not grow as dp shrinks
        assert e.memory.state == plain.state


def test_ring_bytes_by_hand():
    # cp 4 on 128K tokens: S = 32768; B = 2 * 32768 * 8 * 128 * 2 = 128 MiB; the dK/dV sum in fp32, 256 MiB
    B, Bq = 2 * 32768 * 8 * 128 * 2, 2 * 32768 * 8 * 128 * 4
    assert B == 128 << 20
    ring = ring_bytes_per_layer(LLAMA, 1, 1, 4, "bf16")
    assert (ring.forward, ring.backward, ring.recompute) == (3 * B, 3 * B + 4 * Bq, 0)
    assert ring_bytes_per_layer(LLAMA, 1, 1, 4, "bf16", "full").recompute == 3 * B
    # TP 2 halves the key/value groups a rank holds
    assert ring_bytes_per_layer(LLAMA, 1, 2, 4, "bf16").forward == 3 * B // 2
    assert ring_bytes_per_layer(LLAMA, 1, 1, 1, "bf16").total == 0
    # per step: 32 layers x the accumulation steps
    cluster = Cluster(gpus=32, gpus_per_node=8, gpu_memory=80 * GIB)
    c = Candidate(ParallelLayout(tp=1, dp=8, zero_stage=1, precision="bf16"), cp=4)
    e = evaluate(LLAMA, c, cluster, TrainingSetup(), global_batch=16)
    assert e.accumulation == 2
    assert e.comm["ring/cp"]["wire_bytes"] == 32 * 2 * (6 * B + 4 * Bq)
    assert e.cp_wire_bytes == 32 * 2 * (6 * B + 4 * Bq)
    assert ring_in_flight(LLAMA, 1, 1, 4, "bf16").forward == 2 * B


def test_overlap_rule_by_hand():
    B, Bq = 128 << 20, 256 << 20
    flops = 40e12
    attention = 4 * 2 * 16384 * 16384 * 32 * 128 / flops  # one 2L x L step, L = s / 2cp = 16384
    fast = LinkSpec(intra_bytes_per_s=150e9, inter_bytes_per_s_per_node=100e9)
    o = ring_overlap(LLAMA, 1, 1, 4, 8, "bf16", "none", 8, fast, flops)
    assert o.attention_s == pytest.approx(attention) and o.transfer_s == pytest.approx(B / 150e9)
    assert o.hidden and not o.crosses_nodes
    slow = LinkSpec(intra_bytes_per_s=2e8, inter_bytes_per_s_per_node=100e9)
    o = ring_overlap(LLAMA, 1, 1, 4, 8, "bf16", "none", 8, slow, flops)
    expect = 3 * (max(0, B / 2e8 - attention) + max(0, (B + Bq) / 2e8 - 2 * attention))
    assert o.exposed_s == pytest.approx(expect) and expect > 0
    # cp 16 at tp 1 on nodes of 8: each of the two rings (ranks 0-15, 16-31) spans two nodes, and on each node
    # one rank (7, 15, ...) sends off it: the node's link carries one block per step
    o = ring_overlap(LLAMA, 1, 1, 16, 2, "bf16", "none", 8, LinkSpec(1e30, 1e9), flops)
    B16 = B // 4
    assert o.crosses_nodes and o.transfer_s == pytest.approx(B16 * 1 / 1e9)


def test_layouts_refused_by_the_rules_never_appear():
    cluster = Cluster(gpus=32, gpus_per_node=8, gpu_memory=80 * GIB)
    cfg = LLAMA.replace(seq_length=6000)  # 6000 = 2^4 * 375: 2 x cp divides it up to cp 8, not at cp 16
    wanted = (1, 2, 4, 8, 16)
    layouts = enumerate_layouts(cfg, cluster, 32, Choices(cp=wanted, stages=(1,), recomputes=("none",)))
    seen = {(c.tp, c.cp) for c in layouts}
    assert {cp for _, cp in seen} == {1, 2, 4, 8}
    for tp, cp in seen:
        assert cp_problem_at(cfg, tp, cp, False) is None
    assert cp_problem_at(cfg, 1, 16, False).startswith("--seq-length 6000 must be divisible by 2 x")
    # under sequence parallelism s / cp must divide by tp too: 6000 / 8 = 750 is not a multiple of 4 or 8
    sp = enumerate_layouts(cfg, cluster, 32, Choices(cp=wanted, stages=(1,), recomputes=("none",),
                                                     sequence_parallel=True))
    for c in sp:
        assert (6000 // c.cp) % c.tp == 0
    assert not any(c.cp == 8 and c.tp >= 4 for c in sp)
    # a model with attention dropout cannot take cp > 1 at all
    with pytest.raises(LayoutError, match="--context-parallel-size"):
        enumerate_layouts(get_preset("gpt2-small").replace(seq_length=1024), cluster, 32, Choices(cp=(2, 4)))


def _run(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out


def test_dense_output_without_cp_is_unchanged(capsys):
    argv = ["--model", "llama-tiny", "--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "8GiB",
            "--global-batch-size", "16", "--zero-stage", "1", "--recompute", "none", "--top", "5"]
    default = _run(capsys, argv)
    one = _run(capsys, argv + ["--context-parallel-size", "1"])
    assert default == one
    header = next(line for line in default.splitlines() if line.strip().startswith("#"))
    assert " cp " not in header and "CP GB" not in header and "CP:" not in default
    rows = json.loads(_run(capsys, argv + ["--json"]))
    assert rows and not any("cp" in r for r in rows)
    with_cp = _run(capsys, argv + ["--context-parallel-size", "1", "2"])
    assert "CP GB" in with_cp and "CP:" in with_cp


def test_128k_llama3_8b_needs_cp(capsys):
    argv = ["--model", "llama3-8b", "--seq-length", "131072", "--global-batch-size", "8", "--gpus", "32",
            "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--zero-stage", "1", "2", "3", "--recompute", "none",
            "--context-parallel-size", "1", "2", "4", "8", "16", "32", "--json"]
    rows = json.loads(_run(capsys, argv))
    fitting = [r for r in rows if r["fits"]]
    # 128K tokens split only by TP do not fit 80 GiB; the tokens a rank holds, s / (tp x cp), must be 4K-16K
    assert fitting and all(r.get("cp", 1) > 1 and 8 <= r["tp"] * r["cp"] <= 32 for r in fitting)
    assert min(r["bytes"]["total"] for r in rows if r.get("cp", 1) == 1) > 80 * GIB
    best = fitting[0]
    assert best["tp"] * best.get("cp", 1) * best["dp"] == 32


# ---- measured: 16K tokens of a small model on 4 gloo ranks, CP1 (dp 4) against CP4 (the ring) ----

MEASURED_SEQ = 16384
# h=64 in 4 heads of 16, 2 layers, a vocabulary of 256: activations (per token, 1/cp each) dominate the ~0.1 MB
# of weights and optimizer state
MEASURED = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, seq_length=MEASURED_SEQ,
                hidden_dropout=0.0, attention_dropout=0.0, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                tie_embeddings=False)
PEAK_MARGIN = 0.05  # tests/plan/test_truth.py's margin on the peak


def _measure_cp_peaks(cps):
    """In every rank of a world of 4: for each cp, one warm-up step and one measured step (fp32, ZeRO-1 over
    dp x cp, micro batch 1), the most live tensor bytes during it above what the process held before any model
    (hybrid.plan.measure.LiveTensorTracker, as tests/plan/harness.py measures)."""
    import gc

    import torch

    import hybrid
    from hybrid import Topology
    from hybrid.plan.measure import LiveTensorTracker, live_tensor_bytes
    from model_zoo import GPTConfig, GPTModel

    torch.manual_seed(0)
    baseline = live_tensor_bytes()
    out = []
    for cp in cps:
        topo = Topology(cp=cp)
        cfg = GPTConfig(**MEASURED)
        model = GPTModel(cfg, topo)
        model.check_inputs = False
        engine = hybrid.initialize(model, {"precision": "fp32", "zero": {"stage": 1, "bucket_size": 10**8},
                                           "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1},
                                           "micro_batch_size": 1, "gradient_accumulation_steps": 1,
                                           "recompute": "none", "steps_per_print": 0}, topology=topo)
        # every rank of a cp group reads the same whole sequence (the model keeps its chunks)
        x = torch.randint(0, cfg.vocab_size, (1, MEASURED_SEQ), generator=torch.Generator().manual_seed(7))

        train_step(engine, [x])
        with LiveTensorTracker() as tracker:
            peaks = [p - baseline for p in train_step(engine, [x], tracker)]
        out.append({"cp": cp, "forward_peak": peaks[0], "backward_peak": peaks[1], "peak": max(peaks)})
        engine.optimizer.remove_hooks()
        engine.close()
        del model, engine
        gc.collect()
    return out


@pytest.mark.slow
def test_cp4_peak_per_rank_measured_against_cp1_and_the_prediction():
    """~30 s: CP4's peak per rank at most 0.35x CP1's, and each within test_truth's 5% of the planner's."""
    from hybrid.plan import CPU
    from hybrid.plan.layouts import estimate_cp_memory
    from model_zoo import GPTConfig
    from tests.multiproc import run_distributed

    results = run_distributed(_measure_cp_peaks, 4, [1, 4], timeout=300)
    cfg = GPTConfig(**MEASURED)
    setup = TrainingSetup(bucket_size=10**8, profile=CPU)
    one = estimate_memory(cfg, Candidate(ParallelLayout(tp=1, dp=4, zero_stage=1, precision="fp32")), setup, 1)
    four = estimate_cp_memory(cfg, Candidate(ParallelLayout(tp=1, dp=1, zero_stage=1, precision="fp32"), cp=4),
                              setup, 1)
    for rank, (cp1, cp4) in enumerate(results):
        print(f"rank {rank}: peak CP1 {cp1['peak']} (predicted {one.peak}), CP4 {cp4['peak']} (predicted "
              f"{four.peak}), ratio {cp4['peak'] / cp1['peak']:.3f}")
        assert cp4["peak"] <= 0.35 * cp1["peak"]
        assert abs(cp1["peak"] - one.peak) <= PEAK_MARGIN * one.peak
        assert abs(cp4["peak"] - four.peak) <= PEAK_MARGIN * four.peak
