"""ZeRO: data parallelism that partitions training state over the DP group.

Stage 0 is plain data parallelism with bucketed, overlapped all-reduce;
stage 1 partitions the fp32 master weights and optimizer state; stage 2
partitions the gradients too; stage 3 partitions the parameters themselves
(what each stage partitions is the table :data:`hybrid.layout.STAGE_TRAITS`).
Stages that partition the optimizer state can keep it in host memory
(``offload_optimizer="cpu"``). Everything works on flat buffers cut into
padded partitions; see ``docs/zero.md``.

:func:`build_zero_optimizer` builds the optimizer of a stage; every one
implements :class:`ZeroOptimizer` (:mod:`hybrid.zero.base`). Under expert
parallelism it is :class:`ExpertSplitOptimizer`, the stage's optimizer over
the dense parameters and ``dp`` and another over the experts and ``edp``.
"""

from hybrid.zero.flat_buffer import ParamRecord, Part, ZeroConfigError
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.base import ZeroOptimizer
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.expert_split import ExpertSplitOptimizer
from hybrid.zero.order_check import GatherOrderError

__all__ = ["ZeroOptimizer", "ExpertSplitOptimizer", "build_zero_optimizer", "LossScaler", "ParamRecord", "Part", "ZeroConfigError", "GatherOrderError"]
