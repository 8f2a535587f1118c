"""When a run has diverged: consecutive skipped steps, fp16 loss-scale collapse, non-finite weights.

The optimizer skips a step whose gradients are not finite (anywhere in the
world), so a diverged run does not crash: every step is skipped, the loss
stays NaN, and without a limit the run would go on to its last iteration,
saving checkpoints of its blown-up weights and exiting 0. :class:`DivergenceGuard`
counts consecutive *bad* iterations (the step was skipped, or the loss was not
finite) and stops the run after ``run.max_consecutive_skipped_steps`` of them
(``--max-consecutive-skipped-steps``; 0 never stops).

fp16 with dynamic loss scaling legitimately skips a run of steps at start-up,
one per halving of the scale (plus ``hysteresis - 1``) until it fits: at most
17 from the default 2**16 and 65 from 2**64, the largest initial scale, hence
the default limit of 100. A step that overflows when the scale is already at
``min_loss_scale`` can no longer be rescued by the scaler (the *collapse*);
the run stops at once, as DeepSpeed's scaler does.

Every rank takes the same decision: the verdict is reduced over the world.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

DIVERGED_EXIT = 3  # the exit status of a run stopped by this guard (settings and data errors exit 1)

_OK, _BAD, _COLLAPSED = 0, 1, 2
_FIX = "resume from an earlier checkpoint (--load DIR/iter_N) with a lower --lr (or a longer --lr-warmup-iters)"


class TrainingDiverged(RuntimeError):
    """The run stopped because training diverged; the message gives the iteration, the cause and the fix."""

    exit_code = DIVERGED_EXIT


class DivergenceGuard:
    """Tracks consecutive bad iterations of one run; :meth:`check` says when to stop.

    ``loss_scaler`` is the optimizer's :class:`~hybrid.zero.LossScaler` (None
    without fp16 scaling); ``limit`` is ``run.max_consecutive_skipped_steps``.
    """

    def __init__(self, limit: int, loss_scaler=None):
        self.limit = int(limit)
        self.scaler = loss_scaler if loss_scaler is not None and loss_scaler.dynamic else None
        self.consecutive = 0  # bad iterations in a row, up to the last checked one
        self._scale_at_floor = False

    @property
    def healthy(self) -> bool:
        """False while a run of bad iterations is going on: a checkpoint saved now is marked unhealthy."""
        return self.consecutive == 0

    def before_step(self) -> None:
        """Call before each iteration's optimizer step: notes whether the scale is already at its floor."""
        self._scale_at_floor = self.scaler is not None and self.scaler.scale <= self.scaler.min_scale

    def check(self, iteration: int, skipped: bool, loss: float, topology) -> Optional[str]:
        """After the iteration: the reason to stop (every rank gets the same), or None.

        ``skipped``: the optimizer step was skipped; ``loss``: the iteration's
        (DP-averaged) loss. Collective over ``world``.
        """
        bad = skipped or not math.isfinite(loss)
        verdict = _COLLAPSED if (skipped and self._scale_at_floor) else (_BAD if bad else _OK)
        flag = torch.tensor([float(verdict)], device=topology.device)
        topology.comm.all_reduce(flag, "world", op="max")
        verdict = int(flag.item())
        self.consecutive = self.consecutive + 1 if verdict != _OK else 0
        if verdict == _COLLAPSED:
            return (f"training diverged at iteration {iteration}: the fp16 loss scale collapsed (the step "
                    f"overflowed at the minimum scale {self.scaler.min_scale:g}, --min-loss-scale) after "
                    f"{self.consecutive} consecutive skipped step(s), last lm loss {loss:.6g}; {_FIX}, or "
                    f"train in --bf16")
        if self.limit and self.consecutive >= self.limit:
            return (f"training diverged at iteration {iteration}: {self.consecutive} consecutive skipped steps "
                    f"(non-finite gradients or loss), last lm loss {loss:.6g}; {_FIX}, or raise "
                    f"--max-consecutive-skipped-steps (0 never stops)")
        return None


def non_finite_weights_message(iteration: int, save_dir: str) -> str:
    """The error for a save refused because the weights are not finite."""
    return (f"training diverged at iteration {iteration}: the weights are not finite, so no checkpoint was saved "
            f"to {save_dir} (--save); {_FIX}")
