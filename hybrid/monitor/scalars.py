"""What the trainer's monitor logs, decided in one place: the tags and their values at each step.

:class:`ScalarStream` turns an interval's summary, an evaluation or a saved checkpoint into ``{tag: value}`` at
one step (the iteration) and hands the same dict to every sink: TensorBoard
(:class:`hybrid.monitor.tensorboard_writer.TensorBoardSink`) and Weights & Biases
(:class:`hybrid.monitor.wandb_writer.WandbSink`). A sink only writes what it is given, so the two cannot log
different tags or steps.

The tag set is fixed (dashboards and tests rely on it):

=========================  ============================================
``train/lm_loss``          mean training loss over the log interval
``train/lr``               learning rate
``train/grad_norm``        gradient norm
``train/params_norm``      weight norm (``--log-params-norm``)
``train/num_zeros``        exact zeros in the gradient (``--log-num-zeros-in-grad``)
``train/loss_scale``       loss scale (1 when training without one)
``train/skipped_iters``    skipped iterations in the interval
``train/iteration_time_s`` mean iteration time in the interval
``train/tokens_per_sec``   tokens per second, whole job
``train/tflops_per_device`` achieved model TFLOP/s per device
``train/mfu``              model FLOPs utilization (fraction of peak)
``train/batch_size``       global batch size in samples
``memory/allocated_bytes`` CUDA allocated, or process RSS on CPU
``memory/peak_bytes``      CUDA peak allocated, or peak RSS on CPU
``valid/lm_loss``          validation loss
``valid/ppl``              validation perplexity
``test/lm_loss``           test loss (at the end of training)
``test/ppl``               test perplexity
``checkpoint/blocking_s``  seconds training waited for the save (all of a
                           synchronous one; a background one's host copy)
``checkpoint/write_s``     seconds from the start of writing to ``latest``
``checkpoint/bytes``       size of the whole checkpoint (every rank's files)
=========================  ============================================

An MoE model adds, at each log interval (``hybrid.monitor.moe``):

=====================================  ==================================================
``moe/layer_{i}/load_max_over_mean``   layer i: the most loaded expert's assignments over the mean
``moe/layer_{i}/load_min_over_mean``   layer i: the least loaded expert's over the mean
``moe/layer_{i}/dropped_fraction``     layer i: assignments dropped over capacity (not dropless)
``moe/layer_{i}/aux_loss``             layer i: balancing loss, mean per micro-batch, no coefficient
``moe/layer_{i}/z_loss``               layer i: router z-loss, likewise
``moe/load_max_over_mean``             the highest of the layers'
``moe/load_min_over_mean``             the lowest of the layers'
``moe/aux_loss``, ``moe/z_loss``       summed over the MoE layers (every pipeline stage's)
=====================================  ==================================================

(``i`` the global layer index; a loss the model does not compute is not written).

The checkpoint tags are written at the iteration that was saved, once the
save is complete (a background save: when the trainer collects it).

plus the hyperparameters (TensorBoard: a markdown table under the text tag ``hyperparameters``; W&B: the run's
config). A scalar whose value is unknown (no peak for MFU, no
grad norm, a params norm or zero count not asked for) or not finite is not written for that step.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Protocol, Sequence

from hybrid.monitor.console import perplexity
from hybrid.monitor.interval import IntervalSummary
from hybrid.monitor.moe import moe_scalars

TRAIN_TAGS = (
    "train/lm_loss", "train/lr", "train/grad_norm", "train/params_norm", "train/num_zeros", "train/loss_scale",
    "train/skipped_iters",
    "train/iteration_time_s", "train/tokens_per_sec", "train/tflops_per_device", "train/mfu",
    "train/batch_size", "memory/allocated_bytes", "memory/peak_bytes",
)


def evaluation_tags(split: str) -> tuple:
    """The (loss, perplexity) tags of an evaluated split (a key of ``console.EVALUATED_SPLITS``)."""
    return f"{split}/lm_loss", f"{split}/ppl"


VALID_TAGS = evaluation_tags("valid")
TEST_TAGS = evaluation_tags("test")
CHECKPOINT_TAGS = ("checkpoint/blocking_s", "checkpoint/write_s", "checkpoint/bytes")
HPARAMS_TAG = "hyperparameters"


def train_scalars(s: IntervalSummary) -> Dict[str, Optional[float]]:
    """The value of every train/memory tag for one interval (None: unknown)."""
    return {
        "train/lm_loss": s.lm_loss,
        "train/lr": s.learning_rate,
        "train/grad_norm": s.grad_norm,
        "train/params_norm": s.params_norm,
        "train/num_zeros": None if s.num_zeros is None else float(s.num_zeros),
        "train/loss_scale": 1.0 if s.loss_scale is None else s.loss_scale,
        "train/skipped_iters": float(s.skipped_iters),
        "train/iteration_time_s": s.iteration_time_s,
        "train/tokens_per_sec": s.tokens_per_sec,
        "train/tflops_per_device": s.tflops_per_device,
        "train/mfu": s.mfu,
        "train/batch_size": float(s.batch_size),
        "memory/allocated_bytes": None if s.memory is None else float(s.memory.allocated_bytes),
        "memory/peak_bytes": None if s.memory is None else float(s.memory.peak_bytes),
    }


class ScalarSink(Protocol):
    """Where a :class:`ScalarStream` writes: TensorBoard, W&B."""

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Write ``scalars`` (tag -> finite value) at ``step`` (the iteration)."""

    def add_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's settings (dotted key -> value)."""

    def flush(self) -> None: ...

    def close(self) -> None:
        """Flush and release; called once."""


class ScalarStream:
    """The monitor's scalars, the same to every sink in ``sinks``. Create it on the logging rank only."""

    def __init__(self, sinks: Sequence[ScalarSink]):
        self.sinks = tuple(sinks)
        self._closed = False

    def write_scalars(self, step: int, scalars: Mapping[str, Optional[float]]) -> None:
        """Hand the known, finite values of ``scalars`` to every sink, at ``step``."""
        kept = {tag: float(v) for tag, v in scalars.items() if v is not None and math.isfinite(v)}
        if kept and not self._closed:
            for sink in self.sinks:
                sink.add_scalars(step, kept)

    def _scalar(self, tag: str, value: Optional[float], step: int) -> None:
        self.write_scalars(step, {tag: value})

    def write_train(self, s: IntervalSummary) -> None:
        scalars = train_scalars(s)
        if s.moe:
            scalars.update(moe_scalars(s.moe))
        self.write_scalars(s.iteration, scalars)

    def write_evaluation(self, split: str, iteration: int, lm_loss: float) -> None:
        self.write_scalars(iteration, dict(zip(evaluation_tags(split), (lm_loss, perplexity(lm_loss)))))

    def write_checkpoint(self, iteration: int, blocking_s: float, write_s: float, nbytes: int) -> None:
        self.write_scalars(iteration, dict(zip(CHECKPOINT_TAGS, (blocking_s, write_s, float(nbytes)))))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        if not self._closed:
            for sink in self.sinks:
                sink.add_hparams(hparams)

    def flush(self) -> None:
        if not self._closed:
            for sink in self.sinks:
                sink.flush()

    def close(self) -> None:
        """Flush and close every sink; safe to call more than once."""
        if not self._closed:
            self._closed = True
            for sink in self.sinks:
                sink.close()
