"""Enumerate the layouts of a model on a cluster, predict each, and rank them.

A layout is valid when:

* ``tp`` divides the GPUs of one node (TP traffic stays on the node's fast
  links), the attention heads and the MLP width (``GPTConfig.validate``);
  a ``tp`` asked for explicitly (``Choices.tp``) may also span whole nodes
  (a multiple of the node's GPUs: the Megatron-style baseline whose TP
  collectives cross the inter-node link, ``--allow-tp-across-nodes`` at run time);
* ``pp`` (pipeline stages) divides ``gpus / tp``, leaves a stage of ``tp x dp``
  ranks that fills whole nodes or divides one (:func:`hybrid.plan.cluster.stage_fits_nodes`),
  can split the layers (:meth:`~hybrid.plan.candidate.Candidate.stage_split`), and
  the stage does not partition parameters (:func:`hybrid.layout.pipeline_problem`);
  with ``v`` virtual stages (interleaved schedule) ``pp x v`` divides the layers;
* ``dp = gpus / (tp x pp)`` is whole and divides the global batch;
* the micro batch divides ``global_batch / dp`` (the rest is gradient
  accumulation);
* an MoE model's expert-parallel size ``ep`` divides ``dp`` and
  ``num_experts`` (:func:`hybrid.plan.moe.expert_parallel_sizes`; every such
  size is tried unless ``Choices.ep`` names some); a dense model has ``ep = 1``
  only; ZeRO stage 3 is not planned for an MoE model
  (:func:`hybrid.plan.estimate.moe_stage_problem`);
* ``cp`` (context parallelism, ``Choices.cp``; 1 unless asked for) passes
  :func:`hybrid.plan.context_parallel.cp_problem_at` (the model's and the
  grid's rules) and ``tp x cp x dp x pp`` fills the GPUs; such a layout is
  evaluated as :mod:`hybrid.plan.context_parallel` describes;
* offload is used only where the stage allows it
  (:func:`hybrid.layout.offload_problem`);
* the ZeRO compression settings can run at the stage
  (:meth:`hybrid.plan.setup.TrainingSetup.compression_problem`: quantized
  weights need a stage that gathers parameters); :func:`plan` skips the
  stages they cannot, and refuses with the rule's words when none is left;
* with ``zero.two_level_reduce``, every dp group is split evenly over the
  nodes (:func:`hybrid.plan.predict.placement_problem`, in the words of
  :meth:`hybrid.topology.Nodes.split`); :func:`plan` skips the layouts that
  are not, in the same way;
* with ``zero.hpz_partition_size`` above 1, the stage is 3 and each node
  holds that many ranks of every dp group (the same two functions name the
  stages and layouts that cannot).

Each layout is a :class:`~hybrid.plan.candidate.Candidate`: a
:class:`hybrid.layout.ParallelLayout` (which validates the sizes, stage and
precision) with offload, recomputation, micro batch and sequence parallelism.

Every layout is evaluated (memory, communication, step time:
:func:`hybrid.plan.predict.predict`) and the list is ranked: layouts that fit
first, then by predicted throughput (tokens/s), then by predicted memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from hybrid.config.errors import ConfigError
from hybrid.dtypes import DTYPE_BYTES
from hybrid.grid import data_parallel_size, divides_world
from hybrid.layout import (OFFLOAD_DEVICES, ZERO_STAGES, LayoutError, ParallelLayout, offload_problem,
                           pipeline_problem)
from hybrid.plan.candidate import DEFAULT_PRECISION, Candidate
from hybrid.plan.cluster import Cluster, stage_fits_nodes
from hybrid.plan.comm_volume import Report
from hybrid.plan.context_parallel import (compute_scale, context_parallel_sizes, local_config, ring_bytes_per_layer,
                                          ring_crossing_senders, ring_in_flight, ring_overlap)
from hybrid.plan.estimate import MemoryEstimate, estimate_memory, moe_stage_problem
from hybrid.plan.moe import as_run, expert_parallel_sizes
from hybrid.plan.predict import placement_problem, predict
from hybrid.plan.setup import TrainingSetup
from hybrid.plan.timing import CollectiveTime, StepTime
from model_zoo.config import RECOMPUTE_LEAST_FIRST, GPTConfig

# The recomputation choices, cheapest first (the order layouts are enumerated in).
RECOMPUTES = RECOMPUTE_LEAST_FIRST  # model_zoo's choices, least recomputed first
# The axes of data-parallel traffic: the dp group, and the two levels of zero.two_level_reduce.
DP_AXES = ("dp", "dp_node", "dp_cross", "edp")


@dataclasses.dataclass(frozen=True)
class Choices:
    """Restrictions on the enumeration (None: try every valid value), and the precision every layout uses."""

    tp: Optional[Sequence[int]] = None
    pp: Sequence[int] = (1,)
    pipeline_schedule: str = "1f1b"
    virtual_stages: Sequence[int] = (1,)
    stages: Sequence[int] = ZERO_STAGES
    offloads: Sequence[str] = OFFLOAD_DEVICES
    recomputes: Sequence[str] = RECOMPUTES
    micro_batches: Optional[Sequence[int]] = None
    max_micro_batch: int = 16
    sequence_parallel: bool = False
    # One precision, not a choice: the step-time model does not price it, so it could not rank precisions.
    precision: str = DEFAULT_PRECISION
    ep: Optional[Sequence[int]] = None  # expert-parallel sizes of an MoE model (None: every valid one)
    cp: Sequence[int] = (1,)  # context-parallel sizes (--context-parallel-size; the valid ones of these are tried)

    def __post_init__(self):
        # The enumeration divides by these sizes; the command line's flags refuse them on their own, but a
        # Choices built in code would otherwise end in a ZeroDivisionError far from its cause.
        sizes = {"tp": self.tp, "pp": self.pp, "virtual_stages": self.virtual_stages, "ep": self.ep, "cp": self.cp,
                 "micro_batches": self.micro_batches, "max_micro_batch": (self.max_micro_batch,)}
        for name, values in sizes.items():
            bad = [v for v in values or () if not isinstance(v, int) or isinstance(v, bool) or v < 1]
            if bad:
                raise LayoutError(f"Choices.{name} must hold positive integers, got {bad[0]!r}")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One candidate layout with its predicted memory, communication and step time."""

    candidate: Candidate
    memory: MemoryEstimate
    comm: Report
    time: StepTime
    fits: bool
    host_fits: bool
    accumulation: int
    moe: bool = False  # the model is an MoE model (the table then shows its columns)

    @property
    def dp_wire_bytes(self) -> float:
        """What a rank sends over its dp group, both levels of a two-level reduction included."""
        return sum(v["wire_bytes"] for k, v in self.comm.items() if k.split("/")[1] in DP_AXES)

    @property
    def tp_wire_bytes(self) -> float:
        return sum(v["wire_bytes"] for k, v in self.comm.items() if k.endswith("/tp"))

    @property
    def ep_wire_bytes(self) -> float:
        """What a rank sends over its ep group: the MoE token all-to-alls (0 for a dense model)."""
        return sum(v["wire_bytes"] for k, v in self.comm.items() if k.endswith("/ep"))

    @property
    def ep_inter_node_bytes(self) -> float:
        """What the busiest node sends off it per step in the ep all-to-alls."""
        return sum(c.inter_node_bytes_per_node for c in self.time.collectives if c.name.endswith("/ep"))

    @property
    def cp_wire_bytes(self) -> float:
        """What a rank sends around its cp ring per step (0 without context parallelism)."""
        return sum(v["wire_bytes"] for k, v in self.comm.items() if k.endswith("/cp"))

    @property
    def ring_exposed_s(self) -> float:
        """Seconds per step the ring's transfers are not hidden behind the attention."""
        return sum(c.exposed for c in self.time.collectives if c.name.endswith("/cp"))

    @property
    def tokens_per_s(self) -> float:
        """Predicted training throughput of the whole job."""
        return self.time.tokens_per_s


def tensor_parallel_sizes(config: GPTConfig, cluster: Cluster) -> List[int]:
    """TP sizes that divide a node, the GPU count, the heads and the MLP width."""
    sizes = []
    for tp in range(1, cluster.node_size + 1):
        if cluster.node_size % tp or cluster.gpus % tp:
            continue
        try:
            as_run(config, tp).validate(tp)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def spans_whole_nodes(config: GPTConfig, cluster: Cluster, tp: int) -> bool:
    """``tp`` fills whole nodes (more than one) and divides the GPUs, the heads and the MLP width."""
    if tp <= cluster.node_size or tp % cluster.node_size or cluster.gpus % tp:
        return False
    try:
        as_run(config, tp).validate(tp)
    except ValueError:
        return False
    return True


def _divisors(n: int, cap: int) -> List[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def enumerate_layouts(config: GPTConfig, cluster: Cluster, global_batch: int,
                      choices: Choices = Choices()) -> List[Candidate]:
    """Every valid layout (see the module docstring) within ``choices``."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise LayoutError(f"--global-batch-size must be a positive integer, got {global_batch!r}")
    valid_tp = tensor_parallel_sizes(config, cluster)
    tps = [t for t in (choices.tp or valid_tp) if t in valid_tp or spans_whole_nodes(config, cluster, t)]
    if not tps:
        raise LayoutError(f"no tensor-parallel size in {list(choices.tp or [])} is valid: TP must divide the "
                          f"{cluster.node_size} GPUs of a node (or, asked for explicitly, span whole nodes), "
                          f"num_heads={config.num_heads} and the MLP width {config.ffn_size}; valid sizes "
                          f"here are {valid_tp}")
    sizes = [(tp, pp, chunks) for tp, pp, chunks in itertools.product(tps, choices.pp, choices.virtual_stages)
             if divides_world(cluster.gpus, tp=tp, pp=pp)
             and _splits(config, cluster, tp, pp, chunks, choices.pipeline_schedule)]
    if not sizes:
        raise LayoutError(f"no pipeline size in {list(choices.pp)} (virtual stages {list(choices.virtual_stages)}) "
                          f"fits: pp must divide gpus/tp for some tp in {tps}, leave a stage of tp x dp ranks that "
                          f"fills whole nodes of {cluster.node_size} or divides one, and split num_layers="
                          f"{config.num_layers} (pp x virtual stages must divide it when interleaved)")
    layouts = []
    # an MoE model at tp > 1 runs with sequence parallelism (model_zoo.config.moe_problem)
    cps = [(tp, pp, chunks, cp) for tp, pp, chunks in sizes
           for cp in context_parallel_sizes(config, tp, (choices.sequence_parallel or config.is_moe) and tp > 1,
                                            choices.cp)
           if divides_world(cluster.gpus, tp=tp, pp=pp, cp=cp)]
    if not cps:
        raise LayoutError(f"no --context-parallel-size in {list(choices.cp)} fits: tp x cp x pp must divide the "
                          f"{cluster.gpus} GPUs and --seq-length {config.seq_length} must split over cp (e.g. "
                          f"{cp_problem_text(config, choices.cp)})")
    for tp, pp, chunks, cp in cps:
        dp = data_parallel_size(cluster.gpus, tp=tp, pp=pp, cp=cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        micros = [m for m in (choices.micro_batches or _divisors(per_rank, choices.max_micro_batch))
                  if per_rank % m == 0]
        # an MoE model at tp > 1 runs with sequence parallelism (model_zoo.config.moe_problem)
        sp = (choices.sequence_parallel or config.is_moe) and tp > 1
        for stage, offload, recompute, micro, ep in itertools.product(
                choices.stages, choices.offloads, choices.recomputes, micros,
                expert_parallel_sizes(config, dp * cp, choices.ep)):
            if offload in OFFLOAD_DEVICES and offload_problem(stage, offload) or pipeline_problem(stage, pp):
                continue  # the stage cannot offload or pipeline (an unknown device is refused by Candidate below)
            if moe_stage_problem(config, stage):
                continue
            parallel = ParallelLayout(tp=tp, dp=dp, pp=pp, zero_stage=stage, precision=choices.precision, ep=ep)
            layouts.append(Candidate(parallel, offload=offload, recompute=recompute, micro_batch=micro,
                                     sequence_parallel=sp, pipeline_schedule=choices.pipeline_schedule,
                                     virtual_stages=chunks, cp=cp))
    if not layouts and config.is_moe and choices.ep:
        raise LayoutError(f"no --expert-model-parallel-size in {list(choices.ep)} divides both a data-parallel "
                          f"size and --num-experts {config.num_experts} (or only ZeRO stage 3 was asked for, "
                          f"which is not planned for an MoE model)")
    if not layouts:
        raise LayoutError(f"no layout divides --global-batch-size {global_batch}: it must be a multiple of the "
                          f"data-parallel size gpus/tp for some tp in {tps} (and of the --micro-batch given)")
    return layouts


def _splits(config: GPTConfig, cluster: Cluster, tp: int, pp: int, chunks: int, schedule: str) -> bool:
    """``pp`` pipeline stages of ``chunks`` parts each can hold ``config``'s layers and be placed on the nodes."""
    if pp == 1:
        return chunks == 1
    if stage_fits_nodes(cluster.gpus // pp, cluster.node_size):
        return False
    dp = data_parallel_size(cluster.gpus, tp=tp, pp=pp)
    try:
        Candidate(ParallelLayout(tp=tp, dp=dp, pp=pp), pipeline_schedule=schedule,
                  virtual_stages=chunks).stage_split(config)
    except (ConfigError, LayoutError):
        return False
    return True


def cp_problem_text(config: GPTConfig, sizes: Sequence[int]) -> str:
    """The first rule that refuses one of ``sizes`` at tp 1 (for the error when none fits)."""
    from hybrid.plan.context_parallel import cp_problem_at
    return next((p for p in (cp_problem_at(config, 1, cp, False) for cp in sizes) if p), "none refused at tp 1")


def evaluate(config: GPTConfig, candidate: Candidate, cluster: Cluster, setup: TrainingSetup,
             global_batch: int) -> Evaluation:
    """Predict memory, communication and step time of one candidate layout (its busiest pipeline rank's)."""
    if candidate.cp > 1:
        return _evaluate_cp(config, candidate, cluster, setup, global_batch)
    micro_batches = global_batch // (candidate.dp * candidate.micro_batch)
    memory = estimate_memory(config, candidate, setup, micro_batches)
    step = predict(config, candidate, global_batch, setup,
                   cluster.placement(candidate.tp, candidate.dp, candidate.pp, candidate.parallel.ep),
                   cluster.link, cluster.flops_per_s, cluster.host)
    host_fits = cluster.cpu_memory is None or memory.host * cluster.node_size <= cluster.cpu_memory
    return Evaluation(candidate, memory, step.comm, step.time, memory.total <= cluster.usable_memory, host_fits,
                      step.accumulation, config.is_moe)


def rank(evaluations: Iterable[Evaluation]) -> List[Evaluation]:
    """Fitting layouts first (device and host), then the highest predicted throughput, then smallest."""
    return sorted(evaluations, key=lambda e: (not (e.fits and e.host_fits), -e.tokens_per_s, e.memory.total))


def refused_stages(stages: Iterable[int], setup: TrainingSetup) -> Dict[int, str]:
    """The ZeRO ``stages`` that ``setup``'s compression settings cannot run at, each with the rule's reason."""
    refused = {int(stage): setup.compression_problem(stage) for stage in stages}
    return {stage: why for stage, why in refused.items() if why}


def refused_placements(candidates: Iterable[Candidate], cluster: Cluster,
                       setup: TrainingSetup) -> Dict[Tuple[int, int], str]:
    """The ``(tp, dp)`` of ``candidates`` that ``setup`` cannot run on ``cluster``'s nodes, each with the
    reason (:func:`hybrid.plan.predict.placement_problem`)."""
    sizes = sorted({(c.tp, c.dp * c.cp, c.pp) for c in candidates})  # the data ranks: dp x cp
    refused = {(tp, dp): placement_problem(setup, cluster.placement(tp, dp, pp)) for tp, dp, pp in sizes}
    return {size: why for size, why in refused.items() if why}


def plan(config: GPTConfig, cluster: Cluster, global_batch: int, setup: TrainingSetup = TrainingSetup(),
         choices: Choices = Choices()) -> List[Evaluation]:
    """Every valid layout of ``config`` on ``cluster``, evaluated and ranked; layouts at a stage that
    :func:`refused_stages` names, or of a size :func:`refused_placements` names, are skipped (LayoutError
    with the first reason when that leaves none)."""
    candidates = enumerate_layouts(config, cluster, global_batch, choices)
    refused = refused_stages({c.zero_stage for c in candidates}, setup)
    placed = refused_placements(candidates, cluster, setup)
    allowed = [c for c in candidates if int(c.zero_stage) not in refused and (c.tp, c.dp * c.cp) not in placed]
    if not allowed:
        raise LayoutError(next(iter({**refused, **placed}.values())))
    return rank(evaluate(config, candidate, cluster, setup, global_batch) for candidate in allowed)


def as_data_ranks(candidate: Candidate) -> Candidate:
    """``candidate`` with its ``dp x cp`` data ranks as ``dp`` and no cp: the layout a cp layout's state,
    collectives and placement are evaluated as (:mod:`hybrid.plan.context_parallel`)."""
    return dataclasses.replace(candidate, cp=1, parallel=dataclasses.replace(candidate.parallel,
                                                                            dp=candidate.dp * candidate.cp))


def estimate_cp_memory(config: GPTConfig, candidate: Candidate, setup: TrainingSetup = TrainingSetup(),
                       micro_batches: Optional[int] = None) -> MemoryEstimate:
    """:func:`hybrid.plan.estimate.estimate_memory` of a context-parallel ``candidate``: the ``s / cp``-token
    sequences on ``dp x cp`` data ranks, and the moments the ring's buffers
    (:func:`hybrid.plan.context_parallel.ring_in_flight`) are live: the last layer's attention, forward (every
    layer's saved activations and the ring's forward buffers) and backward (the same, the ring's backward
    buffers and the layer's incoming gradient, ``p S mb h / r``); a peak is the larger of such a moment and
    the plain estimate's (the loss's, usually), with its fragmentation allowance."""
    cp = candidate.cp
    run_config = local_config(config, cp)
    memory = estimate_memory(run_config, as_data_ranks(candidate), setup, micro_batches)
    ring = ring_in_flight(config, candidate.micro_batch, candidate.tp, cp, candidate.precision)
    layers = memory.state.device_total + memory.held_activations - memory.activations.head
    p = DTYPE_BYTES[candidate.precision]
    incoming = p * run_config.seq_length * candidate.micro_batch * config.hidden_size
    if candidate.sequence_parallel and candidate.tp > 1:
        incoming //= candidate.tp
    forward = max(memory.forward_peak, layers + ring.forward)
    backward = max(memory.backward_peak, layers + ring.backward + incoming)
    grown = max(forward, backward, memory.step_peak) - memory.peak
    return dataclasses.replace(memory, candidate=candidate, forward_peak=forward, backward_peak=backward,
                               fragmentation=memory.fragmentation + int(setup.fragmentation * grown))


def _evaluate_cp(config: GPTConfig, candidate: Candidate, cluster: Cluster, setup: TrainingSetup,
                 global_batch: int) -> Evaluation:
    """:func:`evaluate` for a context-parallel candidate: the same layout with ``dp x cp`` data ranks training
    ``cp x`` as many sequences of ``s / cp`` tokens, plus the ring's buffers, bytes and exposed seconds and the
    attention's FLOPs over the whole sequence (:mod:`hybrid.plan.context_parallel`)."""
    cp, tp, mb = candidate.cp, candidate.tp, candidate.micro_batch
    run_config, run = local_config(config, cp), as_data_ranks(candidate)
    run_batch = global_batch * cp
    micro_batches = run_batch // (run.dp * mb)
    memory = estimate_cp_memory(config, candidate, setup, micro_batches)
    placement = cluster.placement(tp, run.dp, candidate.pp, candidate.parallel.ep)
    step = predict(run_config, run, run_batch, setup, placement, cluster.link, cluster.flops_per_s, cluster.host)
    layers = -(-config.num_layers // candidate.pp)  # the slowest pipeline rank's layers
    calls = layers * step.accumulation
    overlap = ring_overlap(config, mb, tp, cp, candidate.dp, candidate.precision, candidate.recompute,
                           cluster.node_size, cluster.link, cluster.flops_per_s)
    sent = ring_bytes_per_layer(config, mb, tp, cp, candidate.precision, candidate.recompute).total * calls
    comm = dict(step.comm)
    comm["ring/cp"] = {"calls": calls, "payload_bytes": sent, "wire_bytes": float(sent)}
    crossing = ring_crossing_senders(tp, cp, candidate.dp, cluster.node_size)
    off_node = sent * crossing
    exposed = overlap.exposed_s * calls
    link = "inter" if overlap.crosses_nodes else "intra"
    passes = 3 if candidate.recompute == "full" else 2
    seconds = overlap.transfer_s * (cp - 1) * passes * calls
    time = step.time
    recomputed = 1 if candidate.recompute in ("selective", "full") else 0
    time = dataclasses.replace(
        time, compute=time.compute * compute_scale(config, cp, recomputed),
        intra=time.intra + (exposed if link == "intra" else 0.0),
        inter=time.inter + (exposed if link == "inter" else 0.0),
        inter_bytes_by_node=tuple(b + off_node for b in time.inter_bytes_by_node) or ((off_node,) if off_node else ()),
        collectives=time.collectives + (CollectiveTime("ring/cp", link, seconds, exposed, off_node),))
    host_fits = cluster.cpu_memory is None or memory.host * cluster.node_size <= cluster.cpu_memory
    return Evaluation(candidate, memory, comm, time, memory.total <= cluster.usable_memory, host_fits,
                      step.accumulation, config.is_moe)
