"""One optimizer step's predicted time: compute, and the communication each link leaves exposed.

::

    compute   = model FLOPs of the step per rank / achieved FLOP/s per rank
    each collective ("op/axis", all calls of the step), a ring in lockstep:
              = max(busiest node's bytes off the node / node link bandwidth,
                    a rank's bytes to a GPU of its own node / intra-node bandwidth)
                + latency * ring steps
              counted as inter-node when its ring crosses nodes, else intra-node
    exposed   TP and world collectives: all of it (on the critical path);
              DP reductions: what the link has left to do when the step's compute ends.
                Each bucket is reduced once it is full (backward, the last 2/3 of a
                micro-batch's compute, produces gradients in reverse registration order),
                one after the other on the link, in every micro-batch when the stage
                reduces every micro-batch, else in the last;
              the all-gathers after the step: all of it, and so stage 0's quantized all-reduce's
                all-gather of the summed chunks (``zero.quantized_gradients``), which runs
                when the step waits for the reduction; under ``zero.overlap_param_gather``
                (stages 1-2) the weights' all-gathers run behind the next step's first
                forward: what is left of them after one micro-batch's forward (1/3 of its
                compute);
              two-level reductions (``zero.two_level_reduce``): the reduce-scatter inside the node
                (``dp_node``) as the DP reductions above; the step across nodes (``dp_cross``) and
                stage 0's all-gather inside the node: all of it, as the communicator runs them
                (blocking) when the reduction is waited on;
              1-bit Adam's momentum exchange after its warm-up (``all_to_all`` and its
                all-gather): all of it, as it runs in the step after backward;
              partitioned parameters (stage 3): the forward's gathers beyond the forward
              compute they are prefetched behind (1/3 of the compute); the backward's
              gathers (over ``dp_node`` under hpZ, ``zero.hpz_partition_size``), the
              reduce-scatters and the post-step gathers: all of it, since
              before each reduce-scatter (and each prefetch) the order check runs a
              blocking 16-byte all-reduce on the same DP group
              (:mod:`hybrid.zero.order_check`), which waits for what is queued before it
    offload   = 2 * p * G/N_d bytes over the host link (gradients down, weights up)
                + G/N_d parameters / (CPU Adam rate per GPU)
    pipeline  (pp > 1, :mod:`hybrid.plan.pipeline_stages`): compute is the rank's share
              (its layers, the head on the last rank); the bubble adds
              compute * b / (1 - b) idle seconds, b = (p - 1) / (v m + p - 1); the
              transfers that fill and drain the pipeline, and what the node's link cannot
              carry within the compute (:func:`pipeline_seconds`); the tied gradients'
              sum: all of it
    step      = compute + exposed intra-node + exposed inter-node + offload [+ bubble + pipeline]

Model FLOPs come from :func:`model_zoo.flops.flops_per_token`; a rank does
``1/(tp·dp)`` of the step's: DP ranks split the tokens, and TP ranks split
every matmul (and the attention heads) of theirs. Recomputation adds forward
work that is not model FLOPs: full recomputation one more forward
(``2 N_matmul + 4 L s h`` per token), selective the attention core
(``4 L s h`` per token). Which bytes cross nodes is :mod:`hybrid.plan.links`;
the ring model of wire bytes is :mod:`hybrid.plan.comm_volume`. Concurrent
collectives are not charged for sharing a link (DP reductions and TP
collectives in the same backward).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

from hybrid.dtypes import DTYPE_BYTES
from hybrid.plan.candidate import Candidate
from hybrid.plan.comm_volume import Report, stage3_gather_axis, stage3_gathers
from hybrid.plan.links import CollectiveLinks, HostLink, LinkSpec, Placement, link_seconds, split_by_link
from hybrid.plan.model_memory import FlatLayout, Stage3Layout
from hybrid.plan.pipeline_stages import bubble, stage_layers
from hybrid.plan.zero_collectives import reduces_every_micro_batch
from model_zoo.config import GPTConfig
from model_zoo.flops import flops_per_token, matmul_parameters

# The share of a step's compute that is backward (twice the forward's FLOPs).
BACKWARD_SHARE = 2.0 / 3.0
# The axes of a pipeline's own traffic: transfers and the loss broadcast ("pp"), the tied embeddings' gradients
PIPELINE_AXES = ("pp", "embed")


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """One ``"op/axis"`` entry of the step: its link (``"intra"`` or ``"inter"``), its seconds and the part
    of them left exposed (not hidden behind compute), and the busiest node's bytes off the node."""

    name: str
    link: str
    seconds: float
    exposed: float
    inter_node_bytes_per_node: float


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on one rank, by what they are spent on.

    ``intra``/``inter``: exposed seconds of the collectives whose rings stay
    inside nodes / cross them. ``tokens``: tokens of the whole step (all
    ranks). ``inter_bytes_by_node``: what each node sends off it in one step;
    with a pipeline, each node of pipeline rank ``pp_rank``'s stage (the
    placement places one stage), its pipeline sends included.
    ``intra_node_bytes_per_rank``: what a rank sends to GPUs of its own node.
    """

    compute: float
    intra: float
    inter: float
    offload: float
    tokens: int
    inter_bytes_by_node: Tuple[float, ...]
    intra_node_bytes_per_rank: float
    collectives: Tuple[CollectiveTime, ...] = ()
    bubble: float = 0.0  # a pipeline rank's idle seconds while the pipeline fills and drains
    pipeline: float = 0.0  # seconds of pipeline transfers left exposed (and the tied gradients' sum)
    pp_rank: int = 0  # the pipeline rank these figures are for (the slowest, for a whole pipeline layout)

    @property
    def total(self) -> float:
        return self.compute + self.intra + self.inter + self.offload + self.bubble + self.pipeline

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total if self.total > 0 else float("inf")

    @property
    def inter_node_bytes_per_node(self) -> float:
        """The busiest node's bytes off the node per step (every node's, when the layout is symmetric)."""
        return max(self.inter_bytes_by_node, default=0.0)

    @property
    def inter_node_bytes(self) -> float:
        """Bytes all nodes together send off their nodes per step (with a pipeline: the nodes of ``pp_rank``'s
        stage; each stage sends about as much, its activations one way and their gradients the other)."""
        return sum(self.inter_bytes_by_node)


def recompute_flops_per_token(config: GPTConfig, recompute: str) -> int:
    """Extra forward FLOPs per token that recomputation spends in backward."""
    attention = 4 * config.num_layers * config.seq_length * config.attention_width
    if recompute == "full":
        return 2 * matmul_parameters(config) + attention
    if recompute == "selective":
        return attention
    return 0


def flops_per_rank(config: GPTConfig, candidate: Candidate, global_batch: int, pp_rank: int = 0) -> float:
    """FLOPs one rank computes in a step of ``global_batch`` sequences: model FLOPs plus recomputation,
    split over ``tp × dp`` ranks; with a pipeline, pipeline rank ``pp_rank``'s share: its layers' part of the
    layers' FLOPs, and the head's (``6 V h`` per token) on the last rank."""
    tokens = global_batch * config.seq_length
    per_token = flops_per_token(config) + recompute_flops_per_token(config, candidate.recompute)
    if candidate.pp > 1:
        head = 6 * config.vocab_size * config.hidden_size
        layers = stage_layers(config, candidate)[pp_rank]
        per_token = (per_token - head) * layers / config.num_layers + (head if pp_rank == candidate.pp - 1 else 0)
    return tokens * per_token / (candidate.tp * candidate.dp)


def _share(times: Dict[str, float], names: Iterable[str], exposed: float) -> Dict[str, float]:
    """``exposed`` seconds shared among the collectives ``names`` in proportion to their times."""
    names = [n for n in names if n in times]
    busy = sum(times[n] for n in names)
    return {n: (times[n] * exposed / busy if busy > 0 else 0.0) for n in names}


def reductions_left(seconds: float, launches: Sequence[Tuple[float, int]], compute: float, micro_batches: int,
                    every_micro_batch: bool) -> float:
    """Seconds the gradient reductions (``seconds`` in all) still run after the step's compute ends.

    ``launches``: the buckets as ``(ready, size)`` in launch order
    (:attr:`hybrid.plan.model_memory.FlatLayout.launches`); a bucket is ready ``ready`` of the way into its
    micro-batch's backward, and takes its share (by size) of one micro-batch's reductions on the link,
    after the buckets before it.
    """
    if seconds <= 0:
        return 0.0
    launches = tuple(launches) or ((1.0, 1),)
    total = sum(size for _, size in launches)
    per_micro = compute / micro_batches
    backward = BACKWARD_SHARE * per_micro
    rounds = range(micro_batches) if every_micro_batch else (micro_batches - 1,)
    link_free = 0.0
    for j in rounds:
        backward_start = (j + 1) * per_micro - backward
        for ready, size in launches:
            start = max(link_free, backward_start + ready * backward)
            link_free = start + seconds / len(rounds) * size / total
    return max(0.0, link_free - compute)


def exposed_seconds(times: Dict[str, float], candidate: Candidate, compute: float, micro_batches: int,
                    launches: Sequence[Tuple[float, int]] = (), reduce_once: bool = False,
                    forward_gather_share: float = 0.0, overlap_param_gather: bool = False) -> Dict[str, float]:
    """Of each collective's ``times``, the seconds not hidden behind compute (see the module docstring).

    ``launches``: the buckets of whole parameters (:func:`reductions_left`); ``forward_gather_share``: the
    part of a stage-3 step's gathered bytes that forward gathers (:func:`forward_gather_share`);
    ``overlap_param_gather``: ``zero.overlap_param_gather`` (no effect at stages that gather no weights after
    the step).
    """
    exposed = dict(times)
    gathers = [n for n in times if n.startswith("all_gather/") and n.endswith(("/dp", "/edp"))]
    # Launched as the buckets fill: the reductions over dp, and a two-level reduction's first step inside the
    # node; its step across nodes (dp_cross) and stage 0's all-gather inside the node run when it is waited on.
    # 1-bit Adam's momentum exchange (all_to_all, and its all_gather) runs in the step, after backward: exposed.
    # An MoE model's expert gradients reduce over edp as the dense ones over dp; its token all-to-alls over ep
    # sit on the critical path (each layer waits for its tokens): exposed.
    reductions = [n for n in times if n.split("/")[1] in ("dp", "dp_node", "edp")
                  and not n.startswith(("all_gather/", "all_to_all/"))]
    if candidate.traits.parameters:
        forward = sum(times[n] for n in gathers) * forward_gather_share
        hidden = min(forward, (1.0 - BACKWARD_SHARE) * compute)
        exposed.update(_share(times, gathers, sum(times[n] for n in gathers) - hidden))
    else:
        every = reduces_every_micro_batch(candidate.traits, reduce_once)
        left = reductions_left(sum(times[n] for n in reductions), launches, compute, micro_batches, every)
        exposed.update(_share(times, reductions, left))
        if overlap_param_gather and candidate.traits.gathers_after_step:
            weights = sum(times[n] for n in gathers)
            hidden = min(weights, (1.0 - BACKWARD_SHARE) * compute / micro_batches)
            exposed.update(_share(times, gathers, weights - hidden))
    return exposed


def forward_gather_share(layout: Stage3Layout, micro_batches: int, tied_head: bool, hpz: int = 1,
                         keep: Optional[int] = None) -> float:
    """The part of a stage-3 step's bytes all-gathered over ``dp`` that forward gathers
    (:func:`hybrid.plan.comm_volume.stage3_gathers`, ``keep``: its keep window); under hpZ
    (``hpz`` > 1) backward's gathers run over ``dp_node`` and are not among them."""
    phases = {phase: sum(b * calls for b, calls in gathers)
              for phase, gathers in stage3_gathers(layout, micro_batches, tied_head, hpz=hpz,
                                                   keep=keep).items()
              if stage3_gather_axis(phase, hpz) == "dp"}
    total = sum(phases.values())
    return phases["forward"] / total if total else 0.0


def offload_seconds(candidate: Candidate, partition_numel: int, host: Optional[HostLink]) -> float:
    """Host-link traffic and the CPU step of an offloaded optimizer partition of ``partition_numel`` elements."""
    if candidate.offload == "none":
        return 0.0
    if host is None:
        raise ValueError(f"{candidate.describe()} offloads its optimizer: give the host link (HostLink)")
    p = DTYPE_BYTES[candidate.precision]
    return 2 * p * partition_numel / host.bytes_per_s + partition_numel / host.cpu_adam_params_per_s


def step_time(config: GPTConfig, candidate: Candidate, comm: Report, *, global_batch: int, micro_batches: int,
              layout: Union[FlatLayout, Stage3Layout], placement: Placement, link: LinkSpec, flops_per_s: float,
              host: Optional[HostLink] = None, reduce_once: bool = False, hpz: int = 1,
              keep: Optional[int] = None, pp_rank: int = 0, overlap_param_gather: bool = False) -> StepTime:
    """Predicted seconds of one optimizer step (``global_batch`` sequences, ``micro_batches`` per rank) of
    ``candidate`` placed as ``placement``.

    ``comm``: the step's collectives (:func:`hybrid.plan.comm_volume.step_volume`) over ``layout`` (the
    candidate's ZeRO layout: its buckets, and the optimizer partition offload moves and the CPU steps);
    ``flops_per_s``: the FLOP/s one rank achieves; ``reduce_once`` / ``hpz`` / ``keep``: ``zero.reduce_once``
    / ``zero.hpz_partition_size`` / :attr:`TrainingSetup.stage3_keep`, as ``comm`` was built with;
    ``overlap_param_gather``: ``zero.overlap_param_gather`` (:func:`exposed_seconds`). With a pipeline,
    ``layout`` and ``comm`` are pipeline rank ``pp_rank``'s, ``placement`` places one stage's ranks, and the step
    adds the rank's bubble and pipeline transfers (:mod:`hybrid.plan.pipeline_stages`).
    """
    if not flops_per_s > 0:
        raise ValueError(f"the achieved FLOP/s per rank must be > 0, got {flops_per_s!r}")
    compute = flops_per_rank(config, candidate, global_batch, pp_rank) / flops_per_s
    pipeline_entries = {k: v for k, v in comm.items() if k.split("/")[1] in PIPELINE_AXES}
    comm = {k: v for k, v in comm.items() if k not in pipeline_entries}
    split: Dict[str, CollectiveLinks] = split_by_link(comm, placement)
    times = {name: link_seconds(c, link) for name, c in split.items()}
    if isinstance(layout, Stage3Layout):
        launches, share = (), forward_gather_share(layout, micro_batches, config.tie_embeddings, hpz, keep)
    else:
        launches, share = layout.launches, 0.0
    exposed = exposed_seconds(times, candidate, compute, micro_batches, launches, reduce_once, share,
                              overlap_param_gather)
    collectives = tuple(CollectiveTime(name, "inter" if c.crosses_nodes else "intra", times[name], exposed[name],
                                       c.inter_bytes_per_node) for name, c in sorted(split.items()))
    by_node = tuple(map(sum, zip(*(c.inter_bytes_by_node for c in split.values())))) or (0.0,) * placement.nodes
    pipeline, idle = 0.0, 0.0
    if candidate.pp > 1:
        pipeline, crossing = pipeline_seconds(pipeline_entries, candidate, micro_batches, placement, link, compute)
        by_node = tuple(b + crossing for b in by_node)
        idle = compute * bubble(candidate, micro_batches) / (1.0 - bubble(candidate, micro_batches))
    return StepTime(compute=compute,
                    intra=sum(c.exposed for c in collectives if c.link == "intra"),
                    inter=sum(c.exposed for c in collectives if c.link == "inter"),
                    offload=offload_seconds(candidate, layout.partition_numel, host),
                    tokens=global_batch * config.seq_length,
                    inter_bytes_by_node=by_node,
                    intra_node_bytes_per_rank=sum(c.intra_bytes_per_rank for c in split.values()),
                    collectives=collectives, bubble=idle, pipeline=pipeline, pp_rank=pp_rank)


def pipeline_seconds(entries: Report, candidate: Candidate, micro_batches: int, placement: Placement,
                     link: LinkSpec, compute: float) -> Tuple[float, float]:
    """``(seconds, bytes each node sends off it)`` of a pipeline rank's traffic (``entries``: its ``send/pp``,
    ``all_reduce/embed``... of :func:`hybrid.plan.comm_volume.pipeline_volume`), over the inter-node link when
    pipeline neighbours sit on different nodes (``placement``: one stage's ranks). ``compute``: the rank's compute
    seconds in the step.

    A node's ranks send their pieces at once over its one link (``sharing`` of them when a stage fills whole
    nodes), so one transfer takes ``sharing x message / bandwidth``. The ``2 (p - 1)`` transfers that fill and
    drain the pipeline wait; the others overlap the other micro-batches' compute, and whatever of the step's
    sends the link cannot carry within that compute waits too. The tied gradients' sum and the loss broadcast:
    whole, every rank of the node at once, on the same link. ``tests/plan/test_link_time.py`` holds this to the
    steps measured over the emulated slow link."""
    crosses = placement_crosses_stages(placement)
    bandwidth = link.inter_bytes_per_s_per_node if crosses else link.intra_bytes_per_s
    sharing = placement.ranks_per_node if crosses else 1
    seconds, crossing = 0.0, 0.0
    send = entries.get("send/pp")
    if send:
        transfer = sharing * send["payload_bytes"] / send["calls"] / bandwidth + link.latency_s
        seconds += 2 * (candidate.pp - 1) * transfer + max(0.0, send["calls"] * transfer - compute)
    for name, entry in entries.items():
        if name.split("/")[0] in ("send", "recv"):
            continue
        seconds += sharing * entry["wire_bytes"] / bandwidth + link.latency_s * entry["calls"]
    if crosses:
        # every rank of a node at a stage boundary sends to the next stage's rank on another node
        crossing = sharing * sum(e["wire_bytes"] for e in entries.values())
    return seconds, crossing


def placement_crosses_stages(placement: Placement) -> bool:
    """Pipeline neighbours sit on different nodes: one stage's ranks (``placement``) fill whole nodes, as the
    rank order (pipeline outermost) places them."""
    return placement.tp * placement.dp % placement.ranks_per_node == 0
