"""A layout's step, predicted: its collectives and its time, without the command line.

:func:`predict` is what the planner evaluates for every candidate (the command
line ranks by it); :func:`predict_step_time` is the same prediction for a
layout given by its parts, for benchmarks and tests::

    from hybrid.plan import LinkSpec, ParallelLayout, predict_step_time
    t = predict_step_time(config, ParallelLayout(tp=2, dp=2, zero_stage=1, precision="fp32"),
                          micro_batch=4, global_batch=16, nodes=2, ranks_per_node=2,
                          link=LinkSpec(intra_bytes_per_s=math.inf, inter_bytes_per_s_per_node=25e6),
                          achieved_flops_per_s=20e9)
    t.compute, t.intra, t.inter, t.total, t.tokens_per_s, t.inter_node_bytes_per_node
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from hybrid.layout import LayoutError, ParallelLayout, reduce_once_problem
from hybrid.plan.candidate import Candidate
from hybrid.plan.comm_volume import Report, step_volume
from hybrid.plan.estimate import expert_layout, zero_layout
from hybrid.plan.links import HostLink, LinkSpec, Placement
from hybrid.plan.model_memory import FlatLayout, Stage3Layout
from hybrid.plan.setup import TrainingSetup
from hybrid.plan.timing import StepTime, step_time
from hybrid.plan.two_level import hpz_placement_problem, two_level_problem
from model_zoo.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A candidate's ZeRO layout, accumulation steps, collectives and step time."""

    layout: Union[FlatLayout, Stage3Layout]
    accumulation: int
    comm: Report
    time: StepTime


def accumulation_steps(candidate: Candidate, global_batch: int) -> int:
    """Micro-batches per rank per step; ``global_batch`` must be a whole number of ``dp × micro_batch``."""
    per_step = candidate.dp * candidate.micro_batch
    if not isinstance(global_batch, int) or global_batch < 1 or global_batch % per_step:
        raise LayoutError(f"global batch {global_batch!r} is not a positive multiple of dp × micro batch = "
                          f"{candidate.dp} × {candidate.micro_batch}")
    return global_batch // per_step


def placement_problem(setup: TrainingSetup, placement: Placement) -> Optional[str]:
    """Why ``setup`` cannot run on ``placement`` (None when it can): ``zero.two_level_reduce`` needs every dp
    group split evenly over the nodes (:func:`hybrid.plan.two_level.two_level_problem`), and
    ``zero.hpz_partition_size`` must be the dp ranks each node holds
    (:func:`hybrid.plan.two_level.hpz_placement_problem`)."""
    if setup.two_level_reduce:
        problem = two_level_problem(placement.tp, placement.dp, placement.ranks_per_node)
        if problem:
            return problem
    return hpz_placement_problem(setup.hpz_partition_size, placement.tp, placement.dp, placement.ranks_per_node)


def predict(config: GPTConfig, candidate: Candidate, global_batch: int, setup: TrainingSetup, placement: Placement,
            link: LinkSpec, flops_per_s: float, host: Optional[HostLink] = None) -> Prediction:
    """The collectives and step time of ``candidate`` (its slowest pipeline rank's, with a pipeline;
    ``placement`` then places one stage's ranks) (``setup.reduce_once``, the compression formats,
    ``setup.two_level_reduce`` and ``setup.hpz_partition_size`` included). A stage the compression settings
    (hpZ included) cannot run at is refused (LayoutError) with the rule's words
    (:meth:`TrainingSetup.compression_problem`), and so is a placement they cannot run on
    (:func:`placement_problem`)."""
    problem = setup.compression_problem(candidate.zero_stage) or placement_problem(setup, placement)
    if problem:
        raise LayoutError(problem)
    accumulation = accumulation_steps(candidate, global_batch)
    slowest = None
    for pp_rank in range(candidate.pp):  # a pipeline's step is its slowest rank's
        layout = zero_layout(config, candidate, setup, pp_rank)
        comm = step_volume(config, layout, candidate, micro_batches=accumulation, reduce_once=setup.whole_gradients,
                           gradients=setup.gradient_quant, weights=setup.weight_quant,
                           node_split=placement.node_split if setup.two_level_reduce else None,
                           hpz=setup.hpz_partition_size, momentum=setup.momentum_quant, keep=setup.stage3_keep,
                           pp_rank=pp_rank, experts=expert_layout(config, candidate, setup, pp_rank))
        time = step_time(config, candidate, comm, global_batch=global_batch, micro_batches=accumulation,
                         layout=layout, placement=placement, link=link, flops_per_s=flops_per_s,
                         host=host, reduce_once=setup.whole_gradients, hpz=setup.hpz_partition_size,
                         keep=setup.stage3_keep, pp_rank=pp_rank, overlap_param_gather=setup.overlap_param_gather)
        if slowest is None or time.total > slowest.time.total:
            slowest = Prediction(layout, accumulation, comm, time)
    return slowest


def predict_step_time(model_config: GPTConfig, layout: ParallelLayout, micro_batch: int, global_batch: int,
                      nodes: int, ranks_per_node: int, link: LinkSpec, achieved_flops_per_s: float, *,
                      reduce_once: bool = False, recompute: str = "none", sequence_parallel: bool = False,
                      setup: Optional[TrainingSetup] = None, pipeline_schedule: str = "1f1b",
                      virtual_stages: int = 1) -> StepTime:
    """Predicted step time of ``layout`` (tp × dp ranks on ``nodes`` × ``ranks_per_node``) training
    ``global_batch`` sequences per step in micro-batches of ``micro_batch``.

    ``achieved_flops_per_s``: model FLOP/s one rank achieves (given, or measured); ``reduce_once``:
    ``zero.reduce_once`` (stage 2 keeps whole gradients and reduces once per step; refused for stage 3, as
    the runtime refuses it), whatever ``setup`` says; ``setup``: the other ZeRO knobs (bucket size, the
    ``zero.quantized_*`` formats...), :class:`TrainingSetup` defaults when None. No optimizer offload (it
    needs a host link: use :func:`predict`). With a pipeline (``layout.pp`` > 1), ``nodes`` ×
    ``ranks_per_node`` place one stage's ``tp × dp`` ranks, and ``pipeline_schedule`` / ``virtual_stages`` are
    its schedule and model chunks per rank.
    """
    problem = reduce_once_problem(layout.zero_stage, reduce_once)
    if problem:
        raise LayoutError(problem)
    candidate = Candidate(layout, micro_batch=micro_batch, recompute=recompute, sequence_parallel=sequence_parallel,
                          pipeline_schedule=pipeline_schedule, virtual_stages=virtual_stages)
    setup = dataclasses.replace(setup or TrainingSetup(), reduce_once=reduce_once)
    placement = Placement(tp=layout.tp, dp=layout.dp, nodes=nodes, ranks_per_node=ranks_per_node, ep=layout.ep)
    return predict(model_config, candidate, global_batch, setup, placement, link, achieved_flops_per_s).time
