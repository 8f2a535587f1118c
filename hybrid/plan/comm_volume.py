"""Bytes each collective moves in one training step, in the format of ``comm_report()``.

Keys are ``"op/axis"``; each entry has ``calls``, ``payload_bytes`` (the full
buffer of each call: the input of a reduce-scatter, the output of an
all-gather, the tensor of an all-reduce) and ``wire_bytes`` (what one rank
sends under a ring: ``2(n-1)/n`` of the payload for an all-reduce,
``(n-1)/n`` for reduce-scatter and all-gather). With ``G`` the padded flat
elements of one TP shard (``Ψ/t``), ``p`` bytes per element and ``k``
micro-batches per step:

==========  ===============================================  ====================
stage       data-parallel collectives per step               payload (elements)
==========  ===============================================  ====================
0           all-reduce of every bucket, last micro-batch     G
1           reduce-scatter (last micro-batch) + all-gather   G + G
2           reduce-scatter every micro-batch + all-gather    kG + G
3           all-gather of every unit for forward and again   3kG
            for backward, reduce-scatter of gradients,
            every micro-batch
==========  ===============================================  ====================

so stages 0-2 put ``2Ψ(n-1)/n`` elements on the wire per rank (``k = 1``) and
stage 3 ``3Ψ(n-1)/n``: 1.5 times as much. Tensor parallelism adds, per layer
and micro-batch, four collectives of the ``[s, b, h]`` activation (``N*h*p``
bytes): without sequence parallelism the all-reduces after the row-parallel
projections (forward) and of the column-parallel inputs' gradients
(backward); with it, an all-gather before each column-parallel and a
reduce-scatter after each row-parallel projection, and their adjoints in
backward. Full recomputation replays the forward ones up to the last tensor
backward needs (one all-reduce, or two all-gathers and a reduce-scatter, per
layer); under ZeRO stage 3 it replays whole layers (two all-reduces, or two
all-gathers and two reduce-scatters). The embedding, the
head and the loss add a few more (see :func:`tp_volume`). Grouped-query
attention with fewer key/value heads than TP ranks adds, per layer and
micro-batch, the all-reduce of the replicated k and v rows' gradients over
the ``tp/k`` group of ranks that hold them (``all_reduce/tp/k``).

Compressed ZeRO communication (:mod:`hybrid.plan.compressed`): with
``zero.quantized_gradients`` every gradient reduction is a quantized
reduce-scatter, an all-to-all of packed chunks (payload ``n*W``, ``W`` the
packed bytes of one chunk; its entry also carries ``peer_bytes``, the ``W``
a rank sends straight to each peer, summed over calls, which
:func:`hybrid.plan.links.split_by_link` reads), and stage 0's all-reduce
becomes that reduce-scatter plus a ring all-gather of the packed summed
chunks (``all_gather/dp``, payload ``n*W``), as :mod:`hybrid.comm` records
it. With ``zero.quantized_weights`` the parameter all-gathers (stages 1-2
after the step, stage 3's) carry ``n*W`` instead of ``N*p``.

Two-level reduction (``zero.two_level_reduce``; ``node_split = (l, m)``: ``l``
dp ranks on each of ``m`` nodes, :mod:`hybrid.plan.two_level`) reduces each
gradient bucket as :mod:`hybrid.comm` does, under the axes ``dp_node`` (``l``
ranks, one node) and ``dp_cross`` (``m`` ranks, one per node):

* reduce-scatter of ``N = n*c`` elements: ``reduce_scatter/dp_node`` of ``N*p``,
  then ``reduce_scatter/dp_cross`` of the node's share ``m*c`` (quantized: the
  all-to-all of ``m`` packed chunks of ``c``);
* all-reduce of ``N`` (stage 0), ``s = ceil(N/l)``: ``reduce_scatter/dp_node`` of
  ``l*s*p``, ``all_reduce/dp_cross`` of ``s*p`` (quantized: the quantized
  all-reduce of ``s`` over ``m``), ``all_gather/dp_node`` of ``l*s*p``.

With ``l == 1`` or ``m == 1`` it is the flat collective over ``dp``.

hpZ (``zero.hpz_partition_size = l`` > 1, stage 3): backward re-gathers every
unit over ``dp_node`` (``all_gather/dp_node``, the unit's ``N*p`` bytes, never
quantized: it rebuilds the values the forward gather produced) instead of over
``dp``; forward's gathers, the post-step gathers and the reduce-scatters are
unchanged (:func:`stage3_gather_axis`).

Mixture of Experts (:func:`moe_volume`, formulas in :mod:`hybrid.plan.moe`):
the token all-to-alls over ``ep`` under the communicator's names
(``moe_dispatch/ep``, ``moe_combine/ep`` forward, again under full
recomputation; ``moe_dispatch_grad/ep``, ``moe_combine_grad/ep`` backward),
each ``T k h p`` bytes with ``T k h p / ep`` to each peer when the loads are
balanced, plus the per-expert token counts exchanged before each dispatch
(``all_to_all/ep``, ``8 E / ep`` bytes to each peer); at ``tp > 1`` the
router's gradient summed over ``tp`` and, with whole experts on every TP rank
(``etp = 1``), each local expert's weight gradients too. The experts'
gradients are reduced over ``edp`` as :func:`dp_volume` reduces the dense
ones over ``dp`` (:func:`expert_dp_volume`).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

from hybrid import param_meta
from hybrid.compression import Quantization
from hybrid.dtypes import DTYPE_BYTES
from hybrid.layout import partition_count, stage_traits
from hybrid.plan.candidate import Candidate
from hybrid.plan.compressed import chunk, packed_bytes
from hybrid.plan.model_memory import FlatLayout, Stage3Layout
from hybrid.plan.setup import DEFAULT_SETUP
from hybrid.plan.zero_collectives import reduces_by_scatter, reduces_every_micro_batch
from hybrid.grid import tp_subaxis
from model_zoo.config import GPTConfig
from model_zoo.qkv_layout import qkv_layout

Report = Dict[str, Dict[str, float]]


def ring_steps(op: str, n: int) -> int:
    """Steps of ``op`` as a ring over ``n`` ranks: in each step every rank sends ``1/n`` of the buffer to the
    next rank of the ring. An all-reduce is a reduce-scatter then an all-gather, ``2(n-1)`` steps; a
    reduce-scatter or an all-gather ``n-1``. (Wire bytes per rank are ``steps/n`` of the payload.)"""
    if n == 1:
        return 0
    return (2 if op == "all_reduce" else 1) * (n - 1)


def _ring(op: str, n: int) -> float:
    return ring_steps(op, n) / n


def _entry(report: Report, op: str, axis: str, all_to_all: bool) -> Dict[str, float]:
    entry = report.setdefault(f"{op}/{axis}", {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0})
    if entry["calls"] and ("peer_bytes" in entry) != all_to_all:
        raise ValueError(f"{op}/{axis} mixes ring and all-to-all calls: their bytes cross nodes differently")
    return entry


def _add(report: Report, op: str, axis: str, n: int, payload: int, calls: int = 1) -> None:
    """``calls`` ring collectives of ``payload`` bytes each."""
    if n == 1 or calls == 0:
        return
    entry = _entry(report, op, axis, all_to_all=False)
    entry["calls"] += calls
    entry["payload_bytes"] += payload * calls
    entry["wire_bytes"] += payload * calls * _ring(op, n)


def _add_all_to_all(report: Report, op: str, axis: str, n: int, each: int, calls: int = 1) -> None:
    """``calls`` all-to-alls in which a rank sends ``each`` bytes straight to every one of its ``n - 1`` peers
    (payload ``n * each``, as the communicator records a quantized reduce-scatter)."""
    if n == 1 or calls == 0:
        return
    entry = _entry(report, op, axis, all_to_all=True)
    entry["calls"] += calls
    entry["payload_bytes"] += n * each * calls
    entry["wire_bytes"] += (n - 1) * each * calls
    entry["peer_bytes"] = entry.get("peer_bytes", 0) + each * calls


def gathered_bytes(numel: int, n: int, element_bytes: int, quant: Optional[Quantization] = None) -> int:
    """Payload of an all-gather of ``numel`` elements over ``n`` ranks: ``numel * element_bytes``, or with
    ``quant`` the packed chunks, ``n * wire_bytes(ceil(numel / n))``."""
    return numel * element_bytes if quant is None else packed_bytes(quant, numel, n)


def _reduce_gradients(report: Report, scatter: bool, n: int, numel: int, element_bytes: int, calls: int,
                      quant: Optional[Quantization], axis: str = "dp") -> None:
    """``calls`` reductions over ``axis`` (``n`` ranks) of a ``numel``-element gradient buffer: a reduce-scatter
    (``scatter``) or an all-reduce; quantized, the all-to-all and, for an all-reduce, the all-gather of the
    summed chunks."""
    if quant is None:
        _add(report, "reduce_scatter" if scatter else "all_reduce", axis, n, numel * element_bytes, calls=calls)
        return
    _add_all_to_all(report, "reduce_scatter", axis, n, quant.wire_bytes(chunk(numel, n)), calls=calls)
    if not scatter:
        _add(report, "all_gather", axis, n, packed_bytes(quant, numel, n), calls=calls)


def _reduce(report: Report, scatter: bool, n: int, numel: int, element_bytes: int, calls: int,
            quant: Optional[Quantization], node_split: Optional[Tuple[int, int]]) -> None:
    """:func:`_reduce_gradients` over ``dp``, or with ``node_split = (l, m)`` (``zero.two_level_reduce``) in
    two levels when both are above 1 (the module docstring)."""
    l, m = node_split or (1, n)
    if l * m != n:
        raise ValueError(f"node split {node_split} does not make the {n} data-parallel ranks")
    if l == 1 or m == 1:
        _reduce_gradients(report, scatter, n, numel, element_bytes, calls, quant)
        return
    p = element_bytes
    if scatter:
        _add(report, "reduce_scatter", "dp_node", l, numel * p, calls=calls)
        _reduce_gradients(report, True, m, m * chunk(numel, n), p, calls, quant, axis="dp_cross")
        return
    share = chunk(numel, l)
    _add(report, "reduce_scatter", "dp_node", l, l * share * p, calls=calls)
    _reduce_gradients(report, False, m, share, p, calls, quant, axis="dp_cross")
    _add(report, "all_gather", "dp_node", l, l * share * p, calls=calls)


def exchange_momentum(report: Report, n: int, numel: int, momentum: Quantization) -> None:
    """1-bit Adam's compressed phase for one bucket of ``numel`` elements (:mod:`hybrid.zero.onebit`): an
    all-to-all of the ``n`` packed rows of ``k = ceil(numel / n)`` (``all_to_all/dp``), then a ring
    all-gather of every rank's packed row (``all_gather/dp``, payload ``n*W``)."""
    each = momentum.wire_bytes(chunk(numel, n))
    _add_all_to_all(report, "all_to_all", "dp", n, each)
    _add(report, "all_gather", "dp", n, n * each)


def stage3_gather_axis(phase: str, hpz: int = 1) -> str:
    """The axis stage 3 gathers a unit over in ``phase`` (a key of :func:`stage3_gathers`): ``dp``, except
    backward's re-gathers under hpZ (``hpz`` > 1), over ``dp_node`` from the node's secondary partition."""
    return "dp_node" if hpz > 1 and phase == "backward" else "dp"


def stage3_gathers(layout: Stage3Layout, micro_batches: int, tied_head: bool = True,
                   weights: Optional[Quantization] = None, hpz: int = 1, keep: Optional[int] = None) -> Dict[str, list]:
    """The all-gathers of partitioned parameters in one step, by phase, as ``[(payload bytes, calls)]``:
    ``forward`` every unit once per micro-batch (a tied head's unit once more, where the LM head uses the
    embedding outside its module, unless every unit fits ``keep`` elements and it stays gathered in
    between), ``backward`` every unit again but those held from forward (:meth:`Stage3Layout.held_into_backward`),
    ``after_step`` the persistent pool re-gathered after the update. ``weights``: ``zero.quantized_weights``
    (:func:`gathered_bytes`), which hpZ's backward gathers (``hpz`` > 1, over ``dp_node``) do not use.
    ``keep``: the keep window (:attr:`hybrid.plan.setup.TrainingSetup.stage3_keep`; None: the defaults')."""
    k = micro_batches
    if keep is None:
        keep = DEFAULT_SETUP.stage3_keep

    def payload(numel: int, phase: str) -> int:
        if stage3_gather_axis(phase, hpz) != "dp":
            return numel * layout.element_bytes
        return gathered_bytes(numel, layout.dp, layout.element_bytes, weights)
    forward = [(payload(size, "forward"), k) for size in layout.units]
    if tied_head and layout.head_unit and sum(layout.units) > keep:
        forward.append((payload(layout.head_unit, "forward"), k))
    held = layout.held_into_backward(keep)
    backward = [(payload(size, "backward"), k) for i, size in enumerate(layout.units) if i not in held]
    after_step = [(payload(layout.persistent, "after_step"), 1)] if layout.persistent else []
    return {"forward": forward, "backward": backward, "after_step": after_step}


def dp_volume(layout: Union[FlatLayout, Stage3Layout], stage: int, micro_batches: int = 1,
              report: Optional[Report] = None, tied_head: bool = True, reduce_once: bool = False,
              gradients: Optional[Quantization] = None, weights: Optional[Quantization] = None,
              node_split: Optional[Tuple[int, int]] = None, hpz: int = 1,
              momentum: Optional[Quantization] = None, keep: Optional[int] = None) -> Report:
    """Data-parallel collectives of one step over ``layout.dp`` ranks (one call per bucket or unit).

    Whole parameters (flat buckets): each bucket's gradient is reduced, by
    reduce-scatter or all-reduce, every micro-batch or after the last one, and
    all-gathered after the step where the stage partitions the optimizer
    state (:mod:`hybrid.plan.zero_collectives`). Partitioned parameters (stage
    3) take a :class:`Stage3Layout`: every unit is gathered for forward
    and again for backward, but for the units kept gathered in between
    (a tied head's unit once more in forward, where it is used outside its
    module; ``keep``: the elements forward keeps gathered ahead,
    :func:`hybrid.zero.param_gather.keep_numel`, see :func:`stage3_gathers`), every unit's gradient is reduce-scattered,
    and the persistent pool is re-gathered after the update. Stage 3 also
    checks the gather order with a 16-byte all-reduce per request, left out here.
    ``reduce_once``: ``zero.reduce_once``
    (:func:`hybrid.plan.zero_collectives.reduces_every_micro_batch`).
    ``gradients`` / ``weights``: ``zero.quantized_gradients`` /
    ``zero.quantized_weights`` (None: off; see the module docstring). Stage
    3's reduce-scatters are counted as one buffer of every unit per
    reduction, so the quantized figure leaves out the block padding of each
    bucket's chunks (under one block per bucket). ``node_split``: ``(l, m)``
    under ``zero.two_level_reduce`` (None: off; see the module docstring). ``hpz``:
    ``zero.hpz_partition_size``, the ``dp_node`` ranks stage 3's backward re-gathers over (1: off).
    ``momentum``: the 1-bit format of ``optimizer.type = onebit_adam`` after its warm-up, whose momentum
    exchange (:func:`exchange_momentum`) replaces every gradient reduction (None: off, or the warm-up).
    """
    report = {} if report is None else report
    n, k = layout.dp, micro_batches
    traits = stage_traits(stage)
    reductions = k if reduces_every_micro_batch(traits, reduce_once) else 1
    if traits.parameters:
        if not isinstance(layout, Stage3Layout):
            raise ValueError(f"ZeRO stage {int(stage)} communicates per unit: pass stage3_layout(...), not a flat "
                             f"layout")
        p = layout.element_bytes
        for phase, gathers in stage3_gathers(layout, k, tied_head, weights, hpz, keep).items():
            axis = stage3_gather_axis(phase, hpz)
            for payload, calls in gathers:
                _add(report, "all_gather", axis, n if axis == "dp" else hpz, payload, calls=calls)
        _reduce(report, True, n, sum(layout.units) + layout.persistent, p, reductions, gradients, node_split)
        return report
    scatter = reduces_by_scatter(traits)
    for _, sizes in layout.groups:
        for size in sizes:
            if momentum is not None:
                exchange_momentum(report, n, size, momentum)
            else:
                _reduce(report, scatter, n, size, layout.element_bytes, reductions, gradients, node_split)
            if traits.gathers_after_step:
                _add(report, "all_gather", "dp", n, gathered_bytes(size, n, layout.element_bytes, weights))
    return report


def tp_volume(config: GPTConfig, micro_batch: int, tp: int, *, sequence_parallel: bool, recompute: str,
              precision: str, micro_batches: int = 1, report: Optional[Report] = None,
              whole_replay: bool = False, layers: Optional[int] = None, first: bool = True,
              last: bool = True) -> Report:
    """Tensor-parallel collectives of one step (``micro_batches`` micro-batches) over ``tp`` ranks.

    ``whole_replay``: full recomputation replays each layer's whole forward
    (ZeRO stage 3 turns the early stop off so that every module's forward
    hooks run) rather than stopping at the last tensor backward needs.
    ``layers``, ``first``, ``last``: a pipeline rank's share -- its layers
    (default all), whether it holds the embedding and the head with the loss.
    """
    report = {} if report is None else report
    if tp == 1:
        return report
    p = DTYPE_BYTES[precision]
    n_tok = config.seq_length * micro_batch
    act = n_tok * config.hidden_size * p  # one [s, b, h] activation
    L, k = (config.num_layers if layers is None else layers), micro_batches
    emb, head = int(first), int(last)
    # Full recomputation replays a layer's forward only up to the last tensor backward needs, so the
    # collective after the MLP's row-parallel projection is not repeated (unless the replay is whole).
    replay = L if recompute == "full" else 0
    replay_last = replay if whole_replay else 0
    norm_params = 2 if config.norm == "layernorm" and config.bias else 1  # weight, and bias
    if config.qk_norm:  # the query/key norms see this rank's heads only: their gradients are summed over TP
        _add(report, "all_reduce", "tp", tp, config.head_dim * p, calls=k * 2 * L * norm_params)
    if sequence_parallel:
        # Column-parallel inputs: all-gather forward, reduce-scatter backward; row-parallel outputs the reverse.
        # (The head's input is gathered in forward, the embedding's output gradient in backward.)
        _add(report, "all_gather", "tp", tp, act, calls=k * (2 * L + head + 2 * replay + 2 * L + emb))
        _add(report, "reduce_scatter", "tp", tp, act, calls=k * (2 * L + emb + replay + replay_last + 2 * L + head))
        # Replicated parameters used on sequence shards: each one's gradient is summed over TP.
        h_bytes = config.hidden_size * p
        _add(report, "all_reduce", "tp", tp, h_bytes, calls=k * (2 * L + head) * norm_params)
        if config.bias:
            _add(report, "all_reduce", "tp", tp, h_bytes, calls=k * 2 * L)  # row-parallel biases
        if config.position == "learned":
            _add(report, "all_reduce", "tp", tp, config.num_positions * h_bytes, calls=k * emb)
    else:
        # Forward: the embedding, and after each row-parallel projection; backward: the inputs of each
        # column-parallel projection and of the head.
        _add(report, "all_reduce", "tp", tp, act, calls=k * (emb + 2 * L + replay + replay_last + 2 * L + head))
    # The loss: the row maximum, then the sums (sum of exponentials and the target logit).
    _add(report, "all_reduce", "tp", tp, 4 * n_tok, calls=k * head)
    _add(report, "all_reduce", "tp", tp, 2 * 4 * n_tok, calls=k * head)
    # Key/value heads replicated over tp/g ranks (grouped-query attention with g < tp): each backward sums
    # the gradient of their q/k/v weight (and bias) rows over those ranks, one call per block (k, then v).
    layout = qkv_layout(config)
    for lo, hi, replicas in param_meta.replicated_runs(layout.tp_meta(), layout.out_features, tp):
        axis = tp_subaxis(replicas)
        _add(report, "all_reduce", axis, replicas, (hi - lo) * config.hidden_size * p, calls=k * L)
        if config.attention_bias:
            _add(report, "all_reduce", axis, replicas, (hi - lo) * p, calls=k * L)
    return report


def moe_volume(config: GPTConfig, candidate: Candidate, micro_batches: int, report: Optional[Report] = None,
               layers: Optional[Sequence[int]] = None) -> Report:
    """The MoE layers' collectives of one step (the module docstring) on one rank; ``layers``: a pipeline
    rank's (default all). Balanced routing: a real step's all-to-all payloads are exactly these for the
    dispatch (every chosen row leaves through it), and their sum over the ``ep`` group for the combine."""
    from hybrid.plan.moe import a2a_calls, all_to_all_bytes, moe_layers_of

    report = {} if report is None else report
    if not config.is_moe:
        return report
    ep, tp, k = candidate.parallel.ep, candidate.tp, micro_batches
    moe = moe_layers_of(config, layers)
    p = DTYPE_BYTES[candidate.precision]
    forward = k * moe * (a2a_calls(candidate.recompute) - 1)
    backward = k * moe
    each = all_to_all_bytes(config, candidate.micro_batch, tp, candidate.sequence_parallel, p) // ep
    for op, calls in (("moe_dispatch", forward), ("moe_combine", forward), ("moe_dispatch_grad", backward),
                      ("moe_combine_grad", backward)):
        _add_all_to_all(report, op, "ep", ep, each, calls=calls)
    _add_all_to_all(report, "all_to_all", "ep", ep, 8 * config.num_experts // ep, calls=forward)
    if tp > 1:
        h = config.hidden_size
        _add(report, "all_reduce", "tp", tp, config.num_experts * h * p, calls=k * moe)  # the router's gradient
        if config.expert_tp(tp) == 1:  # whole experts on every TP rank: their gradients summed over tp
            f, blocks = config.expert_ffn_size, config.mlp_input_blocks
            local = config.num_experts // ep
            _add(report, "all_reduce", "tp", tp, blocks * f * h * p, calls=k * moe * local)
            _add(report, "all_reduce", "tp", tp, f * h * p, calls=k * moe * local)
    return report


def expert_dp_volume(layout: FlatLayout, stage: int, micro_batches: int = 1, report: Optional[Report] = None,
                     reduce_once: bool = False, gradients: Optional[Quantization] = None,
                     weights: Optional[Quantization] = None) -> Report:
    """The routed experts' data-parallel collectives of one step: :func:`dp_volume` of their flat layout over
    the ``edp`` ranks that hold the same experts (``layout.dp``), under the axis ``edp``."""
    report = {} if report is None else report
    for name, entry in dp_volume(layout, stage, micro_batches, reduce_once=reduce_once, gradients=gradients,
                                 weights=weights).items():
        op, _ = name.split("/", 1)
        target = _entry(report, op, "edp", "peer_bytes" in entry)
        for key, value in entry.items():
            target[key] = target.get(key, 0) + value
    return report


def step_volume(config: GPTConfig, layout: Union[FlatLayout, Stage3Layout], candidate: Candidate,
                micro_batches: int, reduce_once: bool = False, gradients: Optional[Quantization] = None,
                weights: Optional[Quantization] = None, node_split: Optional[Tuple[int, int]] = None,
                hpz: int = 1, momentum: Optional[Quantization] = None, keep: Optional[int] = None,
                pp_rank: int = 0, experts: Optional[FlatLayout] = None) -> Report:
    """Every collective of one step (``micro_batches`` micro-batches of ``candidate``): data-parallel,
    tensor-parallel and the gradient-norm all-reduce. ``layout``: the candidate's flat or stage-3 layout;
    ``reduce_once``: ``zero.reduce_once`` (stage 2 reduces once per step); ``gradients`` / ``weights``: the
    formats of ``zero.quantized_gradients`` / ``zero.quantized_weights`` (None: off); ``node_split``: ``(l, m)``
    dp ranks per node and nodes under ``zero.two_level_reduce`` (None: off); ``hpz``: ``zero.hpz_partition_size``
    (stage 3; 1: off); ``momentum``: 1-bit Adam's compressed phase; ``keep``: stage 3's keep window
    (:func:`dp_volume`); ``pp_rank``: with a pipeline, the rank whose step it is (``layout`` is its
    own), which adds :func:`pipeline_volume`; ``experts``: an MoE model's expert layout over ``edp``
    (:func:`hybrid.plan.estimate.expert_layout`), whose reductions :func:`expert_dp_volume` adds, with the
    MoE layers' own collectives (:func:`moe_volume`)."""
    report: Report = {}
    dp_volume(layout, candidate.zero_stage, micro_batches, report, tied_head=config.tie_embeddings,
              reduce_once=reduce_once, gradients=gradients, weights=weights, node_split=node_split, hpz=hpz,
              momentum=momentum, keep=keep)
    share = {}
    if candidate.pp > 1:
        split = candidate.stage_split(config)
        share = dict(layers=len(split.layers_of_rank(pp_rank)), first=split.holds_embedding(pp_rank),
                     last=split.holds_head(pp_rank))
        pipeline_volume(config, layout, candidate, micro_batches, pp_rank, report)
    # Partitioned parameters are gathered by module hooks, which a replay must run: it replays whole layers.
    tp_volume(config, candidate.micro_batch, candidate.tp, sequence_parallel=candidate.sequence_parallel,
              recompute=candidate.recompute, precision=candidate.precision, micro_batches=micro_batches,
              report=report, whole_replay=candidate.traits.parameters, **share)
    if config.is_moe:
        layers = candidate.stage_split(config).layers_of_rank(pp_rank) if candidate.pp > 1 else None
        moe_volume(config, candidate, micro_batches, report, layers)
        if experts is not None:
            expert_dp_volume(experts, candidate.zero_stage, micro_batches, report, reduce_once, gradients, weights)
    _add(report, "all_reduce", "world", candidate.parallel.world_size, 8)  # the float64 squared gradient norm
    return report


def pipeline_volume(config: GPTConfig, layout: FlatLayout, candidate: Candidate, micro_batches: int, pp_rank: int,
                    report: Report) -> Report:
    """Pipeline rank ``pp_rank``'s transfers (:func:`hybrid.plan.pipeline_stages.p2p_volume`), the tied embedding copies' gradient sum over ``embed`` (first and last rank: one all-reduce per
    segment of the tied group's gradient partition) and the loss broadcast from the last rank (float64)."""
    from hybrid.plan.pipeline_stages import p2p_volume

    p2p_volume(config, candidate, micro_batches, pp_rank, report)
    parts = partition_count(candidate.zero_stage, layout.dp)
    for size in layout.tied_segments:  # only the first and last ranks hold a tied copy
        _add(report, "all_reduce", "embed", 2, layout.element_bytes * size // parts)
    _add(report, "broadcast", "pp", candidate.pp, 8)
    return report


def axis_wire_bytes(report: Report, axis: str) -> float:
    """Wire bytes one rank sends over ``axis`` (summed over collectives)."""
    return sum(v["wire_bytes"] for k, v in report.items() if k.endswith("/" + axis))
