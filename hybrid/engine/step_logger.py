"""The engine's own progress output: a log line every ``steps_per_print`` steps and, when
``tensorboard.enabled``, scalars per optimizer step. Global rank 0 only.

Tags (x-axis = optimizer step): ``train/loss`` (mean of this rank's micro-batch
losses), ``train/lr`` (rate used by the step), ``train/loss_scale``,
``train/skipped_steps``. The trainer's monitor writes a richer set; give it
``tensorboard.enabled: false`` here to avoid writing twice.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from hybrid.config.schema import HybridConfig

logger = logging.getLogger("hybrid.engine")


class StepLogger:
    def __init__(self, cfg: HybridConfig, is_rank0: bool):
        self.every = cfg.steps_per_print
        self.is_rank0 = is_rank0
        self._writer = None
        if is_rank0 and cfg.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(cfg.tensorboard.output_path, cfg.tensorboard.job_name))

    @property
    def wants_loss(self) -> bool:
        """Whether losses should be collected at all."""
        return self.is_rank0 and (self._writer is not None or self.every > 0)

    def needs_loss(self, step: int) -> bool:
        """Whether :meth:`log` for ``step`` uses the loss (reading it waits for the device)."""
        return self.is_rank0 and (self._writer is not None or (self.every > 0 and step % self.every == 0))

    def log(self, step: int, loss: Optional[float], lr: float, loss_scale: float, skipped: int) -> None:
        if not self.is_rank0:
            return
        if self._writer is not None:
            if loss is not None:
                self._writer.add_scalar("train/loss", loss, step)
            self._writer.add_scalar("train/lr", lr, step)
            self._writer.add_scalar("train/loss_scale", loss_scale, step)
            self._writer.add_scalar("train/skipped_steps", skipped, step)
        if self.every > 0 and step % self.every == 0:
            loss_text = "n/a" if loss is None else f"{loss:.6g}"
            logger.info("step %d: loss %s, lr %.6g, loss scale %g, skipped steps %d",
                        step, loss_text, lr, loss_scale, skipped)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
