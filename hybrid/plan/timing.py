"""A simple model of one optimizer step's time, used to rank layouts that fit.

::

    compute   = model FLOPs of the step * recompute factor / (gpus * peak * mfu)
    tp        = TP wire bytes / intra-node bandwidth          (on the critical path)
    dp        = reduction wire bytes / DP bandwidth, hidden behind backward (2/3 of compute) up to
                that time, plus the parameter all-gathers after the step (stages 1-2; stage 3
                prefetches them behind compute instead)
    offload   = 2 * p * G/N_d bytes over the host link (gradients down, weights up)
                + G/N_d parameters / (CPU Adam rate / GPUs per node)
    step      = compute + tp + exposed dp + offload

Model FLOPs come from :func:`model_zoo.flops.flops_per_token`. Recomputation
adds forward work that is not model FLOPs: full recomputation one more forward
(``2 N_matmul + 4 L s h`` per token), selective the attention core
(``4 L s h`` per token). Every number here is an assumption made explicit by
a flag; the ranking, not the absolute time, is what the planner relies on.
"""

from __future__ import annotations

import dataclasses

from hybrid.plan.activations import DTYPE_BYTES
from hybrid.plan.candidate import Candidate
from hybrid.plan.cluster import Cluster
from hybrid.plan.comm_volume import Report, axis_wire_bytes
from model_zoo.config import GPTConfig
from model_zoo.flops import flops_per_token, matmul_parameters


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    tp: float
    dp_exposed: float
    offload: float

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.dp_exposed + self.offload


def recompute_flops_per_token(config: GPTConfig, recompute: str) -> int:
    """Extra forward FLOPs per token that recomputation spends in backward."""
    attention = 4 * config.num_layers * config.seq_length * config.hidden_size
    if recompute == "full":
        return 2 * matmul_parameters(config) + attention
    if recompute == "selective":
        return attention
    return 0


def step_time(config: GPTConfig, cluster: Cluster, candidate: Candidate, *, global_batch: int, partition_numel: int,
              comm: Report) -> StepTime:
    """Predicted seconds of one optimizer step (``global_batch`` sequences) of ``candidate`` on ``tp * dp`` GPUs.

    ``comm``: the step's collectives (:func:`hybrid.plan.comm_volume.step_volume`); ``partition_numel``: the
    elements of this rank's optimizer partition (what offload moves and the CPU steps).
    """
    tp, dp = candidate.tp, candidate.dp
    gpus = tp * dp
    tokens = global_batch * config.seq_length
    flops = tokens * (flops_per_token(config) + recompute_flops_per_token(config, candidate.recompute)) / gpus
    compute = flops / (cluster.peak_tflops * 1e12 * cluster.mfu)
    tp_time = axis_wire_bytes(comm, "tp") / (cluster.intra_node_gbps * 1e9)
    bandwidth = cluster.dp_bandwidth(tp, dp)
    gathers = sum(v["wire_bytes"] for k, v in comm.items() if k.startswith("all_gather/dp")) / bandwidth
    reductions = axis_wire_bytes(comm, "dp") / bandwidth - gathers
    backward = compute * 2.0 / 3.0
    if candidate.traits.parameters:
        # Partitioned parameters are gathered ahead of use, behind the whole step's compute.
        dp_exposed = max(0.0, reductions + gathers - compute)
    else:
        # Reductions hide behind backward; the all-gather of updated parameters waits for the step.
        dp_exposed = max(0.0, reductions - backward) + gathers
    offload_time = 0.0
    if candidate.offload != "none":
        p = DTYPE_BYTES[candidate.precision]
        offload_time = (2 * p * partition_numel / (cluster.pcie_gbps * 1e9)
                        + partition_numel / (cluster.cpu_adam_rate / cluster.node_size))
    return StepTime(compute, tp_time, dp_exposed, offload_time)
