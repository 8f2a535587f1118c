"""Model-state bytes: the planner's layout is the ZeRO optimizer's layout, and the ZeRO formulas follow."""

from __future__ import annotations

import pytest
import torch

from hybrid import Topology
from hybrid.plan.model_memory import flat_layout, shard_shapes, stage3_layout, stage3_state_bytes, state_bytes
from hybrid.zero.flat_buffer import build_flat_groups
from model_zoo import GPTModel, count_parameters, get_preset


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_shard_shapes_are_the_models_parameters(preset):
    config = get_preset(preset)
    model = GPTModel(config, Topology.local(), device="meta")
    assert [(s.name, s.shape) for s in shard_shapes(config, 1)] == \
        [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_tp_shards_add_up_to_the_model():
    config = get_preset("gpt2-medium")
    full = {s.name: s.numel for s in shard_shapes(config, 1)}
    for tp in (2, 4, 8):
        local = {s.name: s.numel for s in shard_shapes(config, tp)}
        assert local["layers.0.attention.qkv_proj.weight"] * tp == full["layers.0.attention.qkv_proj.weight"]
        assert local["layers.0.input_norm.weight"] == full["layers.0.input_norm.weight"]  # replicated
        vocab_rows = config.padded_vocab_size(tp) // tp
        assert local["embedding.word_embeddings.weight"] == vocab_rows * config.hidden_size
    padding = (config.padded_vocab_size(1) - config.vocab_size) * config.hidden_size
    assert sum(full.values()) == count_parameters(config) + padding


@pytest.mark.parametrize("bucket", [10**8, 30_000, 7_777])
@pytest.mark.parametrize("dp", [1, 4, 6])
@pytest.mark.parametrize("decay", [True, False])
def test_flat_layout_equals_the_optimizers_flat_groups(bucket, dp, decay):
    config = get_preset("tiny", num_layers=2)
    model = GPTModel(config, Topology.local()).to(torch.bfloat16)
    groups = build_flat_groups(model, parts=dp, pad_parts=dp, bucket_numel=bucket, use_weight_decay=decay,
                               no_weight_decay=lambda name, p: p.ndim < 2)
    layout = flat_layout(shard_shapes(config, 1), dp, "bf16", bucket, weight_decay=decay)
    assert layout.groups == tuple((g.numel, tuple(s.size for s in g.segments)) for g in groups)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_flat_layout_of_an_interleaved_stage_ends_segments_at_its_chunks(pp_rank):
    # Two chunks of two layers per rank: the optimizer ends a segment where the chunks reaching its parameters
    # change, and the planner lays the stage out the same way from a model built on meta.
    from hybrid.pipeline.chunks import chunk_parameters
    from hybrid.pipeline.split import split_layers

    config, split, bucket, dp = get_preset("tiny", num_layers=8), split_layers(8, 2, 2), 10**8, 2
    model = GPTModel(config, Topology.local(pp=2, pp_rank=pp_rank), split=split)
    chunks, chunk_params = chunk_parameters(model, pp_rank)
    assert chunks == 2 and [len(ps) for ps in chunk_params] != [0, 0]
    groups = build_flat_groups(model, parts=dp, pad_parts=dp, bucket_numel=bucket, use_weight_decay=True,
                               no_weight_decay=lambda name, p: p.ndim < 2, chunk_params=chunk_params)
    reach = [{id(p) for p in ps} for ps in chunk_params]
    for g in groups:
        held = [frozenset(c for c in range(chunks) if id(p) in reach[c]) for p in g.params]
        runs = 1 + sum(a != b for a, b in zip(held, held[1:]))
        # one bucket would hold the whole group: each run of parameters reached by the same chunks is a segment
        assert len(g.segments) == runs and all(len({held[r] for r in s.records}) == 1 for s in g.segments)
    assert max(len(g.segments) for g in groups) >= 2
    layout = flat_layout(shard_shapes(config, 1, split, pp_rank), dp, "fp32", bucket)
    assert layout.groups == tuple((g.numel, tuple(s.size for s in g.segments)) for g in groups)


def test_zero_formulas_per_stage():
    """16Ψ per replica in mixed precision with Adam; stage k partitions one more piece over N_d."""
    config = get_preset("gpt2-medium")
    dp = 8
    layout = flat_layout(shard_shapes(config, 1), dp, "bf16", 25_000_000)
    g = layout.numel
    s0, s1, s2 = (state_bytes(layout, k, precision="bf16") for k in range(3))
    assert (s0.weights, s0.grads, s0.master, s0.optimizer_states) == (2 * g, 2 * g, 4 * g, 8 * g)
    assert (s1.weights, s1.grads, s1.master + s1.optimizer_states) == (2 * g, 2 * g, 12 * g // dp)
    assert (s2.grads, s2.master + s2.optimizer_states) == (2 * g // dp, 12 * g // dp)
    units = stage3_layout(config, 1, dp, "bf16")
    s3 = stage3_state_bytes(units)
    part = units.partition_numel
    assert abs(part * dp - layout.unpadded) < (len(units.units) + 1) * dp * 64  # Ψ/N_d within unit padding
    # 16Ψ/N_d, plus the small parameters every rank keeps whole (2 bytes each).
    assert s3.weights + s3.grads + s3.master + s3.optimizer_states == 16 * part + 2 * units.persistent
    assert units.persistent < 0.01 * layout.unpadded
    assert s2.grad_buckets == 2 * 2 * layout.largest_segment  # two staging buckets of the largest segment
    # The padding the layout adds is less than one aligned unit per segment.
    assert 0 <= g - layout.unpadded < layout.segments * dp * 64


def test_fp32_master_is_the_weights_and_offload_moves_state_to_the_host():
    layout = flat_layout(shard_shapes(get_preset("tiny"), 1), 4, "fp32", 10**8)
    part = layout.partition_numel
    on_device = state_bytes(layout, 1, precision="fp32")
    assert on_device.master == 0 and on_device.optimizer_states == 8 * part
    layout = flat_layout(shard_shapes(get_preset("tiny"), 1), 4, "bf16", 10**8)
    offloaded = state_bytes(layout, 2, precision="bf16", offload="cpu")
    assert offloaded.master == offloaded.optimizer_states == 0 and offloaded.grads == 2 * part
    assert (offloaded.host_master, offloaded.host_optimizer_states) == (4 * part, 8 * part)
    assert offloaded.host_grads == 2 * 2 * part  # host twins of the gradient and weight chunks
    # On a CPU-only run the host *is* the device: offload changes nothing.
    assert state_bytes(layout, 2, precision="bf16", offload="cpu", host_is_device=True) == \
        state_bytes(layout, 2, precision="bf16")


def test_bad_combinations_are_refused_with_the_key():
    layout = flat_layout(shard_shapes(get_preset("tiny"), 1), 4, "bf16", 10**8)
    with pytest.raises(ValueError, match="offload"):
        state_bytes(layout, 0, precision="bf16", offload="cpu")
    with pytest.raises(ValueError, match="stage"):
        state_bytes(layout, 4, precision="bf16")


def test_stage3_gradient_flow_replays_the_reducer():
    from hybrid.plan.estimate import GradientFlow, stage3_gradient_flow

    # Units of 10 elements, buckets of 15 (so one unit each: a second would overflow it), dp 2, no prefetch.
    # Unit 2 is staged while unit 0's bucket (10 in, 5 out) is on the wire: 10 gathered + 2 x 10 (staging,
    # autograd's gradient) + 10 (unit 1, waiting in the open bucket) + 15 = 55. The final flush: units 0 and 1
    # on the wire (15 + 15, the cap of 2 x 15 input elements), unit 2's 10 in and 5 out = 45.
    flow = stage3_gradient_flow([10, 10, 10], 0, bucket_size=15, dp=2, prefetch=0, live=10**9)
    assert flow == GradientFlow(worst=55, worst_on_wire=10, final=45, final_on_wire=30)
    # Units that take autograd's gradient as their staging buffer hold it once: 10 less at the worst moment.
    adopted = stage3_gradient_flow([10, 10, 10], 0, bucket_size=15, dp=2, prefetch=0, live=10**9,
                                   copied=[False] * 3)
    assert adopted == GradientFlow(worst=45, worst_on_wire=10, final=45, final_on_wire=30)
    # Older buckets land before a new one launches: with units larger than the cap (2 x 1 element), one bucket
    # is on the wire at a time, so a deeper model holds no more.
    short = stage3_gradient_flow([20] * 10, 7, bucket_size=1, dp=4, prefetch=40, live=10**9)
    deep = stage3_gradient_flow([20] * 100, 7, bucket_size=1, dp=4, prefetch=40, live=10**9)
    assert short.worst == deep.worst == (20 + 40) + 2 * 20 + (20 + 5)
    # A cap of two buckets' worth lets two small buckets overlap: 3 units of 20 per bucket of 60, limit 120.
    wide = stage3_gradient_flow([20] * 12, 0, bucket_size=60, dp=4, prefetch=0, live=10**9)
    assert wide.worst_on_wire == 120
    # The live limit caps what is gathered with the unit.
    capped = stage3_gradient_flow([20] * 10, 7, bucket_size=1, dp=4, prefetch=40, live=30)
    assert capped.worst == deep.worst - 30


def test_stage3_gradient_flow_holds_the_passed_layers_gradients():
    from hybrid.plan.estimate import stage3_gradient_flow

    # Two layers of two units (10 and 20 elements), a persistent pool of 3, dp 2, reduced outputs of their own.
    # A bucket larger than the model launches nothing before the end of backward: the first layer (backward's
    # second) begins beside the persistent pool's buffer and both units of the layer above, 3 + 30.
    order, starts = [10, 20, 10, 20], (0, 2)
    big = stage3_gradient_flow(order, 3, bucket_size=100, dp=2, prefetch=0, live=10**9, layer_starts=starts)
    assert big.layers == (3, 3 + 30)
    # Buckets of 25: the 20-element unit launches the open bucket (10 in, 5 out) and waits in the next one.
    small = stage3_gradient_flow(order, 3, bucket_size=25, dp=2, prefetch=0, live=10**9, layer_starts=starts)
    assert small.layers == (3, 3 + 20 + (10 + 5))
    assert small.scaled(2).layers == (6, 76)


def test_stage3_units_that_are_one_parameter_are_not_copied():
    """With the small parameters pooled, every gathered unit is one weight, unpadded at DP 4: none is copied.
    Padding makes a copy (at DP 3 only the qkv weights fill their units), and so does a second parameter (with
    nothing pooled, GPT-2's linear layers share their units with their biases)."""
    llama = get_preset("llama-tiny", num_layers=2)
    assert not any(stage3_layout(llama, 1, 4, "bf16", 2000).backward_copied(llama.tie_embeddings))
    padded = stage3_layout(llama, 1, 3, "bf16", 0)
    assert padded.whole_parameter.count(True) == 2
    assert sum(padded.backward_copied(llama.tie_embeddings)) == len(padded.units) - 2
    gpt2 = get_preset("tiny", num_layers=2)
    with_bias = stage3_layout(gpt2, 1, 4, "bf16", 0)
    assert with_bias.whole_parameter.count(True) == 2  # the word and position embeddings alone


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_stage3_layer_starts_follow_the_backward_order(preset):
    config = get_preset(preset, num_layers=2)
    units = stage3_layout(config, 1, 4, "bf16", 2000)
    model = GPTModel(config, Topology.local(), device="meta")
    per_layer = sum(p.numel() > 2000 for p in model.layers[0].parameters())
    starts = units.backward_layer_starts(config.tie_embeddings)
    # A tied head's unit is done last, an untied head's first: the last layer begins after it.
    first = 0 if config.tie_embeddings else 1
    assert starts == (first, first + per_layer)
    order = units.backward_order(config.tie_embeddings)
    assert sum(order[starts[0]:starts[1]]) == units.layer_units


def test_stage3_on_gloo_point_to_point_counts_no_library_copies():
    # hybrid's point-to-point reduce-scatter sends from the bucket itself: the CPU profile's stage 3 has no
    # untracked copies, its receive buffers are tensors in the peak; a backend that copied inputs would add them.
    import dataclasses

    from hybrid.layout import ParallelLayout
    from hybrid.plan import CPU, Candidate, TrainingSetup, estimate_memory
    from model_zoo import GPTConfig

    cfg = GPTConfig(vocab_size=1024, hidden_size=1024, num_layers=2, num_heads=16, seq_length=32)
    candidate = Candidate(ParallelLayout(tp=1, dp=4, zero_stage=3, precision="fp32"), micro_batch=1)
    p2p = estimate_memory(cfg, candidate, TrainingSetup(bucket_size=10**6, profile=CPU))
    copying = dataclasses.replace(CPU, p2p_reduce_scatter=False)
    plain = estimate_memory(cfg, candidate, TrainingSetup(bucket_size=10**6, profile=copying))
    assert p2p.untracked == 0 and plain.untracked > 0
    assert p2p.peak > plain.peak  # the receive buffers ([numel / 4] x 3 per bucket in flight)


@pytest.mark.parametrize("dp", [2, 4])
def test_stage1_on_gloo_holds_the_receive_buffers_of_every_bucket_until_the_step(dp):
    """Stage 1 launches every bucket's reduce-scatter in backward and waits in the step. On gloo each runs as
    hybrid's direct point-to-point messages (:class:`hybrid.p2p_collectives.DirectReduceScatter`), which send
    from the gradient buffer itself and receive into ``n - 1`` chunk tensors: at the end of backward a rank
    holds ``(N_d-1)/N_d`` of its gradient beside the state, as tensors, and no library copy of the inputs.
    (The rule before counted the whole gradient as untracked copies: 1.08 GiB a rank at hidden 3456, where
    max_model_size measured 0.27 GiB less.) A backend that copied its inputs would hold all of them."""
    import dataclasses

    from hybrid.layout import ParallelLayout
    from hybrid.plan import CPU, Candidate, TrainingSetup, estimate_memory, zero_layout
    from hybrid.plan.estimate import flat_gradient_flow
    from model_zoo import GPTConfig

    cfg = GPTConfig(vocab_size=1024, hidden_size=1024, num_layers=2, num_heads=16, seq_length=32)
    candidate = Candidate(ParallelLayout(tp=1, dp=dp, zero_stage=1, precision="fp32"), micro_batch=1)
    setup = TrainingSetup(bucket_size=4_000_000, profile=CPU)
    est = estimate_memory(cfg, candidate, setup)
    layout = zero_layout(cfg, candidate, setup)
    segments = [size for _, sizes in layout.groups for size in sizes]
    assert len(segments) > 1 and all(size % dp == 0 for size in segments)
    received = 4 * sum((dp - 1) * size // dp for size in segments)
    assert received == (dp - 1) * est.grads // dp  # the whole gradient is in flight
    end_of_backward = est.state.device_total + est.activations.embedding + received
    assert est.untracked == 0 and est.resident_peak == est.peak == est.backward_peak
    # The end of backward holds them all; before it, the first layer's largest gradient sat beside the receive
    # buffers of every bucket launched before it (flat_gradient_flow), at least as much here.
    flow = flat_gradient_flow(layout, None, lambda inputs: 4 * sum((dp - 1) * size // dp for size in inputs))
    assert flow.final == tuple(size for _, size in layout.launches)
    assert est.backward_peak >= end_of_backward and est.gather_buffers == max(flow.layers)
    copying = estimate_memory(cfg, candidate, dataclasses.replace(setup, profile=dataclasses.replace(
        CPU, p2p_reduce_scatter=False)))
    assert copying.resident_peak == est.state.device_total + est.activations.embedding + est.grads
    assert copying.peak < est.peak and copying.untracked > 0


def test_a_layers_gradients_wait_beside_the_reductions_launched_before_them():
    """``flat_gradient_flow`` replays the reducer of whole parameters over the modules in backward order. Stage 1
    waits on nothing before the step: every layer passed adds its buckets to those in flight, and at the end all
    are. Stage 2 waits whenever a segment needs a staging buffer beyond its pool, so no more than the pool is in
    flight beside a gradient. Without buffers in flight (stage 0, NCCL) a layer's moment gains nothing."""
    from hybrid.plan.estimate import flat_gradient_flow
    from hybrid.zero.buckets import STAGING_BUFFERS_BEFORE_WAIT
    from model_zoo import GPTConfig

    h, dp = 256, 4
    cfg = GPTConfig(vocab_size=128, hidden_size=h, num_layers=4, num_heads=4, seq_length=16)
    params = shard_shapes(cfg, 1)
    layout = flat_layout(params, dp, "fp32", 4 * h * h)  # every MLP weight a bucket of its own
    arrived = [numel for _, module in layout.arrivals for numel, _ in module]
    assert arrived == [p.numel for p in reversed(params)]  # backward runs the model in reverse
    launches = [size for _, size in layout.launches]
    assert {segment for _, module in layout.arrivals for _, segment in module} == set(range(len(launches)))

    def received(inputs):  # the receive buffers of direct reduce-scatters, bytes
        return 4 * sum((dp - 1) * size // dp for size in inputs)

    whole = flat_gradient_flow(layout, None, received)
    assert len(whole.layers) == cfg.num_layers and whole.final == tuple(launches)
    assert list(whole.layers) == sorted(whole.layers) and whole.layers[-1] > whole.layers[0] > 0
    assert whole.layers[-1] < received(launches)  # the first layer's own buckets launch after its gradients
    pool = STAGING_BUFFERS_BEFORE_WAIT
    partitioned = flat_gradient_flow(layout, pool, received)
    assert len(partitioned.final) <= pool
    assert 0 < max(partitioned.layers) <= received(sorted(launches)[-pool:])
    assert flat_gradient_flow(layout, pool, lambda inputs: 0).layers == (0,) * cfg.num_layers


@pytest.mark.parametrize("stage,dp", [(1, 1), (1, 4), (3, 4)])
def test_a_background_save_counts_one_host_copy_of_the_ranks_state(stage, dp):
    """``checkpoint.async_save``: host memory grows by what DP rank 0 copies (its model shard, master and
    moments), which is what the snapshot of a real engine holds at dp=1; ``async_save_chunk_mb`` bounds it."""
    import hybrid
    from hybrid.checkpoint.save import rank_parts
    from hybrid.checkpoint.snapshot import state_nbytes
    from hybrid.layout import ParallelLayout
    from hybrid.plan.candidate import Candidate
    from hybrid.plan.estimate import estimate_memory
    from hybrid.plan.setup import TrainingSetup
    from hybrid.topology import Coord

    config = get_preset("tiny", num_layers=2)
    candidate = Candidate(ParallelLayout(tp=1, dp=dp, zero_stage=stage, precision="fp32"), micro_batch=1)
    sync = estimate_memory(config, candidate, TrainingSetup())
    background = estimate_memory(config, candidate, TrainingSetup(async_save=True))
    assert sync.snapshot == 0 and background.host == sync.host + background.snapshot
    # DP rank 0's copy: the whole model shard in the training precision, the fp32 partition three times.
    numel = sum(s.numel for s in shard_shapes(config, 1))
    assert 4 * numel + 12 * numel / dp <= background.snapshot <= (4 * numel + 12 * numel / dp) * 1.01
    bounded = estimate_memory(config, candidate, TrainingSetup(async_save=True, async_save_chunk_mb=1))
    assert bounded.snapshot == min(background.snapshot, 1 << 20)
    if dp == 1 and stage == 1:  # what the engine's save actually copies
        engine = hybrid.initialize(GPTModel(config, Topology.local()), {"zero": {"stage": 1}, "micro_batch_size": 1},
                                   topology=Topology.local())
        state = engine.state_dict()
        copied = sum(state_nbytes(v) for _, v in rank_parts(Coord(0, 0, 0), state["model"], state["optimizer"],
                                                            state["rng"]))
        assert background.snapshot <= copied <= background.snapshot + 64 * 1024  # + the RNG states and counters
        engine.close()
