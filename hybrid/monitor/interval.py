"""Per-iteration metrics and their summary over one log interval.

Loss and iteration time are averaged over the interval; learning rate, grad
norm, loss scale, batch size, params norm, gradient zeros and the MoE routing report are the last iteration's
values (the MoE one covers the whole interval: the layers count from one report to the next); skipped and
NaN iterations are counted. Iterations whose optimizer step was skipped
(fp16 overflow) or whose loss is not finite are left out of the loss average.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

from hybrid.monitor.flops import PeakFlops, model_flops_utilization, tflops_per_device
from hybrid.monitor.memory import MemoryStats
from hybrid.monitor.moe import MoELayerReport


@dataclasses.dataclass(frozen=True)
class IterationMetrics:
    """What one training iteration reports (values already reduced over ranks).

    ``iteration`` counts completed iterations (the first is 1);
    ``consumed_samples`` includes this iteration's batch; ``batch_size`` is the
    global batch in samples; ``iteration_time_s`` is the wall time of the step.
    """

    iteration: int
    consumed_samples: int
    lm_loss: float
    learning_rate: float
    batch_size: int
    iteration_time_s: float
    grad_norm: Optional[float] = None
    loss_scale: Optional[float] = None  # None: no loss scaling, reported as 1
    skipped: bool = False
    params_norm: Optional[float] = None  # None: not measured (--log-params-norm off)
    num_zeros: Optional[int] = None  # zeros in the gradient; None: not counted (--log-num-zeros-in-grad off)
    # An MoE model's routing since the previous report, every MoE layer (hybrid.training.moe_report); given at the
    # iterations that end a log interval, None elsewhere and for a dense model
    moe: Optional[Tuple[MoELayerReport, ...]] = None

    @property
    def is_nan(self) -> bool:
        return not math.isfinite(self.lm_loss) or (
            self.grad_norm is not None and math.isnan(self.grad_norm))


@dataclasses.dataclass(frozen=True)
class IntervalSummary:
    """One log interval, ready to print and to write to TensorBoard."""

    iteration: int
    train_iters: int
    consumed_samples: int
    iterations: int  # iterations in this interval
    lm_loss: Optional[float]  # None when every iteration was skipped or NaN
    learning_rate: float
    grad_norm: Optional[float]
    loss_scale: Optional[float]
    batch_size: int
    skipped_iters: int
    nan_iters: int
    iteration_time_s: float  # mean
    tokens_per_sec: float  # whole job
    tokens_per_sec_per_device: float
    tflops_per_device: Optional[float]
    mfu: Optional[float]
    peak: Optional[PeakFlops]
    memory: Optional[MemoryStats]
    params_norm: Optional[float] = None
    num_zeros: Optional[int] = None
    moe: Optional[Tuple[MoELayerReport, ...]] = None  # the interval's MoE routing (its last iteration's report)


class IntervalAccumulator:
    """Collects :class:`IterationMetrics` until :meth:`summarize` empties it."""

    def __init__(self, seq_length: int, world_size: int, flops_per_token: Optional[float],
                 peak: Optional[PeakFlops]):
        if seq_length < 1 or world_size < 1:
            raise ValueError(f"seq_length and world_size must be >= 1, got {seq_length}, {world_size}")
        self.seq_length, self.world_size = seq_length, world_size
        self.flops_per_token, self.peak = flops_per_token, peak
        self._items: List[IterationMetrics] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, m: IterationMetrics) -> None:
        self._items.append(m)

    def summarize(self, train_iters: int, memory: Optional[MemoryStats]) -> IntervalSummary:
        if not self._items:
            raise ValueError("no iterations recorded since the last summary")
        items, self._items = self._items, []
        last = items[-1]
        counted = [m.lm_loss for m in items if not m.skipped and not m.is_nan]
        total_time = sum(m.iteration_time_s for m in items)
        tokens = sum(m.batch_size for m in items) * self.seq_length
        tokens_per_sec = tokens / total_time if total_time > 0 else 0.0
        per_device = tokens_per_sec / self.world_size
        tflops = (tflops_per_device(self.flops_per_token, per_device)
                  if self.flops_per_token is not None else None)
        mfu = model_flops_utilization(tflops, self.peak) if tflops is not None else None
        return IntervalSummary(
            iteration=last.iteration, train_iters=train_iters,
            consumed_samples=last.consumed_samples, iterations=len(items),
            lm_loss=sum(counted) / len(counted) if counted else None,
            learning_rate=last.learning_rate, grad_norm=last.grad_norm,
            loss_scale=last.loss_scale, batch_size=last.batch_size,
            skipped_iters=sum(m.skipped for m in items), nan_iters=sum(m.is_nan for m in items),
            iteration_time_s=total_time / len(items), tokens_per_sec=tokens_per_sec,
            tokens_per_sec_per_device=per_device, tflops_per_device=tflops, mfu=mfu,
            peak=self.peak, memory=memory, params_norm=last.params_norm, num_zeros=last.num_zeros,
            moe=last.moe or None)
