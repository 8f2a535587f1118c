"""Two-level gradient reduction (``zero.two_level_reduce``) in the planner: bytes per link, step time, the refusal.

The model is the runtime communicator's (``Communicator._two_level_reduce_scatter`` / ``_two_level_all_reduce``):
for a dp group of ``n = l*m`` ranks, ``l`` on each of ``m`` nodes, a reduce-scatter of ``N = n*c`` elements is a
ring reduce-scatter of ``N`` over ``dp_node`` (the node's ``l`` ranks), then one of ``m*c`` over ``dp_cross``
(one rank per node; quantized: the all-to-all of ``m`` packed chunks of ``c``); stage 0's all-reduce is a
reduce-scatter over ``dp_node``, an all-reduce of the ``N/l`` share over ``dp_cross`` and an all-gather over
``dp_node``. The figures below are worked out by hand for DP=4 on two nodes of two (``l = m = 2``):

* flat ring 0→1→2→3→0: one rank per node sends off it, ``(n-1)/n = 3/4`` of the buffer per reduce-scatter;
* ``dp_cross`` rings 0→2→0 and 1→3→1: both ranks of a node send off it, ``(m-1)/m = 1/2`` of the node's
  share ``N/l = N/2`` each: ``2 · 1/2 · N/2 = N/2`` per node, ``2/3`` of the flat ring's ``3N/4``.
"""

from __future__ import annotations

import json
import math

import pytest

from hybrid.compression import Quantization
from hybrid.layout import LayoutError, ParallelLayout
from hybrid.plan import Cluster, LinkSpec, Placement, TrainingSetup, predict_step_time
from hybrid.plan import layouts as plan_layouts
from hybrid.plan import cli as plan_cli
from hybrid.plan.candidate import Candidate
from hybrid.plan.cli import build_parser, main
from hybrid.plan.comm_volume import dp_volume
from hybrid.plan.estimate import zero_layout
from hybrid.plan.layouts import Choices, plan, refused_placements
from hybrid.plan.links import split_by_link
from hybrid.plan.setup import zero_default, zero_field
from hybrid.plan.two_level import node_axis_groups, node_split, two_level_problem
from hybrid.topology import Grid, Nodes, TopologyError
from model_zoo.config import GPTConfig
from tests.plan.test_compression import benchmark_cli_argv

P = 4  # fp32
SLOW = LinkSpec(math.inf, 6.25e6)  # 50 Mbit/s per node, NVLink never the bottleneck
TWO = TrainingSetup(two_level_reduce=True)


def _config() -> GPTConfig:
    """The slow-link benchmark's GPT: 4 layers, h=256, seq 256, fp32."""
    return GPTConfig(num_layers=4, hidden_size=256, num_heads=8, seq_length=256, vocab_size=1024).validate(1)


def _layout(tp: int, stage: int):
    return ParallelLayout(tp=tp, dp=4 // tp, zero_stage=stage, precision="fp32")


def _predict(tp: int, stage: int, setup: TrainingSetup, global_batch: int = 16):
    """Step time of ``tp × 4/tp`` fp32 ranks on 2 nodes of 2, micro batch 4."""
    return predict_step_time(_config(), _layout(tp, stage), 4, global_batch, 2, 2, SLOW, 10e9, setup=setup)


def _bucket_sizes(tp: int, stage: int):
    layout = zero_layout(_config(), Candidate(_layout(tp, stage), micro_batch=4))
    return [s for _, group in layout.groups for s in group]


def _per_collective(t):
    return {c.name: c for c in t.collectives}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---- where the axes sit ---------------------------------------------------------------------------------------
def test_the_node_axes_at_dp4_on_two_nodes_of_two():
    assert node_split(1, 4, 2) == (2, 2)
    assert node_axis_groups(1, 4, 2, "dp_node") == [[0, 1], [2, 3]]
    assert node_axis_groups(1, 4, 2, "dp_cross") == [[0, 2], [1, 3]]
    placement = Placement(tp=1, dp=4, nodes=2, ranks_per_node=2)
    assert placement.group_size("dp_node") == placement.group_size("dp_cross") == 2
    assert placement.crossing_senders("dp_node") == (0, 0)  # never leaves the node
    assert placement.crossing_senders("dp_cross") == (2, 2)  # every hop crosses
    assert placement.crossing_senders("dp") == (1, 1)  # the flat ring: 1->2 and 3->0


def test_every_even_split_has_one_shape():
    """:func:`node_split` reads the first dp group's shape: every group that splits evenly splits alike."""
    for ranks_per_node in range(1, 9):
        for tp in range(1, 13):
            for dp in range(1, 13):
                if tp * dp % ranks_per_node:
                    continue
                nodes = Nodes(ranks_per_node)
                try:
                    splits = [nodes.split(g) for g in Grid(tp=tp, dp=dp, pp=1).all_groups("dp")]
                except TopologyError:
                    continue
                assert len({(len(s[0]), len(s)) for s in splits}) == 1, (ranks_per_node, tp, dp)


# ---- (a) stages 1-2 unquantized: 2/3 of the flat ring's inter-node bytes ---------------------------------------
@pytest.mark.parametrize("stage, global_batch", [(1, 16), (2, 16), (2, 32)])
def test_two_levels_send_two_thirds_of_the_flat_rings_gradient_bytes_off_a_node(stage, global_batch):
    sizes = _bucket_sizes(1, stage)
    reductions = global_batch // 16  # stage 2 reduces every micro-batch (16 sequences a micro-batch over DP4)
    N = sum(sizes) * reductions  # elements reduced per rank per step
    flat, two = _predict(1, stage, TrainingSetup(), global_batch), _predict(1, stage, TWO, global_batch)
    ring, cross = _per_collective(flat)["reduce_scatter/dp"], _per_collective(two)["reduce_scatter/dp_cross"]
    assert ring.inter_node_bytes_per_node == 3 / 4 * N * P  # one sender per node, 3/4 of the buffer
    assert cross.inter_node_bytes_per_node == 2 * (1 / 2) * (N / 2) * P  # two senders, 1/2 of the node's share
    assert cross.inter_node_bytes_per_node == pytest.approx(2 / 3 * ring.inter_node_bytes_per_node)
    node = _per_collective(two)["reduce_scatter/dp_node"]
    assert node.link == "intra" and node.inter_node_bytes_per_node == 0
    assert "reduce_scatter/dp" not in _per_collective(two)
    # The parameter all-gather after the step is not a reduction: unchanged.
    assert _per_collective(two)["all_gather/dp"] == _per_collective(flat)["all_gather/dp"]
    assert two.inter_node_bytes_per_node == pytest.approx(flat.inter_node_bytes_per_node - (3 / 4 - 1 / 2) * N * P)


def test_the_report_names_both_levels_as_the_communicator_does():
    layout = zero_layout(_config(), Candidate(_layout(1, 1), micro_batch=4))
    N = sum(_bucket_sizes(1, 1))
    report = dp_volume(layout, 1, node_split=(2, 2))
    calls = len(_bucket_sizes(1, 1))
    assert report["reduce_scatter/dp_node"] == {"calls": calls, "payload_bytes": N * P, "wire_bytes": N * P / 2}
    assert report["reduce_scatter/dp_cross"] == {"calls": calls, "payload_bytes": N * P / 2,
                                                 "wire_bytes": N * P / 4}
    split = split_by_link(report, Placement(tp=1, dp=4, nodes=2, ranks_per_node=2))
    assert split["reduce_scatter/dp_node"].intra_bytes_per_rank == N * P / 2
    assert split["reduce_scatter/dp_cross"].intra_bytes_per_rank == 0  # no hop stays on the node
    assert split["reduce_scatter/dp_cross"].steps == calls  # m - 1 = 1 ring step a call
    assert dp_volume(layout, 1, node_split=(1, 4)) == dp_volume(layout, 1)  # one rank per node: flat
    assert dp_volume(layout, 1, node_split=(4, 1)) == dp_volume(layout, 1)  # one node: flat


# ---- (b) int4 gradients: 1/l of the flat all-to-all ------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_quantized_two_levels_send_half_the_flat_all_to_alls_bytes_off_a_node(stage):
    quant = TrainingSetup(quantized_gradients="int4", quantization_block=256)
    both = TrainingSetup(quantized_gradients="int4", quantization_block=256, two_level_reduce=True)
    # Chunks of c = s/4 elements, packed to ceil(c/256) blocks of 128 bytes and a 4-byte scale.
    W = sum(_ceil(s // 4, 256) * (128 + 4) for s in _bucket_sizes(1, stage))
    flat = _per_collective(_predict(1, stage, quant))["reduce_scatter/dp"]
    cross = _per_collective(_predict(1, stage, both))["reduce_scatter/dp_cross"]
    assert flat.inter_node_bytes_per_node == 4 * W  # 2 ranks x 2 peers on the other node
    assert cross.inter_node_bytes_per_node == 2 * W  # 2 ranks x 1 peer (its dp_cross partner)
    assert cross.inter_node_bytes_per_node == flat.inter_node_bytes_per_node / 2  # 1/l
    # Only the step across nodes is quantized: inside the node the whole buffer, unpacked.
    node = _per_collective(_predict(1, stage, both))["reduce_scatter/dp_node"]
    assert node.inter_node_bytes_per_node == 0 and node.link == "intra"
    report = dp_volume(zero_layout(_config(), Candidate(_layout(1, stage), micro_batch=4)), stage,
                       gradients=Quantization(4, 256), node_split=(2, 2))
    assert report["reduce_scatter/dp_node"]["payload_bytes"] == sum(_bucket_sizes(1, stage)) * P
    assert "peer_bytes" not in report["reduce_scatter/dp_node"]
    assert report["reduce_scatter/dp_cross"]["peer_bytes"] == W
    assert report["reduce_scatter/dp_cross"]["payload_bytes"] == 2 * W


# ---- (c) one dp rank per node: nothing changes ------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("grads", ["off", "int8"])
def test_one_dp_rank_per_node_predicts_the_same_with_and_without_the_flag(stage, grads):
    """TP2 x DP2 on two nodes of two: dp groups {0, 2} and {1, 3}, one rank per node (l = 1)."""
    assert node_split(2, 2, 2) == (1, 2)
    off = _predict(2, stage, TrainingSetup(quantized_gradients=grads))
    on = _predict(2, stage, TrainingSetup(quantized_gradients=grads, two_level_reduce=True))
    assert on == off


# ---- (d) the step gets faster over a slow link ------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("grads", ["off", "int8"])
def test_two_levels_shorten_the_step_over_a_slow_link(stage, grads):
    flat = _predict(1, stage, TrainingSetup(quantized_gradients=grads))
    two = _predict(1, stage, TrainingSetup(quantized_gradients=grads, two_level_reduce=True))
    assert two.inter_node_bytes_per_node < flat.inter_node_bytes_per_node
    assert two.total < flat.total and two.compute == flat.compute
    # The step across nodes runs when the reduction is waited on: none of it hides behind backward.
    for c in two.collectives:
        if c.name.endswith("/dp_cross"):
            assert c.link == "inter" and c.exposed == c.seconds > 0


# ---- (e) stage 0: reduce-scatter in the node, all-reduce of the share across, all-gather in the node ------------
def test_stage_0_all_reduce_bytes_follow_the_model():
    layout = zero_layout(_config(), Candidate(_layout(1, 0), micro_batch=4))
    sizes = _bucket_sizes(1, 0)
    shares = [_ceil(s, 2) for s in sizes]  # s = ceil(N/l)
    S, calls = sum(shares), len(sizes)
    report = dp_volume(layout, 0, node_split=(2, 2))
    assert set(report) == {"reduce_scatter/dp_node", "all_reduce/dp_cross", "all_gather/dp_node"}
    assert report["reduce_scatter/dp_node"] == {"calls": calls, "payload_bytes": 2 * S * P, "wire_bytes": S * P}
    assert report["all_reduce/dp_cross"] == {"calls": calls, "payload_bytes": S * P, "wire_bytes": S * P}
    assert report["all_gather/dp_node"] == {"calls": calls, "payload_bytes": 2 * S * P, "wire_bytes": S * P}
    # Off the node: both ranks send 2(m-1)/m of the share; the flat ring, one rank 2(n-1)/n of the buffer.
    flat, two = _per_collective(_predict(1, 0, TrainingSetup())), _per_collective(_predict(1, 0, TWO))
    assert two["all_reduce/dp_cross"].inter_node_bytes_per_node == 2 * S * P
    assert flat["all_reduce/dp"].inter_node_bytes_per_node == 3 / 2 * sum(sizes) * P
    for name in ("reduce_scatter/dp_node", "all_gather/dp_node"):
        assert two[name].link == "intra"
    # Quantized: the quantized all-reduce of the share over dp_cross (an all-to-all, then a ring all-gather).
    W = sum(_ceil(_ceil(s, 2), 256) * (128 + 4) for s in shares)  # int4, chunks of ceil(share/m)
    quantized = dp_volume(layout, 0, gradients=Quantization(4, 256), node_split=(2, 2))
    assert set(quantized) == {"reduce_scatter/dp_node", "reduce_scatter/dp_cross", "all_gather/dp_cross",
                              "all_gather/dp_node"}
    assert quantized["reduce_scatter/dp_cross"]["peer_bytes"] == W
    assert quantized["all_gather/dp_cross"]["payload_bytes"] == 2 * W
    assert quantized["reduce_scatter/dp_node"] == report["reduce_scatter/dp_node"]
    assert quantized["all_gather/dp_node"] == report["all_gather/dp_node"]


# ---- a dp group not split evenly over the nodes -----------------------------------------------------------------
def _uneven_reason() -> str:
    """tp=3 x dp=4 on three nodes of four: dp group [0, 3, 6, 9] puts two ranks on node 0, one on the others."""
    with pytest.raises(TopologyError) as e:
        Nodes(4).split([0, 3, 6, 9])
    return f"zero.two_level_reduce: {e.value}"


def test_an_uneven_dp_group_is_refused_in_the_words_of_nodes_split():
    why = _uneven_reason()
    assert two_level_problem(3, 4, 4) == why
    assert two_level_problem(4, 3, 4) is None  # dp groups [0, 4, 8]...: one rank per node
    cfg = GPTConfig(num_layers=2, hidden_size=96, num_heads=12, seq_length=64, vocab_size=1024).validate(1)
    layout = ParallelLayout(tp=3, dp=4, zero_stage=1, precision="fp32")
    with pytest.raises(LayoutError) as refused:
        predict_step_time(cfg, layout, 1, 4, 3, 4, SLOW, 10e9, setup=TWO)
    assert str(refused.value) == why
    predict_step_time(cfg, layout, 1, 4, 3, 4, SLOW, 10e9)  # without the flag it plans


def _uneven_world(monkeypatch):
    """A 12-GPU cluster (3 nodes of 4) whose enumeration offers tp=3 x dp=4 (uneven) and tp=4 x dp=3."""
    cfg = GPTConfig(num_layers=2, hidden_size=96, num_heads=12, seq_length=64, vocab_size=1024).validate(1)
    cluster = Cluster(gpus=12, gpus_per_node=4, gpu_memory=2**34, achieved_tflops=0.01)
    candidates = [Candidate(ParallelLayout(tp=tp, dp=12 // tp, zero_stage=1, precision="fp32"), micro_batch=1)
                  for tp in (3, 4)]
    monkeypatch.setattr(plan_layouts, "enumerate_layouts",
                        lambda config, cl, gb, choices=Choices(): [c for c in candidates if c.tp in (choices.tp
                                                                                                      or (3, 4))])
    return cfg, cluster, candidates


def test_the_planner_skips_an_uneven_layout_with_the_reason(monkeypatch):
    cfg, cluster, candidates = _uneven_world(monkeypatch)
    why = _uneven_reason()
    assert refused_placements(candidates, cluster, TWO) == {(3, 4): why}
    assert refused_placements(candidates, cluster, TrainingSetup()) == {}
    assert [e.candidate.tp for e in plan(cfg, cluster, 12, TWO)] == [4]
    assert sorted(e.candidate.tp for e in plan(cfg, cluster, 12, TrainingSetup())) == [3, 4]
    with pytest.raises(LayoutError) as refused:  # nothing left: refused with the reason
        plan(cfg, cluster, 12, TWO, Choices(tp=[3]))
    assert str(refused.value) == why


def test_the_command_line_says_why_it_skips_a_layout(monkeypatch, tmp_path, capsys):
    _uneven_world(monkeypatch)
    monkeypatch.setattr(plan_cli, "enumerate_layouts", plan_layouts.enumerate_layouts)
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"num_layers": 2, "hidden_size": 96, "num_heads": 12, "seq_length": 64,
                                "vocab_size": 1024}))
    argv = ["--config", str(path), "--gpus", "12", "--gpus-per-node", "4", "--gpu-memory", "16GiB",
            "--global-batch-size", "12", "--precision", "fp32", "--achieved-tflops", "0.01"]
    assert main(argv + ["--zero-two-level-reduce"]) == 0
    out = capsys.readouterr().out
    assert f"skipped tp=3 x dp=4: {_uneven_reason()}" in out
    assert "DP gradients reduced inside each node, then across nodes" in out
    assert main(argv) == 0
    assert "skipped tp=3" not in capsys.readouterr().out


# ---- the flag -----------------------------------------------------------------------------------------------------
def test_the_command_line_threads_the_flag(tmp_path, capsys):
    argv = benchmark_cli_argv(tmp_path, tp=1)
    assert build_parser().parse_args(argv).zero_two_level_reduce is zero_default("two_level_reduce") is False
    assert build_parser().parse_args(argv + ["--zero-two-level-reduce"]).zero_two_level_reduce is True
    assert zero_field("two_level_reduce").metadata["help"] in " ".join(build_parser().format_help().split())
    assert main(argv) == 0
    flat = json.loads(capsys.readouterr().out)[0]
    assert main(argv + ["--zero-two-level-reduce"]) == 0
    two = json.loads(capsys.readouterr().out)[0]
    assert "reduce_scatter/dp" in flat["comm"] and "reduce_scatter/dp" not in two["comm"]
    assert {"reduce_scatter/dp_node", "reduce_scatter/dp_cross"} <= set(two["comm"])
    assert two["inter_node_bytes_per_node"] < flat["inter_node_bytes_per_node"]
    assert two["step_time_s"]["total"] < flat["step_time_s"]["total"]
