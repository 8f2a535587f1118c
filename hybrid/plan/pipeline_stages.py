"""Pipeline parallelism in the planner: what each pipeline rank holds, sends and waits for.

A layout with ``pp`` pipeline ranks and ``v`` model chunks per rank splits the
layers as the job would (:meth:`hybrid.plan.candidate.Candidate.stage_split`).
Every pipeline rank is planned on its own -- its parameters are those the
model builds for that stage (:func:`hybrid.plan.model_memory.shard_shapes`
with the split), so its flat buffers, ZeRO partitions and the tied embedding's
group of its own are the optimizer's -- and the layout's figure is its
busiest rank's.

**Activations in flight.** A rank keeps the saved activations of every model
chunk it has run forward for a micro-batch but not yet backward. How many
that is depends on the schedule alone, so the planner replays the rank's own
action list (:func:`hybrid.pipeline.schedule.build`, the list the executor
runs) with each chunk weighted by its bytes (:func:`held_activations`): with
1F1B and ``m`` micro-batches, rank ``r`` of ``p`` holds ``min(m, p - r)``
micro-batches at once (the first rank ``p``), with GPipe all ``m``, with the
interleaved schedule more chunks of fewer layers. The bytes of one chunk for
one micro-batch are its layers' (:mod:`hybrid.plan.activations`), the
embedding's on the first part (token ids, position ids, the embedding
dropout mask), the RoPE tables on every part with layers (each part computes
its own), the final norm and loss on the last part, and -- outside
autograd's saved tensors -- the output every part but the last keeps until
its backward (``p*N*h*r``: the executor backpropagates from it).

**Transfers.** Each forward of a part but the last sends its ``[s, b, h]``
output (``[s/t, b, h]`` under sequence parallelism) to the next part; each
backward of a part but the first sends its input's gradient back
(:func:`transfers`, recorded as ``send/pp`` and ``recv/pp`` like :mod:`hybrid.comm`
records them). Besides, with tied embeddings the first and last ranks add their copies'
gradients in every step (``all_reduce/embed``), and the loss is broadcast
from the last rank (``broadcast/pp``).

**Time.** A rank is idle for the bubble, ``(p - 1) / (v m + p - 1)`` of the
step (:func:`hybrid.pipeline.simulate.bubble_fraction`), so the step takes
its busiest rank's compute divided by ``1 - bubble``. Of its transfers, those
that fill and drain the pipeline wait, and the others overlap compute as far as
the node's link can carry them (:func:`hybrid.plan.timing.pipeline_seconds`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

from hybrid.dtypes import DTYPE_BYTES
from hybrid.pipeline.actions import FORWARD
from hybrid.pipeline.schedule import build
from hybrid.pipeline.simulate import bubble_fraction
from hybrid.pipeline.split import StageSplit
from hybrid.plan.activations import ActivationBytes
from hybrid.plan.candidate import Candidate
from model_zoo.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class StageShare:
    """One pipeline rank's share of a step.

    ``activations``: the rank's saved bytes for one micro-batch through all its chunks (``layers`` = its layers,
    ``embedding`` and ``head`` only where it holds them); ``saved``: the most saved-activation bytes it holds at
    once over the schedule, ``held``: the same with the outputs kept for backward; ``in_flight``: the most
    (micro-batch, chunk) forwards not yet backwarded.
    """

    pp_rank: int
    first: bool
    last: bool
    activations: ActivationBytes
    saved: int
    held: int
    in_flight: int


def activation_element(config: GPTConfig, candidate: Candidate) -> int:
    """Elements of the activation passed between pipeline parts: ``s*b*h``, ``/t`` under sequence parallelism."""
    tokens = config.seq_length * candidate.micro_batch * config.hidden_size
    return tokens // candidate.tp if candidate.sequence_parallel and candidate.tp > 1 else tokens


def part_bytes(act: ActivationBytes, split: StageSplit, part: int) -> int:
    """Saved-activation bytes of pipeline part ``part`` for one micro-batch (``act``: the whole model's)."""
    first, end = split.ranges[part]
    layers = end - first
    tables = act.rope_tables if layers else 0  # every part with layers computes its RoPE tables
    out = layers * act.per_layer + tables
    if part == 0:
        out += act.embedding - act.rope_tables
    if part == split.num_parts - 1:
        out += act.head
    return out


def held_activations(actions: Sequence, weights: Dict[int, int]) -> Tuple[int, int]:
    """``(most bytes, most chunks)`` alive at once when a rank runs ``actions`` in order: a forward of chunk ``c``
    adds ``weights[c]``, its backward frees it."""
    live = count = peak = peak_count = 0
    for a in actions:
        sign = 1 if a.kind == FORWARD else -1
        live += sign * weights[a.chunk]
        count += sign
        peak, peak_count = max(peak, live), max(peak_count, count)
    return peak, peak_count


def stage_share(config: GPTConfig, candidate: Candidate, act: ActivationBytes, micro_batches: int,
                pp_rank: int) -> StageShare:
    """Pipeline rank ``pp_rank``'s :class:`StageShare` of a step of ``micro_batches`` micro-batches."""
    split = candidate.stage_split(config)
    pp, chunks = split.pp, split.chunks
    p = DTYPE_BYTES[candidate.precision]
    output = p * activation_element(config, candidate)
    actions = build(candidate.pipeline_schedule, pp_rank, pp, micro_batches, chunks)
    parts = {c: split.part(pp_rank, c) for c in range(chunks)}
    saved = {c: part_bytes(act, split, k) for c, k in parts.items()}
    kept = {c: saved[c] + (output if k != split.num_parts - 1 else 0) for c, k in parts.items()}
    saved_peak, in_flight = held_activations(actions, saved)
    held_peak, _ = held_activations(actions, kept)
    first, last = split.holds_embedding(pp_rank), split.holds_head(pp_rank)
    tables = act.rope_tables * sum(1 for c in range(chunks) if len(split.layers_of(pp_rank, c)))
    share = dataclasses.replace(act, layers=len(split.layers_of_rank(pp_rank)),
                                embedding=(act.embedding - act.rope_tables if first else 0) + tables,
                                head=act.head if last else 0,
                                by_reference=tables if act.by_reference else 0, rope_tables=tables)
    return StageShare(pp_rank, first, last, share, saved_peak, held_peak, in_flight)


def transfers(config: GPTConfig, candidate: Candidate, micro_batches: int, pp_rank: int) -> Tuple[int, int]:
    """``(calls, bytes each)`` of pipeline rank ``pp_rank``'s sends in one step -- an activation for every forward
    of a part but the last, a gradient for every backward of a part but the first -- and as many receives (an
    input for every forward of a part but the first, a gradient for every backward of a part but the last)."""
    split = candidate.stage_split(config)
    nbytes = DTYPE_BYTES[candidate.precision] * activation_element(config, candidate)
    calls = sum(micro_batches * ((part > 0) + (part + 1 < split.num_parts))
                for part in (split.part(pp_rank, c) for c in range(split.chunks)))
    return calls, nbytes


def p2p_volume(config: GPTConfig, candidate: Candidate, micro_batches: int, pp_rank: int,
               report: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """Add pipeline rank ``pp_rank``'s :func:`transfers` of one step to ``report`` as ``comm_report()`` records
    them: ``send/pp`` (wire bytes = payload, one message each) and ``recv/pp`` (no wire bytes of its own)."""
    calls, nbytes = transfers(config, candidate, micro_batches, pp_rank)
    for op, wire in (("send", 1.0), ("recv", 0.0)):
        if calls:
            entry = report.setdefault(f"{op}/pp", {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0})
            entry["calls"] += calls
            entry["payload_bytes"] += calls * nbytes
            entry["wire_bytes"] += wire * calls * nbytes
    return report


def bubble(candidate: Candidate, micro_batches: int) -> float:
    """The idle fraction of a pipeline rank in one step (0 without a pipeline)."""
    if candidate.pp == 1:
        return 0.0
    return bubble_fraction(candidate.pp, micro_batches, candidate.virtual_stages)


def stage_layers(config: GPTConfig, candidate: Candidate) -> List[int]:
    """Layers each pipeline rank holds over all its chunks."""
    split = candidate.stage_split(config)
    return [len(split.layers_of_rank(r)) for r in range(split.pp)]
