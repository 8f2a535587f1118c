"""The trainer's monitor: one console line per log interval, TensorBoard events and W&B.

Every rank may call it; only the rank built with ``is_logging_rank=True``
keeps metrics, prints and writes event files and the W&B run (the others do nothing), so
callers need no rank checks around it. Values must already be reduced over
ranks (the loss averaged over DP, the grad norm global) by the caller.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from hybrid.monitor.console import format_evaluation_line, format_train_line
from hybrid.monitor.flops import PeakFlops
from hybrid.monitor.interval import IntervalAccumulator, IntervalSummary, IterationMetrics
from hybrid.monitor.memory import MemoryStats, read_memory_stats
from hybrid.monitor.moe import format_moe_layer_line
from hybrid.monitor.scalars import ScalarStream
from hybrid.monitor.tensorboard_writer import TensorBoardSink


def _print_line(line: str) -> None:
    print(line, flush=True)


class TrainingMonitor:
    """Args:
        train_iters: total iterations of the run (for ``iteration/total``).
        log_interval: report every this many iterations (and at ``train_iters``).
        is_logging_rank: whether this rank prints and writes TensorBoard events.
        seq_length: tokens per sample.
        world_size: number of devices (processes) sharing the work, for per-device rates.
        flops_per_token: model FLOPs per token, forward + backward; None disables TFLOP/s and MFU.
        peak: the device peak for MFU (:func:`hybrid.monitor.flops.resolve_peak_flops`).
        tensorboard_dir: where to write event files; None for console only.
        device: the training device, for memory statistics.
        print_fn: receives each console line.
        memory_fn: returns a :class:`MemoryStats` snapshot for ``device``.
        moe_per_layer: also print one line per MoE layer after each training line (``--moe-per-layer-logging``;
            TensorBoard gets every layer's tags either way).
        wandb_project: also log to Weights & Biases, this project (``--wandb-project``; None: no W&B); the run is
            named ``wandb_exp_name`` and its folder goes in ``wandb_dir``
            (:func:`hybrid.monitor.wandb_writer.wandb_dir`). It gets the same tags at the same steps as
            TensorBoard (:class:`~hybrid.monitor.scalars.ScalarStream`).
    """

    def __init__(self, *, train_iters: int, log_interval: int, is_logging_rank: bool,
                 seq_length: int, world_size: int, flops_per_token: Optional[float] = None,
                 peak: Optional[PeakFlops] = None, tensorboard_dir: Optional[str] = None,
                 device: Optional[torch.device] = None,
                 print_fn: Callable[[str], None] = _print_line,
                 memory_fn: Callable[[Optional[torch.device]], MemoryStats] = read_memory_stats,
                 moe_per_layer: bool = False, wandb_project: Optional[str] = None,
                 wandb_exp_name: Optional[str] = None, wandb_dir: str = "wandb"):
        if train_iters < 0:  # 0: a run that only evaluates (--skip-train at iteration 0)
            raise ValueError(f"train_iters must be >= 0, got {train_iters}")
        if log_interval < 1:
            raise ValueError(f"log_interval (--log-interval) must be >= 1, got {log_interval}")
        self.train_iters, self.log_interval = train_iters, log_interval
        self.is_logging_rank = is_logging_rank
        self.device = device
        self._print, self._memory = print_fn, memory_fn
        self._acc = IntervalAccumulator(seq_length, world_size, flops_per_token, peak)
        sinks = []
        if is_logging_rank and tensorboard_dir is not None:
            sinks.append(TensorBoardSink(tensorboard_dir))
        if is_logging_rank and wandb_project:
            from hybrid.monitor.wandb_writer import WandbSink  # imports wandb: only when asked for

            sinks.append(WandbSink(wandb_project, wandb_exp_name, wandb_dir, print_fn))
        self._scalars = ScalarStream(sinks)  # every sink gets the same scalars (none: console only)
        self.peak = peak
        self.moe_per_layer = moe_per_layer
        self.last_summary: Optional[IntervalSummary] = None

    def announce(self) -> None:
        """Print how TFLOP/s and MFU are computed (once, at start-up)."""
        if not self.is_logging_rank:
            return
        peak = self.peak.describe() if self.peak else "unknown (MFU not reported; pass --peak-tflops)"
        self._print(f"MFU peak: {peak}")

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's settings (TensorBoard: a text table; W&B: the run's config)."""
        self._scalars.write_hparams(hparams)

    def ends_interval(self, iteration: int) -> bool:
        """Whether :meth:`record` of ``iteration`` reports (every rank may ask: collective statistics such as
        the MoE routing's are gathered for exactly these iterations)."""
        return iteration % self.log_interval == 0 or iteration == self.train_iters

    def record(self, metrics: IterationMetrics) -> Optional[str]:
        """Add one iteration; at the end of a log interval print and return its line."""
        if not self.is_logging_rank:
            return None
        self._acc.add(metrics)
        if not self.ends_interval(metrics.iteration):
            return None
        return self.flush_interval()

    def flush_interval(self) -> Optional[str]:
        """Report the iterations recorded so far even mid-interval (e.g. before an early exit)."""
        if not self.is_logging_rank or len(self._acc) == 0:
            return None
        summary = self._acc.summarize(self.train_iters, self._memory(self.device))
        self.last_summary = summary
        line = format_train_line(summary)
        self._print(line)
        if self.moe_per_layer and summary.moe:
            for report in summary.moe:
                self._print(format_moe_layer_line(report))
        self._scalars.write_train(summary)
        return line

    def record_evaluation(self, split: str, iteration: int, lm_loss: float) -> Optional[str]:
        """Report the loss of an evaluation on ``split`` (``"valid"`` or ``"test"``), already averaged over
        ``--eval-iters`` and ranks."""
        if not self.is_logging_rank:
            return None
        line = format_evaluation_line(split, iteration, lm_loss)
        self._print(line)
        self._scalars.write_evaluation(split, iteration, lm_loss)
        return line

    def record_checkpoint(self, iteration: int, blocking_s: float, write_s: float, nbytes: int) -> None:
        """Report a complete checkpoint of ``iteration`` to TensorBoard and W&B (the trainer prints its own
        line)."""
        self._scalars.write_checkpoint(iteration, blocking_s, write_s, nbytes)

    def flush(self) -> None:
        self._scalars.flush()

    def close(self) -> None:
        """Flush and close the event file and the W&B run; safe to call more than once."""
        self._scalars.close()

    def __enter__(self) -> "TrainingMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
