"""Compressed ZeRO communication in the planner: bytes, links, step time, memory and the stage rule.

The byte model is the runtime communicator's (``hybrid.comm.Communicator.report``): a quantized reduce-scatter
is an all-to-all of packed chunks (``Quantization.wire_bytes(k)`` each, straight to every peer), a quantized
all-gather a ring of packed chunks. The figures below are worked out by hand.
"""

from __future__ import annotations

import json
import math

import pytest

from hybrid.compression import block_problem, compression_problem
from hybrid.layout import LayoutError, ParallelLayout
from hybrid.plan import Cluster, LinkSpec, Placement, TrainingSetup, predict_step_time
from hybrid.plan.candidate import Candidate
from hybrid.plan.cli import build_parser, main
from hybrid.plan.comm_volume import dp_volume, step_volume
from hybrid.plan.compressed import gather_buffers, reduction_buffers
from hybrid.plan.estimate import estimate_memory, flat_gradient_flow, zero_layout
from hybrid.plan.layouts import Choices, plan
from hybrid.plan.links import split_by_link
from hybrid.plan.setup import zero_default
from model_zoo import get_preset
from model_zoo.config import GPTConfig

INT8 = (1 + 4 / 256) / 4  # fp32 values -> one byte each plus a 4-byte scale per 256
INT4 = (0.5 + 4 / 256) / 4
SLOW = LinkSpec(math.inf, 6.25e6)  # 50 Mbit/s per node


def _config() -> GPTConfig:
    """The slow-link benchmark's GPT: 4 layers, h=256, seq 256, fp32 (trained 16 sequences per step)."""
    return GPTConfig(num_layers=4, hidden_size=256, num_heads=8, seq_length=256, vocab_size=1024).validate(1)


def _predict(tp: int, stage: int, setup: TrainingSetup, link: LinkSpec = SLOW):
    """Step time of ``tp × 4/tp`` fp32 ranks on 2 nodes of 2, micro batch 4, global batch 16."""
    layout = ParallelLayout(tp=tp, dp=4 // tp, zero_stage=stage, precision="fp32")
    return predict_step_time(_config(), layout, 4, 16, 2, 2, link, 10e9, setup=setup)


def _report(tp: int, stage: int, setup: TrainingSetup):
    candidate = Candidate(ParallelLayout(tp=tp, dp=4 // tp, zero_stage=stage, precision="fp32"), micro_batch=4)
    return step_volume(_config(), zero_layout(_config(), candidate, setup), candidate, 16 // (4 * candidate.dp),
                       gradients=setup.gradient_quant, weights=setup.weight_quant)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _per_collective(t):
    return {c.name: c for c in t.collectives}


# ---- (a), (b): bytes of stages 1-2 at TP2 x DP2 on two nodes of two ------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("fmt, ratio", [("int8", INT8), ("int4", INT4)])
def test_quantized_gradients_scale_the_dp_gradient_bytes(stage, fmt, ratio):
    plain, packed = TrainingSetup(), TrainingSetup(quantized_gradients=fmt, quantization_block=256)
    before, after = _report(2, stage, plain)["reduce_scatter/dp"], _report(2, stage, packed)["reduce_scatter/dp"]
    assert after["calls"] == before["calls"]
    for key in ("payload_bytes", "wire_bytes"):
        assert after[key] == pytest.approx(ratio * before[key], rel=0.01)
    # What crosses the node link: DP groups {0, 2} and {1, 3}, one peer on the other node per rank.
    slow, fast = _per_collective(_predict(2, stage, plain)), _per_collective(_predict(2, stage, packed))
    rs_before, rs_after = slow["reduce_scatter/dp"], fast["reduce_scatter/dp"]
    assert rs_after.inter_node_bytes_per_node == pytest.approx(ratio * rs_before.inter_node_bytes_per_node, rel=0.01)
    # The parameter all-gather is not a gradient collective: untouched.
    assert fast["all_gather/dp"].inter_node_bytes_per_node == slow["all_gather/dp"].inter_node_bytes_per_node


@pytest.mark.parametrize("stage", [1, 2])
def test_quantized_weights_scale_the_parameter_all_gather_only(stage):
    plain, packed = TrainingSetup(), TrainingSetup(quantized_weights="int8", quantization_block=256)
    before, after = _report(2, stage, plain), _report(2, stage, packed)
    assert after["reduce_scatter/dp"] == before["reduce_scatter/dp"]
    assert "peer_bytes" not in after["all_gather/dp"]  # still a ring
    for key in ("payload_bytes", "wire_bytes"):
        assert after["all_gather/dp"][key] == pytest.approx(INT8 * before["all_gather/dp"][key], rel=0.01)
    slow, fast = _per_collective(_predict(2, stage, plain)), _per_collective(_predict(2, stage, packed))
    assert fast["all_gather/dp"].inter_node_bytes_per_node == pytest.approx(
        INT8 * slow["all_gather/dp"].inter_node_bytes_per_node, rel=0.01)
    assert fast["reduce_scatter/dp"].inter_node_bytes_per_node == slow["reduce_scatter/dp"].inter_node_bytes_per_node


# ---- (c): the all-to-all at DP4 on two nodes of two -------------------------------------------------------------
def test_the_quantized_reduce_scatter_crosses_once_per_peer_on_another_node():
    """DP ring 0->1->2->3: every rank has one peer on its node and two on the other. Each rank sends its packed
    chunk i straight to rank i, so a node sends 2 ranks x 2 peers = 4 chunks off it per call (a ring would
    send 1 rank x 3 chunks), and every rank sends 1 chunk over its own link."""
    setup = TrainingSetup(quantized_gradients="int8", quantization_block=256)
    layout = zero_layout(_config(), Candidate(ParallelLayout(tp=1, dp=4, zero_stage=1, precision="fp32")), setup)
    report = dp_volume(layout, 1, gradients=setup.gradient_quant)
    # By hand: segment of s elements -> chunks of s/4 -> ceil(s/4 / 256) blocks of 256 bytes plus a 4-byte scale.
    sizes = [s for _, group in layout.groups for s in group]
    chunk_bytes = sum(_ceil(s // 4, 256) * (256 + 4) for s in sizes)
    entry = report["reduce_scatter/dp"]
    assert entry["peer_bytes"] == chunk_bytes and entry["payload_bytes"] == 4 * chunk_bytes
    assert entry["wire_bytes"] == 3 * chunk_bytes
    placement = Placement(tp=1, dp=4, nodes=2, ranks_per_node=2)
    assert placement.remote_peers("dp") == (4, 4) and placement.local_peers("dp") == 1
    split = split_by_link(report, placement)["reduce_scatter/dp"]
    assert split.inter_bytes_by_node == (4 * chunk_bytes, 4 * chunk_bytes)
    assert split.intra_bytes_per_rank == chunk_bytes
    assert split.steps == 3 * len(sizes)  # a message to each of 3 peers per call
    # The same bytes as a ring would have crossed at 1->2 and 3->0 only: 3 chunks per node.
    ring = split_by_link({"reduce_scatter/dp": {k: v for k, v in entry.items() if k != "peer_bytes"}},
                         placement)["reduce_scatter/dp"]
    assert ring.inter_bytes_by_node == (3 * chunk_bytes, 3 * chunk_bytes)


def test_stage_0_all_reduce_becomes_an_all_to_all_and_a_ring_all_gather():
    setup = TrainingSetup(quantized_gradients="int4", quantization_block=256)
    layout = zero_layout(_config(), Candidate(ParallelLayout(tp=1, dp=4, zero_stage=0, precision="fp32")), setup)
    report = dp_volume(layout, 0, gradients=setup.gradient_quant)
    assert set(report) == {"reduce_scatter/dp", "all_gather/dp"}  # as the communicator records it
    sizes = [s for _, group in layout.groups for s in group]
    chunk_bytes = sum(_ceil(_ceil(s, 4), 256) * (128 + 4) for s in sizes)  # int4: 128 bytes per 256 values
    assert report["reduce_scatter/dp"]["payload_bytes"] == report["all_gather/dp"]["payload_bytes"] == 4 * chunk_bytes
    assert "peer_bytes" not in report["all_gather/dp"]
    plain = dp_volume(layout, 0)["all_reduce/dp"]
    assert report["reduce_scatter/dp"]["payload_bytes"] == pytest.approx(INT4 * plain["payload_bytes"], rel=0.01)


# ---- (d): the step gets faster over a slow link -------------------------------------------------------------------
@pytest.mark.parametrize("tp, stage", [(1, 0), (2, 1), (2, 2), (1, 3)])
def test_quantization_shortens_the_step_over_a_slow_link(tp, stage):
    weights = "off" if stage == 0 else "int8"
    plain = _predict(tp, stage, TrainingSetup())
    grads = _predict(tp, stage, TrainingSetup(quantized_gradients="int8"))
    both = _predict(tp, stage, TrainingSetup(quantized_gradients="int4", quantized_weights=weights))
    assert both.inter_node_bytes_per_node < grads.inter_node_bytes_per_node < plain.inter_node_bytes_per_node
    assert both.total < grads.total < plain.total
    assert both.compute == plain.compute


def benchmark_cli_argv(tmp_path, tp: int) -> list:
    """The planner's command line for the slow-link benchmark's model on 2 nodes x 2 ranks at 50 Mbit/s, ZeRO-1."""
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"num_layers": 4, "hidden_size": 256, "num_heads": 8, "seq_length": 256,
                                "vocab_size": 1024}))
    return ["--config", str(path), "--gpus", "4", "--gpus-per-node", "2", "--gpu-memory", "16GiB",
            "--global-batch-size", "16", "--precision", "fp32", "--tp", str(tp), "--micro-batch", "4",
            "--recompute", "none", "--offload", "none", "--zero-stage", "1", "--inter-node-bandwidth", "0.00625",
            "--achieved-tflops", "0.01", "--json"]


def test_the_command_line_threads_the_flags(tmp_path, capsys):
    argv = benchmark_cli_argv(tmp_path, tp=2)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)[0]
    assert main(argv + ["--zero-quantized-gradients", "int8", "--zero-quantized-weights", "int8",
                        "--zero-quantization-block", "512"]) == 0
    packed = json.loads(capsys.readouterr().out)[0]
    ratio = (1 + 4 / 512) / 4
    for key in ("reduce_scatter/dp", "all_gather/dp"):
        assert packed["comm"][key]["payload_bytes"] == pytest.approx(ratio * plain["comm"][key]["payload_bytes"],
                                                                     rel=0.01)
    assert packed["step_time_s"]["total"] < plain["step_time_s"]["total"]
    # The flags' defaults are the configuration's.
    args = build_parser().parse_args(argv)
    assert (args.zero_quantized_gradients, args.zero_quantized_weights, args.zero_quantization_block) == \
        tuple(zero_default(k) for k in ("quantized_gradients", "quantized_weights", "quantization_block"))
    assert main(argv + ["--zero-quantized-gradients", "int8", "--zero-quantization-block", "12"]) == 2
    assert block_problem(12) in capsys.readouterr().err  # the rule's own words


# ---- (e): the stage rule ----------------------------------------------------------------------------------------
def test_quantized_weights_at_stage_0_are_refused_with_the_rule():
    why = compression_problem(0, "off", "int8", zero_default("quantization_block"))[1]
    setup = TrainingSetup(quantized_weights="int8")
    assert setup.compression_problem(0) == why and setup.compression_problem(1) is None
    with pytest.raises(LayoutError) as refused:
        _predict(1, 0, setup)
    assert str(refused.value) == why
    # The planner skips stage 0 and plans the others; asked for stage 0 alone it refuses, in the same words.
    cluster = Cluster(gpus=4, gpus_per_node=2, gpu_memory=2**34, achieved_tflops=0.01)
    choices = Choices(tp=[1], micro_batches=[4], recomputes=["none"], offloads=["none"], precision="fp32")
    stages = {int(e.candidate.zero_stage) for e in plan(_config(), cluster, 16, setup, choices)}
    assert stages == {1, 2, 3}
    with pytest.raises(LayoutError) as refused:
        plan(_config(), cluster, 16, setup, Choices(tp=[1], stages=[0], micro_batches=[4], precision="fp32"))
    assert str(refused.value) == why


def test_the_command_line_says_why_it_skips_a_stage(capsys):
    argv = ["--model", "tiny", "--gpus", "4", "--gpus-per-node", "2", "--gpu-memory", "16GiB",
            "--global-batch-size", "16", "--micro-batch", "4", "--tp", "1", "--zero-quantized-weights", "int8"]
    why = compression_problem(0, "off", "int8", zero_default("quantization_block"))[1]
    assert main(argv + ["--zero-stage", "0"]) == 2
    assert why in capsys.readouterr().err
    assert main(argv) == 0
    assert f"skipped ZeRO stage 0: {why}" in capsys.readouterr().out


# ---- memory: the packed buffers ----------------------------------------------------------------------------------
def test_packed_buffers_of_reductions_in_flight_and_of_the_step_gathers():
    """Stage 1 launches each bucket's reduction as backward fills it and waits in the step: each holds its packed
    send and receive buffers from its launch until then, so at the end of backward every bucket's are held, and
    a layer's gradients sit beside those of the buckets launched before them (``flat_gradient_flow``). Its
    quantized parameter gathers all launch before the first is waited on."""
    config = get_preset("gpt2-xl")
    candidate = Candidate(ParallelLayout(tp=1, dp=8, zero_stage=1, precision="bf16"), micro_batch=1,
                          recompute="full")
    plain = estimate_memory(config, candidate, TrainingSetup())
    grads = TrainingSetup(quantized_gradients="int8")
    layout = zero_layout(config, candidate, grads)
    sizes = [s for _, group in layout.groups for s in group]
    packed = reduction_buffers(grads.gradient_quant, sizes, 8, all_reduce=False)
    m = estimate_memory(config, candidate, grads)
    assert m.backward_peak >= plain.persistent + m.activations.embedding + packed
    # Nothing is waited on before the step, so the first layer's backward has the most in flight: the peak's
    # communication buffers are its packed buffers, beside a layer moment of the plain plan (no buffers there).
    flow = flat_gradient_flow(layout, None, lambda inputs: reduction_buffers(grads.gradient_quant, inputs, 8,
                                                                             all_reduce=False))
    assert m.comm_buffers == flow.layers[-1] == max(flow.layers) <= packed
    assert plain.backward_peak >= m.backward_peak - m.comm_buffers and m.backward_peak > plain.backward_peak
    weights = TrainingSetup(quantized_weights="int8")
    m = estimate_memory(config, candidate, weights)
    gathered = gather_buffers(weights.weight_quant, sizes, 8, layout.largest_segment, copies_output=False)
    assert m.step_peak == plain.step_peak + gathered
