"""Communication volume formulas (the exact per-collective match with comm_report() is in test_truth.py)."""

from __future__ import annotations

from hybrid.plan.comm_volume import axis_wire_bytes, dp_volume, stage3_gathers, tp_volume
from hybrid.plan.model_memory import flat_layout, shard_shapes, stage3_layout
from hybrid.plan.setup import DEFAULT_SETUP
from hybrid.zero.param_gather import keep_numel
from model_zoo import get_preset


def _layout(dp=8, bucket=5_000_000):
    return flat_layout(shard_shapes(get_preset("gpt2-small"), 1), dp, "bf16", bucket)


def test_stages_1_and_2_move_what_stage_0_moves_and_stage_3_half_again():
    layout = _layout()
    wire = {k: axis_wire_bytes(dp_volume(layout, k), "dp") for k in range(3)}
    assert wire[1] == wire[0] == wire[2]
    psi_bytes = 2 * layout.numel
    assert wire[0] == 2 * psi_bytes * (layout.dp - 1) / layout.dp  # ring all-reduce of 2Ψ bytes
    # Stage 3 with nothing kept from forward into backward (keep=0: no prefetch window, no reuse distance):
    # gather forward, gather backward, reduce-scatter: 1.5x, within unit padding (untied head).
    llama = get_preset("llama-tiny")
    flat = flat_layout(shard_shapes(llama, 1), 8, "bf16", 5_000_000)
    units = stage3_layout(llama, 1, 8, "bf16", persistence_threshold=1000)
    ratio = axis_wire_bytes(dp_volume(units, 3, tied_head=False, keep=0), "dp") / \
        axis_wire_bytes(dp_volume(flat, 0), "dp")
    assert abs(ratio - 1.5) < 0.01
    # A tied head is gathered once more in forward, where the LM head uses the embedding outside its module.
    gpt = get_preset("gpt2-small")
    units = stage3_layout(gpt, 1, 8, "bf16")
    extra = axis_wire_bytes(dp_volume(units, 3, tied_head=True, keep=0), "dp") - \
        axis_wire_bytes(dp_volume(units, 3, tied_head=False, keep=0), "dp")
    assert extra == 2 * units.head_unit * 7 / 8


def test_stage_3_units_kept_from_forward_are_not_gathered_again():
    llama = get_preset("llama-tiny")
    flat = flat_layout(shard_shapes(llama, 1), 8, "bf16", 5_000_000)
    units = stage3_layout(llama, 1, 8, "bf16", persistence_threshold=1000)
    stage0 = axis_wire_bytes(dp_volume(flat, 0), "dp")

    def ratio(keep):
        return axis_wire_bytes(dp_volume(units, 3, tied_head=False, keep=keep), "dp") / stage0

    assert units.held_into_backward(0) == frozenset()
    # The default window (the prefetch window, 5e7 elements) covers this small model: every unit kept.
    assert DEFAULT_SETUP.stage3_keep == keep_numel(DEFAULT_SETUP.stage3_prefetch, DEFAULT_SETUP.stage3_reuse)
    assert sum(units.units) <= DEFAULT_SETUP.stage3_keep
    assert ratio(DEFAULT_SETUP.stage3_keep) == axis_wire_bytes(dp_volume(units, 3, tied_head=False), "dp") / stage0
    # Every unit kept: one gather per step and the reduce-scatter, stage 0's bytes (within unit padding).
    assert units.held_into_backward(sum(units.units)) == frozenset(range(len(units.units)))
    assert abs(ratio(sum(units.units)) - 1.0) < 0.01
    # A window of the head and the last layer's units: backward starts with them, the rest is gathered again.
    order = [units.head_index] + [i for i in reversed(range(len(units.units))) if i != units.head_index]
    window = sum(units.units[i] for i in order[:3])
    assert units.held_into_backward(window) == frozenset(order[:3])
    assert 1.0 < ratio(window) < ratio(0)
    # A tied head stays gathered from the lookup to the LM head only when every unit fits the window.
    gpt = get_preset("gpt2-small")
    tied = stage3_layout(gpt, 1, 8, "bf16")
    gathers = {keep: len(stage3_gathers(tied, 1, True, keep=keep)["forward"])
               for keep in (0, sum(tied.units) - 1, sum(tied.units))}
    assert gathers == {0: len(tied.units) + 1, sum(tied.units) - 1: len(tied.units) + 1,
                       sum(tied.units): len(tied.units)}


def test_one_collective_per_bucket_and_per_micro_batch_in_stage_2():
    layout = _layout()
    s0, s1, s2 = (dp_volume(layout, k, micro_batches=4) for k in range(3))
    assert set(s0) == {"all_reduce/dp"} and s0["all_reduce/dp"]["calls"] == layout.segments  # boundary only
    assert s1["reduce_scatter/dp"]["calls"] == layout.segments  # accumulation boundary only
    assert s1["all_gather/dp"]["calls"] == layout.segments
    assert s2["reduce_scatter/dp"]["calls"] == 4 * layout.segments
    assert s2["all_gather/dp"]["calls"] == layout.segments


def test_tensor_parallel_collectives_per_layer():
    config = get_preset("gpt2-small")
    n_h_bytes = 2 * config.seq_length * 4 * config.hidden_size  # micro batch 4, bf16
    plain = tp_volume(config, 4, 2, sequence_parallel=False, recompute="none", precision="bf16")
    big = plain["all_reduce/tp"]
    # Four [s, b, h] all-reduces per layer, the embedding's and the head input's gradient, and the loss's two.
    assert big["calls"] == 4 * config.num_layers + 2 + 2
    assert big["payload_bytes"] == (4 * config.num_layers + 2) * n_h_bytes + 3 * 4 * 4 * config.seq_length
    full = tp_volume(config, 4, 2, sequence_parallel=False, recompute="full", precision="bf16")
    assert full["all_reduce/tp"]["calls"] == big["calls"] + config.num_layers
    sp = tp_volume(config, 4, 2, sequence_parallel=True, recompute="none", precision="bf16")
    # Under SP the same activations move as all-gathers and reduce-scatters: the same ring bytes.
    moved = sp["all_gather/tp"]["wire_bytes"] + sp["reduce_scatter/tp"]["wire_bytes"]
    assert moved == (4 * config.num_layers + 2) * n_h_bytes  # 2(n-1)/n = 1 at tp=2
    assert tp_volume(config, 4, 1, sequence_parallel=False, recompute="none", precision="bf16") == {}
