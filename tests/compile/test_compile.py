"""Regional compilation (model_zoo.compile, issue 51): the graph-break counts, and training parity with one eager
process.

Graph breaks. A dense block at TP1 is one graph with no break, and every block reuses it (no recompile with
depth): the default run holds that with dynamo alone (backend ``eager``: the counts are dynamo's, whatever backend
lowers the graphs). So is a dense block at TP2, its collectives traced as functional collectives (the default run
holds that at world 2 without sequence parallelism). Other layouts break where model_zoo.compile says (ZeRO-3's
hooks, the selective checkpoint, an MoE layer's routed experts, context-parallel attention); the measured count of
each, per compiled block and the same at every depth, is :data:`BLOCK_GRAPHS` (slow, multi-process; the default run
holds the one-process MoE block's), which docs/compile.md quotes. A change that adds a break fails these tests.

MoE and context parallelism. The default run checks a compiled MoE block against eager in one process, with the
side channels a graph could bake in or skip (the balancing losses' gradient scale, the routing statistics, the
expert bias), and that the trainer's validation takes both with --torch-compile.

Accounting. The communicator's report for the "tp" axis of a compiled TP2 run is the eager run's (default run:
TP2; slow: sequence parallelism, with selective recompute and biases), and under full recompute it counts the
collectives the compiled replay runs beyond the eager one's. Slow: the "ep" report of a compiled MoE block at
DP2 x EP2 is the eager run's (its all-to-alls run eagerly).

Parity. 10 AdamW steps, fp32, compiled with inductor against one eager process in plain PyTorch
(tests/engine/parity_training.py, its bounds unchanged): transformer_bound costs every reduction at gamma(k) in any
summation order, which is what fusion changes (inductor reorders and blocks the sums of a fused kernel), and each
elementary function at ELEMENTARY roundings, which covers inductor's own vectorized exp/tanh; fusing an elementwise
chain only drops intermediate roundings. The default run keeps one process at TP1; the layouts of the issue are
slow, with an MoE model at DP2 x EP2 and CP2 x DP2 (ring, packed documents).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.engine.parity_training import MICRO, MOE, SEED, WORLD, bounds, check, data, reference, train
from tests.multiproc import run_distributed

DENSE = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, seq_length=16, init_std=0.05, bias=False,
             position="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False)
GQA = dict(DENSE, num_query_groups=2, rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_positions=8)
GPT2 = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, seq_length=16, init_std=0.05)

# A tiny MoE block (model_zoo.moe): top-2 of 4 experts, the balancing loss on, dropless; experts have no biases.
TINY_MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "moe_aux_loss_coeff": 0.01,
            "bias": False}

# Graphs and graph breaks dynamo counts while compiling one block's forward and backward, by layout (torch 2.13;
# measured, at 2 and 4 layers alike). At TP2 the tensor-parallel collectives are functional collectives that dynamo
# traces (hybrid.tensor_parallel.traceable): a dense block is one graph, with or without sequence parallelism.
# What still breaks: selective recompute's checkpoint of the attention core, ZeRO-3's hooks, an MoE layer's routed
# experts (MoELayer._routed_experts: counted twice, as the block's frame stops at the MoE layer's call and the
# layer's own frame at the routed call; 3 graphs: the block up to the MoE layer, the router, the residual after it)
# and context-parallel attention (one break per attention call, 2 graphs).
BLOCK_GRAPHS = {  # name: (world, topology axes, zero stage, model overrides) -> (graphs, breaks)
    "tp1": ((1, {}, 1, {}), (1, 0)),
    "tp1-full-recompute": ((1, {}, 1, {"recompute": "full"}), (1, 0)),
    "tp1-selective": ((1, {}, 1, {"recompute": "selective"}), (4, 2)),
    "dp2-zero1": ((2, {}, 1, {}), (1, 0)),
    "tp2": ((2, {"tp": 2}, 1, {}), (1, 0)),
    "tp2-sp": ((2, {"tp": 2}, 1, {"sequence_parallel": True}), (1, 0)),
    "tp2-sp-selective": ((2, {"tp": 2}, 1, {"sequence_parallel": True, "recompute": "selective"}), (4, 2)),
    "dp2-zero3": ((2, {}, 3, {}), (9, 8)),
    "moe": ((1, {}, 1, TINY_MOE), (3, 2)),
    "moe-shared-expert-capacity-bias": ((1, {}, 1, {**TINY_MOE, "moe_shared_expert_intermediate_size": 64,
                                                    "moe_expert_capacity_factor": 1.0, "moe_z_loss_coeff": 1e-3,
                                                    "moe_router_enable_expert_bias": True}), (4, 2)),
    "moe-full-recompute": ((1, {}, 1, {**TINY_MOE, "recompute": "full"}), (3, 2)),
    "moe-selective": ((1, {}, 1, {**TINY_MOE, "recompute": "selective"}), (6, 4)),
    "dp2-ep2-moe": ((2, {"ep": 2}, 1, TINY_MOE), (3, 2)),
    "tp2-sp-moe": ((2, {"tp": 2}, 1, {**TINY_MOE, "sequence_parallel": True}), (3, 2)),
    "cp2-documents": ((2, {"cp": 2}, 1, {}), (4, 3)),
    "cp2-a2a-documents": ((2, {"cp": 2}, 1, {"cp_comm_type": "a2a"}), (4, 3)),
    "cp2-moe-documents": ((2, {"cp": 2}, 1, TINY_MOE), (6, 5)),
}


def count_block_graphs(axes: dict, stage: int, overrides: dict, layers: int = 2, backend: str = "eager"):
    """Two training steps of a ``layers``-layer tiny GPT with its blocks compiled, on a topology of ``axes``
    (``tp``, ``ep``, ``cp``; the rest of the world is dp); at cp > 1 each sequence packs two documents. Returns
    (graphs, breaks) and whether the loss is finite. Runs in the calling process (world 1) or one rank of
    run_distributed."""
    import hybrid
    from hybrid.config.parse import config_from_dict
    from model_zoo import GPTModel, get_preset
    from model_zoo.compile import compile_blocks
    from model_zoo.transformer import TransformerLayer

    torch._dynamo.reset()  # a block compiled by an earlier test of this process would be a cache hit
    topo = hybrid.Topology(**axes, timeout_s=60)
    cfg = get_preset("tiny").replace(num_layers=layers, seq_length=32, **overrides)
    model = GPTModel(cfg, topo, seed=1)
    zero = {"stage": stage, **({"persistence_threshold": 0} if stage == 3 else {})}
    engine = hybrid.initialize(model, config_from_dict({
        "optimizer": {"type": "adamw", "lr": 1e-3}, "zero": zero, "steps_per_print": 0, "micro_batch_size": 2,
        "global_batch_size": 2 * topo.dp_size}), topology=topo)
    report = compile_blocks(model, backend=backend)
    assert report.blocks == layers and all(isinstance(m, TransformerLayer) for m in model.layers.children())
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if topo.cp_size > 1:  # document masking's ids flow through the compiled block into the attention
        batch["document_ids"] = (torch.arange(32) >= 11).long().expand(2, 32)
    losses = [engine.train_batch([batch])[1] for _ in range(2)]
    figures = report.figures()
    engine.close()
    topo.close()
    return int(figures["graphs"]), int(figures["breaks"]), all(map(lambda x: x == x, losses))


def tp_traffic(overrides: dict, backend: str = "eager", axes: Optional[dict] = None, axis: str = "tp"):
    """One rank of TP2 (or of a topology of ``axes``): the ``axis`` part of the engine's communication report
    (``comm_report``: the last global batch) after 2 training steps, eager and with the blocks compiled; and the
    compiled run's (graphs, breaks)."""
    import hybrid
    from hybrid.config.parse import config_from_dict
    from model_zoo import GPTModel, get_preset
    from model_zoo.compile import compile_blocks

    torch._dynamo.reset()
    topo = hybrid.Topology(**(axes or {"tp": 2}), timeout_s=60)
    cfg = get_preset("tiny").replace(num_layers=2, seq_length=32, **overrides)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    reports, figures = [], None
    for compiled in (False, True):
        model = GPTModel(cfg, topo, seed=1)
        engine = hybrid.initialize(model, config_from_dict({
            "optimizer": {"type": "adamw", "lr": 1e-3}, "steps_per_print": 0, "micro_batch_size": 2,
            "global_batch_size": 2 * topo.dp_size}), topology=topo)
        report = compile_blocks(model, backend=backend) if compiled else None
        for _ in range(2):
            engine.train_batch([{"input_ids": ids, "labels": ids}])
        reports.append({k: v for k, v in engine.comm_report().items() if k.endswith("/" + axis)})
        figures = report and report.figures()
        engine.close()
    topo.close()
    return reports, (int(figures["graphs"]), int(figures["breaks"]))


def test_a_compiled_tp2_block_is_one_graph_and_its_collectives_are_counted_as_eager():
    """The one fast case of functional collectives (hybrid.tensor_parallel.traceable): at TP2 a dense block is one
    graph with no break, and the communicator's report for the "tp" axis (calls, payload, wire bytes) is the eager
    run's."""
    for (eager, compiled), counts in run_distributed(tp_traffic, 2, {}, timeout=300):
        assert counts == (1, 0)
        assert compiled == eager and eager["all_reduce/tp"]["calls"] > 0, (eager, compiled)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{"sequence_parallel": True},
                                       {"sequence_parallel": True, "recompute": "selective", "bias": True}],
                         ids=["sp", "sp-selective-bias"])
def test_compiled_collectives_are_counted_as_eager(overrides):
    for (eager, compiled), _ in run_distributed(tp_traffic, 2, overrides, timeout=300):
        assert compiled == eager and len(eager) >= 2, (eager, compiled)


@pytest.mark.slow
def test_a_compiled_moe_block_counts_its_all_to_alls_as_eager():
    """DP2 x EP2: the routed experts run eagerly inside the compiled block, so the communicator counts the dispatch
    and combine all-to-alls over "ep" (and their gradients) as an eager run does."""
    for (eager, compiled), counts in run_distributed(tp_traffic, 2, TINY_MOE, "eager", {"ep": 2}, "ep", timeout=300):
        assert counts == BLOCK_GRAPHS["dp2-ep2-moe"][1]
        assert compiled == eager and {"moe_dispatch/ep", "moe_combine_grad/ep"} <= eager.keys(), (eager, compiled)


@pytest.mark.slow
def test_a_compiled_full_recompute_counts_the_collectives_its_replay_runs():
    """Full recompute replays each block in backward, and checkpoint stops the replay once the tensors it saves are
    back. Eager, that is before the MLP's output all-reduce (nothing after it is saved); compiled, the whole graph
    has run by then, that all-reduce of [s, b, h] included, and the report counts it: one more per layer."""
    from model_zoo import get_preset

    s, b, h, layers = 32, 2, get_preset("tiny").hidden_size, 2  # tp_traffic's model, fp32
    for (eager, compiled), _ in run_distributed(tp_traffic, 2, {"recompute": "full"}, timeout=300):
        more = {k: compiled["all_reduce/tp"][k] - eager["all_reduce/tp"][k] for k in ("calls", "payload_bytes")}
        assert more == {"calls": layers, "payload_bytes": layers * s * b * h * 4}, (eager, compiled)
        assert compiled.keys() == eager.keys() == {"all_reduce/tp"}


PRIMITIVES = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
              "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
              "gather_from_sequence_parallel_region/no-reduce-scatter", "reduce_scatter_to_sequence_parallel_region",
              "sum_grad_rows"]


def primitive_compiled_and_eager(name: str):
    """One rank of TP2: a mapping of hybrid.tensor_parallel.mappings applied to this rank's own [4, 2, 6] input, and
    a random cotangent pulled back, eager (the communicator) and compiled whole (aot_eager, fullgraph: functional
    collectives, no break). Returns whether the outputs and the input's gradients are equal, and the
    communicator's report of each run."""
    import hybrid
    from hybrid.tensor_parallel import mappings, traceable

    topo = hybrid.Topology(tp=2, timeout_s=60)
    rows_axis = topo.enable_tp_subgroups(2)
    fn, _, variant = name.partition("/")
    primitive = getattr(mappings, fn)
    extra = {"sum_grad_rows": (1, 3, rows_axis)}.get(fn, ())
    kwargs = {"reduce_scatter_grad": False} if variant else {}
    x = torch.randn(4, 2, 6, generator=torch.Generator().manual_seed(topo.tp_rank))

    def run(f):
        topo.comm.reset_stats()
        xx = x.clone().requires_grad_()
        y = f(xx, topo, *extra, **kwargs)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + topo.tp_rank)))
        forward, backward = traceable.drain()
        traceable.count(topo.comm, forward + backward)
        return y.detach(), xx.grad, topo.comm.report()

    torch._dynamo.reset()
    (y, grad, report), (y_c, grad_c, report_c) = run(primitive), run(
        torch.compile(primitive, backend="aot_eager", fullgraph=True, dynamic=False))
    topo.close()
    return torch.equal(y, y_c), torch.equal(grad, grad_c), report, report_c


@pytest.mark.slow
@pytest.mark.parametrize("name", PRIMITIVES)
def test_each_traced_mapping_gives_the_eager_values_gradients_and_counts(name):
    """The sums run over two ranks in both paths (gloo, the same pairs): the values are equal, not merely close."""
    for same_output, same_grad, report, report_c in run_distributed(primitive_compiled_and_eager, 2, name):
        assert same_output and same_grad
        assert report == report_c and report, (report, report_c)


@pytest.mark.parametrize("layers", [2, 4])
def test_a_dense_block_at_tp1_is_one_graph_reused_by_every_layer(layers):
    graphs, breaks, finite = count_block_graphs({}, 1, {}, layers)
    assert (graphs, breaks) == (1, 0) and finite


def test_the_report_line_names_blocks_graphs_breaks_and_time():
    from hybrid.topology import Topology
    from model_zoo import GPTModel, get_preset
    from model_zoo.compile import compile_blocks

    torch._dynamo.reset()
    model = GPTModel(get_preset("tiny").replace(num_layers=2, seq_length=16), Topology.local(), seed=1)
    report = compile_blocks(model, backend="eager")
    model(torch.zeros(1, 16, dtype=torch.long), labels=torch.zeros(1, 16, dtype=torch.long)).backward()
    line = report.line()
    assert line.startswith("torch.compile: 2 transformer blocks as one compiled function (eager): 1 graph(s), "
                           "0 graph break(s), "), line


def _moe_steps(cfg, ids, labels, compiled: bool, aux_scale: float = 0.5):
    """Two forward and backward passes of one process's MoE model ``cfg`` on the same micro-batch, the expert bias
    updated between them; the balancing losses' gradient scale is set to ``aux_scale`` after each forward (the
    engine sets it before backward). Returns, per pass: the loss, every parameter's gradient and each MoE layer's
    statistics; and the compile report."""
    from hybrid.topology import Topology
    from model_zoo import GPTModel
    from model_zoo.compile import compile_blocks
    from model_zoo.moe import moe_layers

    model = GPTModel(cfg, Topology.local(), seed=SEED)
    report = compile_blocks(model) if compiled else None
    steps = []
    for _ in range(2):
        model.zero_grad()
        model.moe_aux_scale.value = 1.0
        loss = model(ids, labels=labels)
        model.moe_aux_scale.value = aux_scale
        loss.backward()
        stats = [(layer.stats.tokens_per_expert.clone(), layer.stats.aux_loss.clone(), layer.stats.z_loss.clone())
                 for _, layer in moe_layers(model)]
        steps.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, stats))
        model.after_optimizer_step()  # the expert bias moves (a buffer the compiled router reads at each call)
    return steps, report


def test_a_compiled_moe_block_trains_as_eager_with_its_losses_statistics_and_bias():
    """The one fast MoE case (one process, 2 layers, inductor): the router compiles, the routed experts run eagerly
    (BLOCK_GRAPHS["moe"]), and forward and backward equal eager within tests/numerics.py's bounds (as
    tests/engine/parity_training.check costs an MoE model), with the side channels the compiled block must not
    bake in: the balancing and z-losses reach backward at the scale set after the forward, the routing statistics
    (monitor, expert bias) are counted on every call, and the router reads the expert bias as it moves."""
    from model_zoo import GPTConfig
    from tests.numerics import max_ratio

    torch._dynamo.reset()
    cfg = GPTConfig(**{**MOE, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01})
    ids, labels = (t[:MICRO] for t in data(MOE))
    (eager, _), (compiled, report) = (_moe_steps(cfg, ids, labels, c) for c in (False, True))
    assert (report.figures()["graphs"], report.figures()["breaks"]) == BLOCK_GRAPHS["moe"][1]
    fwd, grads = bounds(cfg, MICRO * cfg.seq_length)
    for (loss_e, grads_e, stats_e), (loss_c, grads_c, stats_c) in zip(eager, compiled):
        assert abs(loss_c - loss_e) <= fwd * abs(loss_e), (loss_c, loss_e)
        for name, g in grads_e.items():
            assert max_ratio(grads_c[name], g, grads * g.abs().max()) <= 1, name
        for (tokens_e, aux_e, z_e), (tokens_c, aux_c, z_c) in zip(stats_e, stats_c):
            assert torch.equal(tokens_c, tokens_e) and aux_e > 0 and z_e > 0
            assert abs(aux_c - aux_e) <= fwd * aux_e and abs(z_c - z_e) <= fwd * z_e
    # what the checks above could miss: the bias moved the second pass's routing, and the balancing losses'
    # gradient (at its scale) is far outside the bound on the router
    (tokens_1, _, _), (tokens_2, _, _) = eager[0][2][0], eager[1][2][0]
    assert not torch.equal(tokens_2 - tokens_1, tokens_1)
    (_, no_aux, _), _ = _moe_steps(cfg, ids, labels, False, aux_scale=0.0)[0]
    router = "layers.0.mlp.router.weight"
    assert max_ratio(no_aux[router], eager[0][1][router], grads * eager[0][1][router].abs().max()) > 1


@pytest.mark.parametrize("flags,world", [(["--model", "tiny-moe", "--expert-model-parallel-size", "2"], 2),
                                         (["--model", "tiny", "--context-parallel-size", "2"], 2)], ids=["moe", "cp"])
def test_the_trainer_takes_moe_and_context_parallel_compiled(flags, world):
    """Start-up refused both before MoE and context-parallel blocks compiled; they pass validation now."""
    from hybrid.training.cli import parse_args, validate

    config = parse_args(flags + ["--torch-compile", "--mock-data", "--train-iters", "1", "--micro-batch-size", "1",
                                 "--global-batch-size", "2", "--lr", "1e-3"])
    assert config.model.compile
    validate(config, world)


def test_the_cache_goes_under_the_save_folder_unless_given():
    from model_zoo.compile import default_cache_dir

    assert default_cache_dir(None, "ckpt") == "ckpt/compile-cache"
    assert default_cache_dir("cc", "ckpt") == "cc" and default_cache_dir(None, None) is None


def test_compiled_training_matches_one_eager_process():
    """The one fast parity case: one process, TP1, ZeRO-1, 10 steps compiled by inductor."""
    run = train(1, 1, 1, 1, {}, base=DENSE, compiled=True)
    check([run], reference({}, DENSE), {}, DENSE)


@pytest.mark.slow  # ~20-60 s each at world 2
@pytest.mark.parametrize("name", [n for n in BLOCK_GRAPHS if BLOCK_GRAPHS[n][0][0] > 1])
def test_graph_breaks_of_each_layout(name):
    (world, axes, stage, overrides), want = BLOCK_GRAPHS[name]
    for graphs, breaks, finite in run_distributed(count_block_graphs, world, axes, stage, overrides, timeout=300):
        assert (graphs, breaks) == want and finite, f"{name}: {graphs} graphs, {breaks} breaks, want {want}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in BLOCK_GRAPHS if BLOCK_GRAPHS[n][0][0] == 1 and n not in ("tp1", "moe")])
def test_graph_breaks_of_one_process_layouts(name):
    """tp1 and moe: the default run's tests above."""
    (_, axes, stage, overrides), want = BLOCK_GRAPHS[name]
    graphs, breaks, finite = count_block_graphs(axes, stage, overrides)
    assert (graphs, breaks) == want and finite


LAYOUTS = {  # (tp, pp, zero stage, base model, model overrides, engine config, more of train()'s arguments)
    "tp2xdp2-zero1": (2, 1, 1, DENSE, {}, {}, {}),
    "tp2xdp2-zero1-overlap-gather": (2, 1, 1, DENSE, {}, {"zero": {"overlap_param_gather": True}}, {}),
    "tp2-sp-selective": (2, 1, 1, DENSE, {"recompute": "selective"}, {}, {}),
    "dp4-zero3": (1, 1, 3, DENSE, {}, {}, {}),
    "pp2xdp2-interleaved": (1, 2, 1, dict(DENSE, num_layers=4), {},
                            {"pipeline": {"schedule": "interleaved", "layers_per_virtual_stage": 1}}, {}),
    "gqa-rope-scaling-qk-norm-tp2xdp2": (2, 1, 1, GQA, {"qk_norm": True}, {}, {}),
    "gpt2-tp2xdp2-full-recompute": (2, 1, 1, GPT2, {"recompute": "full"}, {}, {}),
    # parity_training.MOE: dropless, the balancing and z-losses on; the experts over ep2 inside dp4
    "moe-ep2xdp2": (1, 1, 1, MOE, {}, {}, {"ep": 2}),
    "cp2xdp2-ring-documents": (1, 1, 1, DENSE, {}, {}, {"cp": 2, "packed": True}),
}


@pytest.mark.slow  # inductor compiles on every rank of world 4: ~1-3 min each on 2 cores
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_trains_as_one_process(name):
    tp, pp, stage, base, overrides, extra, more = LAYOUTS[name]
    more = {"ep": 1, **more}
    runs = run_distributed(train, WORLD, tp, pp, more.pop("ep"), stage, overrides, base=base, compiled=True,
                           extra=extra, timeout=600, **more)
    check(runs, reference(overrides, base, packed=more.get("packed", False)), overrides, base)
