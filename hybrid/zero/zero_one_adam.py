"""0/1 Adam (``optimizer.type = zero_one_adam``) at ZeRO stage 0: 1-bit exchanges, adaptive variance freezing
and local steps.

Every rank holds the whole model and optimizer state (stage 0). Step ``n`` (1, 2, ...) is one of:

* **variance step** (``n <= var_freeze_step`` and ``n`` a multiple of ``var_interval``): the gradients are
  all-reduced exactly and update both moments, ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``.
  ``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` variance steps.
* **compressed step** (the other steps up to ``var_freeze_step``): the gradients are not reduced; their mean
  over ``dp`` travels as 1-bit signs with error feedback
  (:class:`~hybrid.zero.onebit.CompressedAverage`) and updates the momentum only.
* **local step** (``n > var_freeze_step``, the variance frozen): no communication. Each rank folds its own
  gradient into its momentum and steps its own weights. Every ``local_interval`` steps (starting at 1,
  doubling every ``local_step_scaler`` steps, at most ``local_step_clipper``) the ranks synchronize: each
  takes its weights' change since the last sync (its ``anchor``, the synchronized weights), scales it by
  ``sqrt(v) + eps`` (momentum units), and the 1-bit mean of that over ``dp``, scaled back, is applied to
  the anchor instead; the momentum becomes ``-mean / (the learning rates summed since the last sync)``.
  After a sync every rank holds the same weights (bit for bit: the same anchor plus the same mean) and
  momentum; between syncs they differ.

Every step updates ``p <- p - lr * (m / (sqrt(v) + eps) + wd * p)``, without bias correction, as DeepSpeed's
ZeroOneAdam does. The schedule is counters only, the same on every rank, so every rank communicates in the
same steps. Memory beyond Adam's: the error buffers of the exchange and, after ``var_freeze_step``, the
anchor (fp32, the whole buffer).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from hybrid.comm import Communicator
from hybrid.zero.assembled import AssembledTensor, assembled_or_copy
from hybrid.zero.flat_buffer import FlatGroup
from hybrid.zero.inner import InnerOptimizer
from hybrid.zero.onebit import CompressedAverage

ANCHOR_KEY = "zero_one_anchor"  # the weights of the last sync


@dataclasses.dataclass
class ZeroOneSchedule:
    """Which kind each step is (the module docstring); the counters are checkpointed."""

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    var_interval: int = 1
    var_counter: int = 0
    local_interval: int = 1
    local_counter: int = 0
    lr_sum: float = 0.0  # learning rates of the local steps since the last sync

    def variance_step(self, n: int) -> bool:
        return n <= self.var_freeze_step and n % self.var_interval == 0

    def local(self, n: int) -> bool:
        return n > self.var_freeze_step

    def syncs(self, n: int) -> bool:
        return self.local(n) and n % self.local_interval == 0

    def advance(self, n: int) -> None:
        """After step ``n``: double the intervals whose counts are reached."""
        if self.variance_step(n):
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter, self.var_interval = 0, self.var_interval * 2
        elif self.local(n):
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)


class ZeroOneAdam:
    """0/1 Adam over ``groups`` (stage 0: whole flat buffers, one part), stepping ``inner``'s masters and moments.

    Collectives use the ``dp`` axis of ``comm``. ``tp`` is (tp size, tp rank), which tags saved errors.
    """

    def __init__(self, groups: List[FlatGroup], inner: InnerOptimizer, comm: Communicator, dp_rank: int,
                 dp_size: int, schedule: ZeroOneSchedule, block: int, tp: tuple = (1, 0)):
        if any(g.parts != 1 for g in groups):
            raise ValueError("0/1 Adam steps whole buffers on every rank: ZeRO stage 0 only")
        self.groups, self.inner, self.dp = groups, inner, dp_size
        self.schedule = schedule
        self.channel = CompressedAverage(groups, comm, dp_size, block, [dp_size, dp_rank, *tp])
        self.anchor: Optional[List[List[torch.Tensor]]] = None  # per segment, fp32; after var_freeze_step

    @property
    def next_step(self) -> int:
        return self.inner.step_count + 1

    def reduces_gradients(self) -> bool:
        """Whether the next step's gradients are all-reduced exactly (a variance step)."""
        return self.schedule.variance_step(self.next_step)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self, grads: List[torch.Tensor], factor: float) -> None:
        """Step ``n``: ``grads[g]`` is group ``g``'s whole gradient [numel], DP-summed on a variance step and
        this rank's own otherwise; ``factor`` turns it into the gradient of the global batch (variance step)
        or of this rank's share."""
        n, sched, inner = self.next_step, self.schedule, self.inner
        beta1, beta2 = inner.betas
        segs = [[g_buf[seg.start: seg.start + seg.size] for seg in group.segments]
                for g_buf, group in zip(grads, self.groups)]
        if sched.local(n) and self.anchor is None:
            self._start_local_phase()
        for gi, (state, g_chunks) in enumerate(zip(inner.groups, segs)):
            m, v = state.views["exp_avg"], state.views["exp_avg_sq"]
            g = [c.float() * factor for c in g_chunks]
            if sched.variance_step(n):
                torch._foreach_mul_(v, beta2)
                torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
            elif not sched.local(n):
                g = self._compressed_mean(gi, g)
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, g, alpha=1.0 - beta1)
            self._apply(state)
        if sched.local(n):
            sched.lr_sum += inner.lr
            if sched.syncs(n):
                self._sync()
        inner.step_count += 1
        sched.advance(n)

    def _denominators(self, state) -> List[torch.Tensor]:
        denom = torch._foreach_sqrt(state.views["exp_avg_sq"])
        torch._foreach_add_(denom, self.inner.eps)
        return denom

    def _apply(self, state) -> None:
        """``p <- p - lr (m / (sqrt(v) + eps) + wd p)``."""
        update = torch._foreach_div(state.views["exp_avg"], self._denominators(state))
        if state.weight_decay:
            torch._foreach_add_(update, state.masters, alpha=state.weight_decay)
        torch._foreach_add_(state.masters, update, alpha=-self.inner.lr)
        if state.lowp is not None:
            torch._foreach_copy_(state.lowp, state.masters)

    def _compressed_mean(self, gi: int, values: List[torch.Tensor]) -> List[torch.Tensor]:
        """The 1-bit mean over ``dp`` of group ``gi``'s per-segment ``values`` (fp32), as new tensors."""
        means: List[Optional[torch.Tensor]] = [None] * len(values)

        def inputs(g: int, s: int, u: torch.Tensor) -> None:
            u[: values[s].numel()].copy_(values[s])

        def outputs(g: int, s: int, gathered: torch.Tensor, mean: torch.Tensor) -> None:
            means[s] = mean[: values[s].numel()].clone()
        self.channel.run(inputs, outputs, only=gi)
        return means

    def _start_local_phase(self) -> None:
        """The first step after ``var_freeze_step``: the errors held gradients, from now on weight changes."""
        self.channel.allocate()
        self.channel.clear()
        self.anchor = [[m.detach().clone() for m in state.masters] for state in self.inner.groups]

    def _sync(self) -> None:
        """Replace every rank's weight change since the last sync by the 1-bit mean of all (module docstring)."""
        sched = self.schedule
        for gi, (state, anchor) in enumerate(zip(self.inner.groups, self.anchor)):
            denom = self._denominators(state)
            change = torch._foreach_sub(state.masters, anchor)  # the sum of -lr * update since the last sync
            torch._foreach_mul_(change, denom)  # momentum units
            mean = self._compressed_mean(gi, change)
            m = state.views["exp_avg"]
            torch._foreach_copy_(m, mean)
            torch._foreach_div_(m, -sched.lr_sum)
            torch._foreach_addcdiv_(anchor, mean, denom)
            torch._foreach_copy_(state.masters, anchor)
            if state.lowp is not None:
                torch._foreach_copy_(state.lowp, state.masters)
        sched.lr_sum = 0.0

    # ---- state and memory ------------------------------------------------------------------------------
    def state(self, gi: int, lazy: bool = False) -> dict:
        out = dict(self.channel.state(gi, lazy))
        if self.anchor is not None:
            out[ANCHOR_KEY] = assembled_or_copy(AssembledTensor.concat(self.anchor[gi]), lazy)
        return out

    def state_header(self) -> dict:
        return self.schedule.state_dict()

    def load(self, header: Optional[dict], saved_groups: List[dict]) -> Optional[str]:
        """Restore the schedule, the anchor and the errors; returns what restarts (None: nothing)."""
        if header:
            for key, value in header.items():
                setattr(self.schedule, key, value)
        self.anchor = None
        if not self.schedule.local(self.next_step):
            self.channel.worker_error = self.channel.server_error = None
            return None if self.inner.step_count == 0 else self.channel.load(saved_groups)
        self._start_local_phase()  # the anchor: the loaded weights, unless the checkpoint has this rank's own
        # saved beside this rank's errors (their layout tag says whose they are)
        restored = self.channel.foreign(saved_groups) is None and all(
            ANCHOR_KEY in g and g[ANCHOR_KEY].numel() == sum(a.numel() for a in anchor)
            for g, anchor in zip(saved_groups, self.anchor))
        if restored:
            for anchor, saved in zip(self.anchor, saved_groups):
                torch._foreach_copy_(anchor, list(torch.split(saved[ANCHOR_KEY].to(anchor[0].device),
                                                              [a.numel() for a in anchor])))
        else:
            self.schedule.lr_sum = 0.0  # the local steps since the last sync are not in these weights' anchor
        why = self.channel.load(saved_groups)
        if not restored:
            return "the checkpoint has no 0/1 Adam anchor for this layout; local steps restart from the loaded weights"
        return why

    def bytes_held(self) -> dict:
        anchor = 0 if self.anchor is None else sum(t.numel() * t.element_size() for g in self.anchor for t in g)
        return {"error_feedback": self.channel.bytes_held(), "local_anchor": anchor}
