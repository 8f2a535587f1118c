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

In fp32 and bf16 there is no scaler to rescue anything, so by default
(``run.check_for_nan_in_loss_and_grad``, Megatron-LM's
``--check-for-nan-in-loss-and-grad``) the first iteration whose loss or
gradient norm is not finite stops the run, naming the ranks whose own loss
(the last pipeline stage's, before the DP average) was not finite. The
optional loss spike guard (:mod:`hybrid.training.loss_spike`) stops a run
whose loss jumps far above its recent mean.

Every rank takes the same decision: the verdict is reduced over the world.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from hybrid.training.loss_spike import LossSpikeGuard

DIVERGED_EXIT = 3  # the exit status of a run stopped by this guard (settings and data errors exit 1)

# verdicts, reduced with max over the world: the highest one any rank reaches is everyone's
_OK, _BAD, _COLLAPSED, _NON_FINITE, _SPIKE = 0, 1, 2, 3, 4
_OWN_LOSS_NON_FINITE = 1.0  # a rank's own slot in the verdict tensor
_RANKS_NAMED = 8  # a longer list of ranks is cut, with the count
_FIX = "resume from an earlier checkpoint (--load DIR/iter_N) with a lower --lr (or a longer --lr-warmup-iters)"


class TrainingDiverged(RuntimeError):
    """The run stopped because training diverged; the message gives the iteration, the cause and the fix."""

    exit_code = DIVERGED_EXIT


class DivergenceGuard:
    """Tracks consecutive bad iterations of one run; :meth:`check` says when to stop.

    ``loss_scaler`` is the optimizer's :class:`~hybrid.zero.LossScaler` (None
    without fp16 scaling); ``limit`` is ``run.max_consecutive_skipped_steps``;
    ``stop_at_non_finite``: the first non-finite loss or gradient norm stops the
    run (fp32 and bf16 with ``run.check_for_nan_in_loss_and_grad``);
    ``spike``: the optional loss spike guard.
    """

    def __init__(self, limit: int, loss_scaler=None, stop_at_non_finite: bool = False,
                 spike: Optional[LossSpikeGuard] = None):
        self.limit = int(limit)
        self.scaler = loss_scaler if loss_scaler is not None and loss_scaler.dynamic else None
        self.stop_at_non_finite = bool(stop_at_non_finite)
        self.spike = spike
        self.consecutive = 0  # bad iterations in a row, up to the last checked one
        self._scale_at_floor = False

    @property
    def healthy(self) -> bool:
        """False while a run of bad iterations is going on: a checkpoint saved now is marked unhealthy."""
        return self.consecutive == 0

    def before_step(self) -> None:
        """Call before each iteration's optimizer step: notes whether the scale is already at its floor."""
        self._scale_at_floor = self.scaler is not None and self.scaler.scale <= self.scaler.min_scale

    def check(self, iteration: int, skipped: bool, loss: float, topology, grad_norm: float = math.nan,
              own_losses: Sequence[float] = ()) -> Optional[str]:
        """After the iteration: the reason to stop (every rank gets the same), or None.

        ``skipped``: the optimizer step was skipped (its gradient norm, ``grad_norm``,
        was not finite); ``loss``: the iteration's (DP-averaged) loss;
        ``own_losses``: this rank's own micro-batch losses (on the last pipeline
        stage; empty elsewhere). Collective over ``world``: one all-reduce of a
        float32 ``[1 + world_size]`` tensor, the verdict and each rank's own flag.
        """
        bad = skipped or not math.isfinite(loss)
        verdict = _COLLAPSED if (skipped and self._scale_at_floor) else (_BAD if bad else _OK)
        if self.stop_at_non_finite and bad:
            verdict = _NON_FINITE
        mean = self.spike.spike(loss) if self.spike is not None and verdict == _OK else None
        if mean is not None:
            verdict = _SPIKE
        flags = torch.zeros(1 + topology.world_size, device=topology.device)
        flags[0] = float(verdict)
        if not all(math.isfinite(x) for x in own_losses):
            flags[1 + topology.rank] = _OWN_LOSS_NON_FINITE
        topology.comm.all_reduce(flags, "world", op="max")
        verdict = int(flags[0].item())
        self.consecutive = self.consecutive + 1 if verdict != _OK else 0
        if verdict == _NON_FINITE:
            seen = [r for r, f in enumerate(flags[1:].tolist()) if f == _OWN_LOSS_NON_FINITE]
            return _non_finite_message(iteration, loss, grad_norm, skipped, seen, topology.world_size)
        if verdict == _SPIKE:
            # the loss is the DP-averaged one every rank holds: the same mean on every rank
            return self.spike.message(iteration, loss, mean if mean is not None else math.nan, _FIX)
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


def _ranks(ranks: List[int]) -> str:
    named = ", ".join(str(r) for r in ranks[:_RANKS_NAMED])
    return named + (f", ... ({len(ranks)} ranks)" if len(ranks) > _RANKS_NAMED else "")


def _non_finite_message(iteration: int, loss: float, grad_norm: float, skipped: bool, seen: List[int],
                        world_size: int) -> str:
    """The stop of ``run.check_for_nan_in_loss_and_grad``: what was not finite, and on which ranks."""
    if seen:
        what = f"the lm loss was {loss:.6g} on rank(s) {_ranks(seen)}"
        if skipped:
            what += f", and the gradient norm {grad_norm:.6g}"
    else:
        # The norm is reduced over the world: no rank's own loss shows where it came from.
        what = (f"the gradient norm was {grad_norm:.6g} (reduced over all {world_size} rank(s); every rank's own "
                f"lm loss was finite)")
    return (f"training diverged at iteration {iteration}: {what} (--check-for-nan-in-loss-and-grad); nothing was "
            f"saved at this iteration; {_FIX}, or --no-check-for-nan-in-loss-and-grad to skip such steps instead, "
            f"within --max-consecutive-skipped-steps")


def non_finite_weights_message(iteration: int, save_dir: str) -> str:
    """The error for a save refused because the weights are not finite."""
    return (f"training diverged at iteration {iteration}: the weights are not finite, so no checkpoint was saved "
            f"to {save_dir} (--save); {_FIX}")
