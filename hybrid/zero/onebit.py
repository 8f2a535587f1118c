"""1-bit compressed Adam (``optimizer.type = onebit_adam``) over the flat groups of ZeRO stages 0-2.

Two phases, told apart by the inner optimizer's update count ``t``:

* **warm-up** (``t < optimizer.freeze_step``): plain AdamW. Gradients are
  reduced over ``dp`` as the stage and the ``zero`` settings say.
* **compressed** (``t >= freeze_step``): the variance ``v`` is frozen and the
  gradients are no longer reduced. Each rank folds its own gradient into the
  momentum and the *momentum* is averaged over ``dp`` as 1-bit signs with one
  fp32 scale (the mean magnitude) per block, with error feedback on both
  sides of the exchange:

  For each bucket (segment) of ``size`` elements, cut into ``dp`` rows of
  ``k = ceil(size / dp)`` (zero-padded; at stages 1-2 row ``j`` is exactly DP
  rank ``j``'s partition chunk)::

      u_i  = b1 * m + (1 - b1) * f * g_i + e_i       worker i; e_i [dp*k] its error
      e_i <- u_i - C(u_i)                              C: 1-bit pack then unpack
      row j of C(u_i) goes to rank j                   all_to_all over dp
      s_j  = mean_i C(u_i)[j] + E_j                    server j; E_j [k] its error
      E_j <- s_j - C(s_j)
      m    = concat_j C(s_j)                           all-gather over dp: the same m on every rank

  then ``p <- p * (1 - lr * wd) - lr * (m / bc1) / (sqrt(v / bc2) + eps)``
  with ``bc1 = 1 - b1^t`` and ``bc2 = 1 - b2^freeze_step`` (frozen with ``v``); both
  1 with ``optimizer.bias_correction: false`` (DeepSpeed's OneBitAdam, which never corrects).
  ``f`` is the loss unscale times the clip coefficient.

Because ``m`` is identical on every rank, stage 0 needs no further exchange.
Stages 1-2 still all-gather the updated parameter partitions, as always (and
stage 2 keeps the whole local gradient, as under ``zero.reduce_once``). The
rank keeps ``m`` whole in its packed form (1 bit + 4/block bytes per element),
plus its worker error (4 bytes per element) and server error (4 per
partition element): that is the memory cost.

Gradient clipping in the compressed phase uses the root mean square over
ranks of the local gradient norms, an upper bound of the norm of their
average (there is no reduced gradient to measure), so it clips at least as
much as the same step in warm-up would. Overflow (inf/NaN anywhere) still
skips the step on every rank.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch

from hybrid.compression import ONEBIT_BITS
from hybrid.comm import Communicator
from hybrid.kernels import quantize as codec
from hybrid.zero.assembled import AssembledTensor, assembled_or_copy
from hybrid.zero.flat_buffer import FlatGroup
from hybrid.zero.inner import InnerOptimizer

ERROR_KEYS = ("onebit_worker_error", "onebit_server_error")
LAYOUT_KEY = "onebit_layout"  # [dp size, dp rank, tp size, tp rank] of the rank that saved the errors


def compress_with_feedback(x: torch.Tensor, error: torch.Tensor, block: int) -> torch.Tensor:
    """Pack ``x + error`` to 1-bit rows and keep what the packing lost in ``error``.

    ``x``: fp32 [rows, k], overwritten with ``x + error``; ``error``: fp32, ``rows * k`` elements, becomes
    ``(x + error) - C(x + error)``. Returns the packed rows, uint8 [rows, W]. Summed over steps, what is
    sent equals what was meant to be sent minus the last ``error``: the error feeds back, never accumulates.
    """
    rows, k = x.shape
    flat = x.view(-1)
    flat.add_(error.view(-1))
    wire = codec.pack(x, ONEBIT_BITS, block)
    torch.sub(flat, codec.unpack(wire, k, ONEBIT_BITS, block).view(-1), out=error.view(-1))
    return wire


class CompressedAverage:
    """The mean over ``dp`` of one fp32 value per element of every bucket of ``groups``, sent as 1-bit signs.

    Per bucket (segment) of ``size`` elements, cut into ``dp`` rows of ``k = ceil(size / dp)``: each rank
    packs its input with its worker error (:func:`compress_with_feedback`) and sends row ``j`` to rank ``j``
    (one all-to-all over ``dp``); rank ``j`` averages the rows it received, packs that with its server error
    and all-gathers it, so every rank decodes the same mean. ``layout`` ([dp size, dp rank, tp size, tp
    rank]) tags the errors a checkpoint saves: they belong to one rank of one layout.
    """

    def __init__(self, groups: List[FlatGroup], comm: Communicator, dp_size: int, block: int, layout: List[int]):
        self.groups, self.comm, self.dp, self.block, self.layout = groups, comm, dp_size, block, list(layout)
        self.rows = [[-(-seg.size // dp_size) for seg in g.segments] for g in groups]  # k per segment
        # allocated on first use (a warm-up needs none of them)
        self.worker_error: Optional[List[List[torch.Tensor]]] = None  # [dp*k] fp32 per segment
        self.server_error: Optional[List[List[torch.Tensor]]] = None  # [k] fp32 per segment

    def allocate(self) -> None:
        if self.worker_error is not None:
            return
        self.worker_error = [[torch.zeros(self.dp * k, dtype=torch.float32, device=g.device) for k in ks]
                             for g, ks in zip(self.groups, self.rows)]
        self.server_error = [[torch.zeros(k, dtype=torch.float32, device=g.device) for k in ks]
                             for g, ks in zip(self.groups, self.rows)]

    def clear(self) -> None:
        """Zero both errors (what they hold was lost from another quantity than the next inputs)."""
        for bufs in (self.worker_error or [], self.server_error or []):
            for g in bufs:
                torch._foreach_zero_(g)

    def run(self, inputs: Callable[[int, int, torch.Tensor], None],
            outputs: Callable[[int, int, Optional[torch.Tensor], torch.Tensor], None],
            only: Optional[int] = None) -> None:
        """Average every bucket (of group ``only``, when given) over ``dp``.

        ``inputs(g, s, u)`` writes this rank's values of segment ``s`` of group ``g`` into ``u[:size]``
        (fp32 [dp*k], zeros beyond). ``outputs(g, s, gathered, mean)`` receives every rank's packed row
        (uint8 [dp, W]) and their decoded mean (fp32 [dp*k]; the same on every rank). All all-to-alls are
        launched before the first server step, then all all-gathers. With one rank nothing is compressed:
        ``outputs`` gets ``u`` itself and ``gathered`` None.
        """
        keys = [(gi, s) for gi, g in enumerate(self.groups) for s in range(len(g.segments))
                if only is None or gi == only]
        if self.dp == 1:
            for gi, s in keys:
                u = torch.zeros(self.rows[gi][s], dtype=torch.float32, device=self.groups[gi].device)
                inputs(gi, s, u)
                outputs(gi, s, None, u)
            return
        self.allocate()
        sent = {}
        for gi, s in keys:
            k = self.rows[gi][s]
            u = torch.zeros(self.dp * k, dtype=torch.float32, device=self.groups[gi].device)
            inputs(gi, s, u)
            wire = compress_with_feedback(u.view(self.dp, k), self.worker_error[gi][s], self.block)
            received = torch.empty_like(wire)
            sent[(gi, s)] = (received, self.comm.all_to_all_single(received, wire, "dp", async_op=True))
        gathers = {}
        for gi, s in keys:
            received, handle = sent[(gi, s)]
            handle.wait()
            k = self.rows[gi][s]
            mean = codec.unpack_sum(received, k, ONEBIT_BITS, self.block).div_(self.dp)
            mine = compress_with_feedback(mean.view(1, k), self.server_error[gi][s], self.block)
            gathered = torch.empty(self.dp, mine.shape[1], dtype=torch.uint8, device=mine.device)
            gathers[(gi, s)] = (gathered, self.comm.all_gather_into_tensor(gathered.view(-1), mine.view(-1), "dp",
                                                                          async_op=True))
        for gi, s in keys:
            gathered, handle = gathers[(gi, s)]
            handle.wait()
            outputs(gi, s, gathered, codec.unpack(gathered, self.rows[gi][s], ONEBIT_BITS, self.block).view(-1))

    def state(self, gi: int, lazy: bool = False) -> dict:
        """Group ``gi``'s error buffers for a checkpoint (empty before the first use); ``lazy``: as
        :class:`~hybrid.zero.assembled.AssembledTensor` of the live buffers instead of copies."""
        if self.worker_error is None:
            return {}
        return {ERROR_KEYS[0]: assembled_or_copy(AssembledTensor.concat(self.worker_error[gi]), lazy),
                ERROR_KEYS[1]: assembled_or_copy(AssembledTensor.concat(self.server_error[gi]), lazy),
                LAYOUT_KEY: list(self.layout)}

    def load(self, saved_groups: List[dict]) -> Optional[str]:
        """Restore the errors saved by this rank under this layout; returns why they restart at zero, or None."""
        self.worker_error = self.server_error = None
        self.allocate()
        why = self.foreign(saved_groups)
        if why is not None:
            return why
        for gi, saved in enumerate(saved_groups):
            for key, bufs in zip(ERROR_KEYS, (self.worker_error[gi], self.server_error[gi])):
                torch._foreach_copy_(bufs, list(torch.split(saved[key].to(bufs[0].device),
                                                            [b.numel() for b in bufs])))
        return None

    def foreign(self, saved_groups: List[dict]) -> Optional[str]:
        """Why the per-rank state in ``saved_groups`` is not this rank's under this layout (None when it is):
        checked for every group before anything is restored, so nothing is restored in part."""
        for gi, saved in enumerate(saved_groups):
            if not all(key in saved for key in ERROR_KEYS):
                return ("the checkpoint has no error-feedback buffers (written before compression started, or "
                        "resharded to another layout); they restart at zero")
            if list(saved.get(LAYOUT_KEY, ())) != self.layout:
                return (f"the checkpoint's error buffers belong to rank {saved.get(LAYOUT_KEY)} ([dp size, dp "
                        f"rank, tp size, tp rank]), not {self.layout}; they restart at zero")
            for key, bufs in zip(ERROR_KEYS, (self.worker_error[gi], self.server_error[gi])):
                if saved[key].numel() != sum(b.numel() for b in bufs):
                    return (f"the checkpoint's {key} has {saved[key].numel()} elements, this layout "
                            f"{sum(b.numel() for b in bufs)}; the error feedback restarts at zero")
        return None

    def bytes_held(self) -> int:
        if self.worker_error is None:
            return 0
        return sum(t.numel() * t.element_size() for bufs in (self.worker_error, self.server_error)
                   for g in bufs for t in g)


class OneBitAdam:
    """The compressed phase of 1-bit Adam for ``groups`` (whole flat buffers on every rank).

    ``inner`` is the AdamW that runs the warm-up and owns ``exp_avg`` /
    ``exp_avg_sq`` (this rank's partition: whole segments when ``parts == 1``).
    Collectives use the ``dp`` axis of ``comm``.
    """

    def __init__(self, groups: List[FlatGroup], inner: InnerOptimizer, comm: Communicator, dp_rank: int,
                 dp_size: int, part: int, freeze_step: int, block: int, tp: tuple = (1, 0)):
        if inner.kind != "adamw":
            raise ValueError(f"1-bit Adam runs on an AdamW inner optimizer, got {inner.kind!r}")
        self.groups, self.inner, self.comm = groups, inner, comm
        self.dp, self.part, self.freeze_step, self.block = dp_size, part, freeze_step, block
        self.channel = CompressedAverage(groups, comm, dp_size, block, [dp_size, dp_rank, *tp])
        # the packed momentum every rank received, [dp, W] uint8 per segment; None until the first exchange
        # (and after a load): the momentum is then gathered once from the exp_avg partitions
        self.wires: List[List[Optional[torch.Tensor]]] = [[None] * len(g.segments) for g in groups]

    @property
    def compressing(self) -> bool:
        """Whether the next update is a compressed one (the warm-up's ``freeze_step`` updates are done)."""
        return self.inner.step_count >= self.freeze_step

    # ---- the exchange ----------------------------------------------------------------------------
    def _previous_momentum(self, gi: int, s: int) -> torch.Tensor:
        """The momentum of segment ``s`` of group ``gi`` after the last update, fp32 [size], whole."""
        group, seg, k = self.groups[gi], self.groups[gi].segments[s], self.channel.rows[gi][s]
        wire = self.wires[gi][s]
        if wire is not None:
            return codec.unpack(wire, k, ONEBIT_BITS, self.block).view(-1)[: seg.size]
        mine = self.inner.groups[gi].views["exp_avg"][s]
        if group.parts == 1:
            return mine
        whole = torch.empty(seg.size, dtype=torch.float32, device=mine.device)
        self.comm.all_gather_into_tensor(whole, mine, "dp")  # once per phase start or load
        return whole

    def exchange(self, grads: List[torch.Tensor], factor: float) -> None:
        """Average the momentum over ``dp`` (see the module docstring) into every ``exp_avg`` partition.

        ``grads[g]``: group ``g``'s whole local gradient [numel] (micro-steps summed, loss-scaled);
        ``factor`` turns it into the gradient of this rank's batch share (unscale times clip).
        """
        beta1 = self.inner.betas[0]

        def inputs(gi: int, s: int, u: torch.Tensor) -> None:
            seg = self.groups[gi].segments[s]
            body = u[: seg.size]
            body.copy_(grads[gi][seg.start: seg.start + seg.size])
            body.mul_((1.0 - beta1) * factor).add_(self._previous_momentum(gi, s), alpha=beta1)

        def outputs(gi: int, s: int, gathered: torch.Tensor, mean: torch.Tensor) -> None:
            self.wires[gi][s] = gathered
            group, seg = self.groups[gi], self.groups[gi].segments[s]
            lo, hi = seg.chunk_range(self.part, group.parts)
            self.inner.groups[gi].views["exp_avg"][s].copy_(mean[lo - seg.start: hi - seg.start])
        self.channel.run(inputs, outputs)

    # ---- the update --------------------------------------------------------------------------------
    def update(self) -> None:
        """One frozen-variance AdamW update of every group's masters from the exchanged momentum."""
        inner = self.inner
        inner.step_count += 1
        beta1, beta2 = inner.betas
        corrects = inner.bias_correction  # the warm-up's AdamW (the inner step) follows the same switch
        bc1 = 1.0 - beta1 ** inner.step_count if corrects else 1.0
        root_bc2 = math.sqrt(1.0 - beta2 ** self.freeze_step) if corrects else 1.0
        for group in inner.groups:
            masters, m, v = group.masters, group.views["exp_avg"], group.views["exp_avg_sq"]
            if group.weight_decay:
                torch._foreach_mul_(masters, 1.0 - inner.lr * group.weight_decay)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, root_bc2)
            torch._foreach_add_(denom, inner.eps)
            torch._foreach_addcdiv_(masters, m, denom, value=-inner.lr / bc1)
            if group.lowp is not None:
                torch._foreach_copy_(group.lowp, masters)

    # ---- state and memory --------------------------------------------------------------------------
    def state(self, gi: int, lazy: bool = False) -> dict:
        """Group ``gi``'s error-feedback buffers for a checkpoint (empty during the warm-up)."""
        return self.channel.state(gi, lazy)

    def load(self, saved_groups: List[dict]) -> Optional[str]:
        """Restore the error buffers saved under this layout; returns why they restart at zero, or None.

        The packed momentum is not saved: the next exchange gathers it from the
        ``exp_avg`` partitions, which hold exactly its decoded values.
        """
        self.wires = [[None] * len(g.segments) for g in self.groups]
        if not self.compressing:
            self.channel.worker_error = self.channel.server_error = None
            return None
        return self.channel.load(saved_groups)

    def bytes_held(self) -> dict:
        """``error_feedback`` (worker and server errors) and ``compressed_momentum`` (the packed ``m``)."""
        wires = sum(w.numel() for g in self.wires for w in g if w is not None)
        return {"error_feedback": self.channel.bytes_held(), "compressed_momentum": wires}
