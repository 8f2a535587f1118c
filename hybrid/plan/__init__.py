"""The memory planner: predict what each layout holds per device before launching it.

``python -m hybrid.plan --model turing-nlg-17b --gpus 256 --gpus-per-node 16 --gpu-memory 32GiB
--seq-length 1024 --global-batch-size 512`` prints every valid layout (TP, DP, ZeRO stage, offload,
recomputation, micro batch) with its per-GPU memory by component, whether it fits, the bytes each
collective moves (and what crosses between nodes) and a predicted step time, the layouts that fit ranked
by predicted throughput. ``docs/planner.md`` states the formulas; ``tests/plan`` checks them against the
bytes real runs hold and against step times measured over slow links.

Modules: :mod:`~hybrid.plan.candidate` (what the planner varies: a :class:`hybrid.layout.ParallelLayout`
with offload, recomputation, micro batch and sequence parallelism), :mod:`~hybrid.plan.setup` (what it
does not: optimizer and ZeRO knobs), :mod:`~hybrid.plan.model_memory` (weights, gradients, optimizer
state, laid out like the ZeRO flat buffers), :mod:`~hybrid.plan.activations` (what autograd saves),
:mod:`~hybrid.plan.estimate` (the peak), :mod:`~hybrid.plan.zero_collectives` (which collectives a stage
runs, from its traits), :mod:`~hybrid.plan.comm_volume`, :mod:`~hybrid.plan.timing`,
:mod:`~hybrid.plan.links` (which bytes cross between nodes), :mod:`~hybrid.plan.compressed` (quantized
ZeRO collectives: their bytes and buffers), :mod:`~hybrid.plan.two_level` (``zero.two_level_reduce``: the
dp group's ranks per node and nodes), :mod:`~hybrid.plan.predict`
(:func:`predict_step_time`: one layout's step without the command line), :mod:`~hybrid.plan.cluster`,
:mod:`~hybrid.plan.layouts`, :mod:`~hybrid.plan.report`, and
:mod:`~hybrid.plan.measure` (the instruments the tests use). Every decision that depends on the ZeRO
stage reads :data:`hybrid.layout.STAGE_TRAITS`.
"""

from hybrid.layout import LayoutError, ParallelLayout, ZeroStage
from hybrid.plan.activations import CPU, CUDA, ActivationBytes, DeviceProfile, activation_bytes
from hybrid.plan.candidate import Candidate
from hybrid.plan.cluster import Cluster, ClusterError, parse_size
from hybrid.plan.comm_volume import step_volume
from hybrid.plan.estimate import MemoryEstimate, estimate_memory, zero_layout
from hybrid.plan.layouts import Choices, Evaluation, evaluate, plan
from hybrid.plan.links import HostLink, LinkError, LinkSpec, Placement
from hybrid.plan.model_memory import flat_layout, shard_shapes, state_bytes
from hybrid.plan.predict import predict_step_time
from hybrid.plan.setup import TrainingSetup
from hybrid.plan.timing import StepTime

__all__ = ["ActivationBytes", "CPU", "CUDA", "Candidate", "Choices", "Cluster", "ClusterError", "Evaluation",
           "DeviceProfile", "HostLink", "LayoutError", "LinkError", "LinkSpec", "MemoryEstimate", "ParallelLayout",
           "Placement", "StepTime", "TrainingSetup", "ZeroStage", "activation_bytes", "estimate_memory", "evaluate",
           "flat_layout", "parse_size", "plan", "predict_step_time", "shard_shapes", "state_bytes", "step_volume",
           "zero_layout"]
