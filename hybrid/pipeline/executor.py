"""Run one pipeline step: a schedule's forwards and backwards, and the transfers between stages.

Each pipeline rank holds ``v`` model chunks (parts ``pp_rank + c * pp`` of the
model, :mod:`hybrid.pipeline.split`). For every
:class:`~hybrid.pipeline.schedule.Action` of its schedule it

* **forward** of micro-batch ``i`` on chunk ``c``: receives the input
  activation from the previous part (unless this is the first part), runs the
  chunk (:meth:`StageCompute.forward <hybrid.pipeline.stage_compute.StageCompute.forward>`),
  and sends the output to the next part (unless this is the last part,
  whose output is the micro-batch's loss);
* **backward**: backpropagates the loss (last part) or the received output
  gradient (:meth:`StageCompute.backward <hybrid.pipeline.stage_compute.StageCompute.backward>`),
  and sends the input's gradient to the previous part.

The :class:`~hybrid.pipeline.stage_compute.StageCompute` is the caller's (the
engine's :class:`~hybrid.engine.stage.EngineStage`): the executor decides
when and with what, the stage computes.

Transfers go over the ``"pp"`` axis of the communicator as point-to-point
messages of a shape known on both sides (the caller's ``activation_shape``):
sends are asynchronous, and on gloo each receive is posted two receives ahead
of its use (:class:`ReceiveQueue`), so the data has usually arrived by the
time the action needs it. Waiting on a receive is bounded by the communicator's
timeout, so a mismatched schedule (a stage with another micro-batch count)
ends in a :class:`~hybrid.comm.CollectiveError` naming the transfer, not in a
hang.
Activations and gradients travel with different tags, which keeps their
streams apart on gloo where one pair of ranks carries both (interleaving at
pp=2). NCCL ignores tags and matches a pair's messages in posting order
alone; every schedule posts them in the same order on both sides, which
:func:`~hybrid.pipeline.simulate.simulate` checks for the combined stream.

With ``pp == 1`` there are no transfers and the step is plain gradient
accumulation over the micro-batches, in the same order.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hybrid.config.errors import ConfigError
from hybrid.pipeline import schedule as schedules
from hybrid.pipeline.actions import BACKWARD, FORWARD, Action
from hybrid.pipeline.stage_compute import StageCompute
from hybrid.topology import Topology

ACTIVATION_TAG = 1
GRADIENT_TAG = 2


@dataclasses.dataclass
class StepStats:
    """What one :meth:`PipelineExecutor.step` measured on this rank."""

    losses: List[float]            # per micro-batch, on the rank holding the last part (else empty)
    step_s: float = 0.0            # wall time of the whole step
    wait_s: float = 0.0            # time blocked in receives (the bubble, plus any transfer time)
    max_in_flight: int = 0         # most micro-batch chunks forwarded and not yet backwarded
    # per action, in schedule order: its wall time less its wait (compute, posting transfers); replayed by
    # hybrid.pipeline.simulate(durations=...), it gives the idle time these very durations imply
    action_s: List[float] = dataclasses.field(default_factory=list)


# Backends whose point-to-point transfers progress independently of each other, so a receive can be posted
# ahead of its use. On NCCL a pair's transfers run in posting order on one stream: a receive posted early
# would hold up the sends posted after it (Megatron pairs them in one batched call instead).
_RECEIVE_AHEAD_BACKENDS = ("gloo",)
# Two, not one: in the interleaved schedule's steady state a rank can need two receives (a forward's input
# and a backward's gradient) between two of its computations. Measured (benchmarks/pipeline_bubble.py, at the
# time with stages of unequal work), interleaved's worst idle at 4-16 micro-batches was 1.42-2.18x the formula
# with one ahead, 1.18-1.81x with two, and no lower with four.
RECEIVES_AHEAD = 2


class ReceiveQueue:
    """This rank's receives of one step, in the order its actions consume them, each posted up to ``ahead``
    receives before its use (one extra activation-sized buffer each).

    Without it a receive is posted when the action needs the tensor, and on gloo the sender's data only starts
    to move once the receiver has posted (the sender waits for the receiver's ready message): in 1F1B's steady
    state, where each stage's next action needs the other's last output, every transfer then costs both stages
    two thread wake-ups and the copy (measured: 1F1B's idle 1.5-1.8x the formula at 8-16 micro-batches). Posted
    ahead, the transfer runs while this rank computes; the schedule's order of receives, which the peers'
    sends follow, is unchanged.
    """

    def __init__(self, executor: "PipelineExecutor", receives: List[Tuple[int, int, torch.Size]], ahead: int):
        self._executor = executor
        self._todo = collections.deque(receives)   # (source part, tag, shape), in consumption order
        self._posted = collections.deque()         # (source part, tag, buffer, handle), oldest first
        self._ahead = ahead
        self._top_up()

    def _top_up(self) -> None:
        while self._todo and len(self._posted) < self._ahead:
            self._post()

    @property
    def handles(self) -> list:
        return [handle for *_, handle in self._posted]

    def _post(self) -> None:
        part, tag, shape = self._todo.popleft()
        comm, ex = self._executor.topology.comm, self._executor
        buf = torch.empty(shape, dtype=ex.activation_dtype, device=ex.topology.device)
        handle = comm.recv(buf, "pp", ex.rank_of_part(part), async_op=True, tag=tag)
        self._posted.append((part, tag, buf, handle))

    def take(self, part: int, tag: int, stats: StepStats) -> torch.Tensor:
        """The next receive, which must be from ``part`` with ``tag``; waits for it (the time is ``stats.wait_s``)."""
        if not self._posted:
            self._post()
        got_part, got_tag, buf, handle = self._posted.popleft()
        if (got_part, got_tag) != (part, tag):  # the schedule and the action list disagree: a bug, not bad input
            raise RuntimeError(f"pipeline receive out of order: expected part {part} tag {tag}, "
                               f"posted part {got_part} tag {got_tag}")
        self._top_up()
        begin = time.perf_counter()
        handle.wait()
        stats.wait_s += time.perf_counter() - begin
        return buf


class PipelineExecutor:
    """Runs ``schedule`` over this rank's ``chunks`` (``v`` of them, chunk ``c`` = part ``pp_rank + c * pp``;
    whatever the :class:`~hybrid.pipeline.stage_compute.StageCompute` of :meth:`step` takes: modules, or
    indices into one model).

    ``activation_shape(microbatch)`` gives the ``torch.Size`` of the tensor passed between parts for that
    micro-batch (for the GPT models ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism), and
    ``activation_dtype`` its dtype; both sides of a transfer compute them the same way.
    """

    def __init__(self, topology: Topology, chunks: Sequence[Any], schedule: str = "1f1b",
                 *, activation_shape: Callable[[Any], torch.Size], activation_dtype: torch.dtype):
        self.topology = topology
        self.chunks = list(chunks)
        self.schedule = schedule
        self.pp = topology.pp_size
        self.pp_rank = topology.pp_rank
        self.num_parts = self.pp * len(self.chunks)
        self.activation_shape = activation_shape
        self.activation_dtype = activation_dtype
        if len(self.chunks) > 1 and self.pp == 1:
            raise ConfigError("virtual pipeline stages need pipeline_model_parallel_size > 1")

    def check_microbatches(self, microbatches: int) -> None:
        """Refuse, before the first step, a micro-batch count per step that this schedule cannot run (a batch
        ramp-up takes several)."""
        schedules.build(self.schedule, self.pp_rank, self.pp, microbatches, len(self.chunks))

    def part(self, chunk: int) -> int:
        return chunk * self.pp + self.pp_rank

    def step(self, microbatches: Sequence[Any], stage: StageCompute, train: bool = True) -> StepStats:
        """Forward (and, when ``train``, backward) every micro-batch through the pipeline.

        ``stage.forward(chunk, part, hidden, microbatch)`` runs one part, ``stage.backward(output, grad,
        chunk)`` backpropagates one part of model chunk ``chunk``: the last part's loss with ``grad=None`` (the
        engine scales it by the loss scale and the micro-batch count there), any other part's output with the
        gradient received from the next part. Gradients accumulate in the parameters as in plain gradient
        accumulation.
        """
        m, v = len(microbatches), len(self.chunks)
        if train:
            actions = schedules.build(self.schedule, self.pp_rank, self.pp, m, v)
        else:
            actions = schedules.forward_only(self.pp_rank, self.pp, m, v)
        stats = StepStats(losses=[])
        receives = ReceiveQueue(self, self._receives(actions, microbatches), self._receive_ahead())
        losses: Dict[int, float] = {}
        inputs: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}
        outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        pending = []
        start = time.perf_counter()
        try:
            for action in actions:
                begin, waited = time.perf_counter(), stats.wait_s
                if action.kind == FORWARD:
                    self._forward(action, microbatches, stage, train, inputs, outputs, losses, pending,
                                  receives, stats)
                    stats.max_in_flight = max(stats.max_in_flight, len(outputs))
                else:
                    self._backward(action, stage, inputs, outputs, pending, receives, stats)
                stats.action_s.append(time.perf_counter() - begin - (stats.wait_s - waited))
            for handle in pending:
                handle.wait()
        except BaseException:
            # The step is lost (the job ends on this error): leave the sends no peer will complete.
            self.topology.comm.abandon(pending + receives.handles)
            raise
        stats.step_s = time.perf_counter() - start
        stats.losses = [losses[i] for i in sorted(losses)]
        return stats

    # ---- one action ---------------------------------------------------------------------------
    def _forward(self, action: Action, microbatches, stage: StageCompute, train, inputs, outputs, losses, pending,
                 receives: ReceiveQueue, stats) -> None:
        mb, k = action.microbatch, self.part(action.chunk)
        x = None
        if k > 0:
            x = receives.take(k - 1, ACTIVATION_TAG, stats)
            x.requires_grad_(train)
        with torch.set_grad_enabled(train):
            y = stage.forward(self.chunks[action.chunk], k, x, microbatches[mb])
        if k == self.num_parts - 1:
            losses[mb] = float(y.detach())
        else:
            expected = self.activation_shape(microbatches[mb])
            if tuple(y.shape) != tuple(expected) or y.dtype != self.activation_dtype:
                raise RuntimeError(f"pipeline part {k} produced {y.dtype} {tuple(y.shape)} for micro-batch {mb} but "
                                   f"the next part expects {self.activation_dtype} {tuple(expected)}")
            pending.append(self._send(y.detach(), k + 1, ACTIVATION_TAG))
        if train:
            inputs[(mb, action.chunk)] = x
            outputs[(mb, action.chunk)] = y

    def _backward(self, action: Action, stage: StageCompute, inputs, outputs, pending, receives: ReceiveQueue,
                  stats) -> None:
        mb, k = action.microbatch, self.part(action.chunk)
        x, y = inputs.pop((mb, action.chunk)), outputs.pop((mb, action.chunk))
        if k == self.num_parts - 1:
            stage.backward(y, None, action.chunk)
        else:
            stage.backward(y, receives.take(k + 1, GRADIENT_TAG, stats), action.chunk)
        if k > 0:
            pending.append(self._send(x.grad, k - 1, GRADIENT_TAG))

    # ---- transfers ----------------------------------------------------------------------------
    def rank_of_part(self, part: int) -> int:
        return part % self.pp

    def _receives(self, actions: Sequence[Action], microbatches) -> List[Tuple[int, int, torch.Size]]:
        """(source part, tag, shape) of every receive ``actions`` make, in order: a forward's input activation
        from the previous part, a backward's output gradient from the next (the output's shape, which forward
        checks is the activation shape)."""
        out = []
        for action in actions:
            k, shape = self.part(action.chunk), self.activation_shape(microbatches[action.microbatch])
            if action.kind == FORWARD and k > 0:
                out.append((k - 1, ACTIVATION_TAG, shape))
            elif action.kind == BACKWARD and k < self.num_parts - 1:
                out.append((k + 1, GRADIENT_TAG, shape))
        return out

    def _receive_ahead(self) -> int:
        return RECEIVES_AHEAD if self.topology.comm.backend("pp") in _RECEIVE_AHEAD_BACKENDS else 0

    def _send(self, tensor: torch.Tensor, part: int, tag: int):
        # the communicator counts the bytes (comm_report)
        return self.topology.comm.send(tensor.contiguous(), "pp", self.rank_of_part(part), async_op=True, tag=tag)
