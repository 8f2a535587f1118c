"""hpZ (``zero.hpz_partition_size``) in the planner: the backward gathers' bytes and axis, the memory, the refusals.

The runtime (``hybrid.zero.secondary_partition``) keeps a secondary copy of the stage-3 weights sharded over the
``l`` dp ranks of each node and re-gathers every unit in backward from it, over ``dp_node``, unquantized. The
figures below are for DP=4 on two nodes of two (``l = 2``): ``dp_node`` rings 0→1→0 and 2→3→2 never cross; the
flat dp ring 0→1→2→3→0 crosses at 1→2 and 3→0 (one sender per node, ``3/4`` of each gathered buffer).
``tests/zero/test_hpz.py`` checks the same figures against the communicator's. The model is smaller than the
default keep window (forward would keep every unit for backward, leaving hpZ nothing to re-gather), so these
figures are for a keep window of 0: no prefetch window (``stage3_prefetch=0``, ``keep=0``), as for a model many
times the window.
"""

from __future__ import annotations

import json
import math

import pytest

from hybrid.compression import Quantization
from hybrid.layout import LayoutError, ParallelLayout
from hybrid.plan import TrainingSetup, predict_step_time
from hybrid.plan.candidate import Candidate
from hybrid.plan.cli import build_parser, main
from hybrid.plan.comm_volume import dp_volume, stage3_gathers
from hybrid.plan.compressed import packed_bytes
from hybrid.plan.estimate import estimate_memory, zero_layout
from hybrid.plan.links import LinkSpec, Placement, split_by_link
from hybrid.plan.model_memory import stage3_state_bytes
from hybrid.plan.setup import zero_default
from hybrid.plan.two_level import hpz_placement_problem
from model_zoo.config import GPTConfig
from tests.plan.test_compression import benchmark_cli_argv

P = 4  # fp32
SLOW = LinkSpec(math.inf, 6.25e6)  # 50 Mbit/s per node, NVLink never the bottleneck
NO_KEEP = dict(stage3_prefetch=0)  # nothing kept from forward into backward
HPZ = TrainingSetup(hpz_partition_size=2, **NO_KEEP)
PLACEMENT = Placement(tp=1, dp=4, nodes=2, ranks_per_node=2)


def _config() -> GPTConfig:
    """The slow-link benchmark's GPT: 4 layers, h=256, seq 256, fp32."""
    return GPTConfig(num_layers=4, hidden_size=256, num_heads=8, seq_length=256, vocab_size=1024).validate(1)


def _layout(tp: int = 1):
    return ParallelLayout(tp=tp, dp=4 // tp, zero_stage=3, precision="fp32")


def _units(tp: int = 1):
    return zero_layout(_config(), Candidate(_layout(tp), micro_batch=4))


def _predict(setup: TrainingSetup, tp: int = 1, global_batch: int = 16):
    return predict_step_time(_config(), _layout(tp), 4, global_batch, 2, 2, SLOW, 10e9, setup=setup)


def _per_collective(t):
    return {c.name: c for c in t.collectives}


def test_off_is_the_default_and_predicts_what_it_did():
    assert zero_default("hpz_partition_size") == TrainingSetup().hpz_partition_size == 1
    layout = _units()
    assert dp_volume(layout, 3, 2, hpz=1, keep=0) == dp_volume(layout, 3, 2, keep=0)
    assert _predict(TrainingSetup(hpz_partition_size=1)) == _predict(TrainingSetup())


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_backward_gathers_move_to_dp_node_and_forward_stays_on_dp(micro_batches):
    layout = _units()
    k, U = micro_batches, sum(layout.units)
    off, on = dp_volume(layout, 3, k, keep=0), dp_volume(layout, 3, k, hpz=2, keep=0)
    gathers = stage3_gathers(layout, k, keep=0)
    forward = sum(b * c for b, c in gathers["forward"]) + sum(b * c for b, c in gathers["after_step"])
    assert on["all_gather/dp_node"] == {"calls": k * len(layout.units), "payload_bytes": k * U * P,
                                        "wire_bytes": k * U * P / 2}  # (l-1)/l of each unit
    assert on["all_gather/dp"]["payload_bytes"] == forward
    assert on["all_gather/dp"]["payload_bytes"] + on["all_gather/dp_node"]["payload_bytes"] \
        == off["all_gather/dp"]["payload_bytes"]
    assert on["reduce_scatter/dp"] == off["reduce_scatter/dp"]  # the gradients still reduce over dp


def test_quantized_weights_pack_forward_only():
    """The secondary slices hold the dequantized forward values: backward's gathers carry them whole."""
    layout, q = _units(), Quantization(8, 256)
    on = dp_volume(layout, 3, 1, weights=q, hpz=2, keep=0)
    assert on["all_gather/dp_node"]["payload_bytes"] == sum(layout.units) * P
    packed_backward = sum(packed_bytes(q, u, 4) for u in layout.units)
    assert on["all_gather/dp"]["payload_bytes"] == \
        dp_volume(layout, 3, 1, weights=q, keep=0)["all_gather/dp"]["payload_bytes"] - packed_backward


def test_only_the_forward_gathers_cross_nodes():
    layout = _units()
    off = split_by_link(dp_volume(layout, 3, 1, keep=0), PLACEMENT)
    on = split_by_link(dp_volume(layout, 3, 1, hpz=2, keep=0), PLACEMENT)
    assert on["all_gather/dp_node"].inter_bytes_by_node == (0.0, 0.0)
    assert on["all_gather/dp_node"].intra_bytes_per_rank == sum(layout.units) * P / 2
    backward = sum(layout.units) * P
    # One sender per node on the flat ring, 3/4 of every gathered buffer.
    assert off["all_gather/dp"].inter_bytes_per_node - on["all_gather/dp"].inter_bytes_per_node == 3 / 4 * backward
    ratio = on["all_gather/dp"].inter_bytes_per_node / off["all_gather/dp"].inter_bytes_per_node
    assert 0.45 < ratio < 0.55  # about half: what forward gathers


def test_hpz_shortens_the_step_over_a_slow_link():
    off, on = _predict(TrainingSetup(**NO_KEEP)), _predict(HPZ)
    assert on.compute == off.compute
    assert on.inter_node_bytes_per_node < off.inter_node_bytes_per_node
    assert on.total < off.total
    node = _per_collective(on)["all_gather/dp_node"]
    assert node.link == "intra" and node.inter_node_bytes_per_node == 0
    # With int4 gradients and int8 weights as well (the benchmark's dp4-z3-q-hpz).
    both = dict(quantized_gradients="int4", quantized_weights="int8")
    assert _predict(TrainingSetup(hpz_partition_size=2, **both, **NO_KEEP)).total < \
        _predict(TrainingSetup(**both, **NO_KEEP)).total


def test_the_secondary_copy_is_a_node_share_of_the_gathered_units():
    layout = _units()
    off, on = stage3_state_bytes(layout), stage3_state_bytes(layout, hpz=2)
    assert off.secondary_weights == 0
    assert on.secondary_weights == P * sum(layout.units) // 2
    assert on.device_total == off.device_total + on.secondary_weights
    cand = Candidate(_layout(), micro_batch=4)
    m_off, m_on = estimate_memory(_config(), cand, TrainingSetup(**NO_KEEP)), estimate_memory(_config(), cand, HPZ)
    assert m_on.weights == m_off.weights + on.secondary_weights
    assert m_on.persistent == m_off.persistent + on.secondary_weights


def test_sizes_the_runtime_refuses_are_refused_in_its_words():
    from hybrid.zero.secondary_partition import hpz_size_problem

    assert hpz_placement_problem(2, 1, 4, 2) is None
    assert hpz_placement_problem(1, 2, 2, 2) is None  # off: always fine
    why = hpz_placement_problem(4, 1, 4, 2)
    assert why == hpz_size_problem(4, 2) == ("zero.hpz_partition_size = 4 but each node holds 2 data-parallel "
                                             "ranks of this group; set it to 2 (or 1 to turn hpZ off)")
    with pytest.raises(LayoutError) as refused:
        predict_step_time(_config(), _layout(), 4, 16, 2, 2, SLOW, 10e9, setup=TrainingSetup(hpz_partition_size=4))
    assert str(refused.value) == why
    # TP2 x DP2 on two nodes of two: one dp rank per node, nothing to shard over.
    assert "each node holds 1 data-parallel rank" in hpz_placement_problem(2, 2, 2, 2)
    with pytest.raises(ValueError, match="positive number"):
        TrainingSetup(hpz_partition_size=0)
    # Stages 0-2 are refused with the configuration's rule.
    refused_stage = ParallelLayout(tp=1, dp=4, zero_stage=2, precision="fp32")
    with pytest.raises(LayoutError, match="needs ZeRO stage 3"):
        predict_step_time(_config(), refused_stage, 4, 16, 2, 2, SLOW, 10e9, setup=HPZ)


def _stage3_argv(tmp_path):
    argv = benchmark_cli_argv(tmp_path, tp=1)
    at = argv.index("--zero-stage")
    return argv[:at + 1] + ["3"] + argv[at + 2:] + ["--stage3-prefetch", "0"]


def test_the_command_line_threads_the_flag(tmp_path, capsys):
    argv = _stage3_argv(tmp_path)
    assert build_parser().parse_args(argv).zero_hpz_partition_size == 1
    assert build_parser().parse_args(argv + ["--zero-hpz-partition-size", "2"]).zero_hpz_partition_size == 2
    assert main(argv) == 0
    off = json.loads(capsys.readouterr().out)[0]
    assert main(argv + ["--zero-hpz-partition-size", "2"]) == 0
    on = json.loads(capsys.readouterr().out)[0]
    assert "all_gather/dp_node" not in off["comm"] and "all_gather/dp_node" in on["comm"]
    assert on["inter_node_bytes_per_node"] < off["inter_node_bytes_per_node"]
    assert on["bytes"]["weights"] > off["bytes"]["weights"]
    table = [a for a in argv if a != "--json"]
    assert main(table + ["--zero-hpz-partition-size", "2"]) == 0
    assert "hpZ: ZeRO-3 backward re-gathers inside each node" in capsys.readouterr().out
    assert main(argv + ["--zero-hpz-partition-size", "4"]) == 2
    assert "zero.hpz_partition_size = 4 but each node holds 2" in capsys.readouterr().err
