"""The one-line console reports of training and evaluation."""

from __future__ import annotations

import math
from typing import Optional

from hybrid.monitor.interval import IntervalSummary
from hybrid.monitor.moe import format_moe_part


def _opt(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_train_line(s: IntervalSummary) -> str:
    """For example::

        iteration  100/1000 | consumed samples: 6400 | global batch size: 64 | lm loss: 5.432100E+00 |
        lr: 3.000E-04 | grad norm: 1.234 | loss scale: 1 | skipped: 0 | nan: 0 | iteration time: 123.4 ms |
        tokens/s: 12345 | TFLOP/s/device: 1.23 | MFU: 12.34% (measured peak) |
        mem rss 1.20 GiB | peak rss 1.31 GiB

    (on one line); ``num zeros: N | params norm: X`` follow the grad norm when they were measured
    (``--log-num-zeros-in-grad``, ``--log-params-norm``); an MoE model's routing
    (:func:`hybrid.monitor.moe.format_moe_part`) ends the line.
    """
    width = len(str(s.train_iters))
    mfu = "n/a" if s.mfu is None else f"{100 * s.mfu:.2f}% ({s.peak.source} peak)"
    parts = [
        f"iteration {s.iteration:>{width}}/{s.train_iters}",
        f"consumed samples: {s.consumed_samples}",
        f"global batch size: {s.batch_size}",
        f"lm loss: {_opt(s.lm_loss, '.6E')}",
        f"lr: {s.learning_rate:.3E}",
        f"grad norm: {_opt(s.grad_norm, '.3f')}",
        *([] if s.num_zeros is None else [f"num zeros: {s.num_zeros}"]),
        *([] if s.params_norm is None else [f"params norm: {s.params_norm:.3f}"]),
        f"loss scale: {1.0 if s.loss_scale is None else s.loss_scale:.6g}",
        f"skipped: {s.skipped_iters}",
        f"nan: {s.nan_iters}",
        f"iteration time: {1000 * s.iteration_time_s:.1f} ms",
        f"tokens/s: {s.tokens_per_sec:.0f}",
        f"TFLOP/s/device: {_opt(s.tflops_per_device, '.4g')}",
        f"MFU: {mfu}",
    ]
    if s.memory is not None:
        parts.append(s.memory.describe())
    if s.moe:
        parts.append(format_moe_part(s.moe))
    return " | ".join(parts)


def perplexity(loss: float) -> float:
    """``exp(loss)``; infinite when that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


# The splits the trainer evaluates (TensorBoard's tag prefix), each with its word on the console.
EVALUATED_SPLITS = {"valid": "validation", "test": "test"}


def format_evaluation_line(split: str, iteration: int, lm_loss: float) -> str:
    """For example ``validation at iteration 100 | lm loss: 5.4E+00 | lm loss PPL: 2.2E+02``;
    ``split``: a key of :data:`EVALUATED_SPLITS`."""
    return (f"{EVALUATED_SPLITS[split]} at iteration {iteration} | lm loss: {lm_loss:.6E} | "
            f"lm loss PPL: {perplexity(lm_loss):.6E}")
