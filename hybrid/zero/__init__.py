"""ZeRO: data parallelism that partitions training state over the DP group.

Stage 0 is plain data parallelism with bucketed, overlapped all-reduce;
stage 1 partitions the fp32 master weights and optimizer state; stage 2
partitions the gradients too; stage 3 (:mod:`hybrid.zero.stage3`) partitions
the parameters themselves. Stages 1-3 can keep the optimizer in host memory
(``offload_optimizer="cpu"``). Everything works on flat buffers cut into
padded partitions; see ``docs/zero.md``.
"""

from hybrid.zero.flat_buffer import ParamRecord, Part, ZeroConfigError
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.optimizer import ZeroOptimizer
from hybrid.zero.order_check import GatherOrderError

__all__ = ["ZeroOptimizer", "LossScaler", "ParamRecord", "Part", "ZeroConfigError", "GatherOrderError"]
