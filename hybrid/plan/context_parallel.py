"""Context parallelism in the planner: the sequence split over ``cp`` ranks, the ring's key/value traffic and
whether it hides behind the attention (``docs/context_parallel.md`` describes the attention, ``docs/planner.md``
these formulas).

Symbols, per layer and micro-batch on one rank: ``s`` the sequence, ``S = s / cp`` the tokens a rank holds (two
of ``2 cp`` chunks, :mod:`hybrid.context_parallel.split`), ``mb`` the micro batch, ``g`` the key/value heads of
one TP rank and ``d`` the head size, ``a`` the query heads, ``t`` the TP size, ``p`` bytes per activation element,
``q`` bytes per element of the ring's gradient sums (fp32: :func:`hybrid.context_parallel.ring_attention.
accumulation_dtype`).

**Which cp.** A ``cp`` is tried when the world divides (``tp x cp x dp x pp``, :func:`hybrid.grid.
data_parallel_size`) and :func:`model_zoo.config.context_parallel_problem` (the grid's split, dropout and
comm-type rules, and sequence parallelism's) accepts the model at ``tp``. Only the ring (``cp_comm_type p2p``) is
planned.

**As the planner evaluates it.** Everything but the attention is per token: a rank of a ``cp`` layout runs
``S``-token sequence parts, its ZeRO state is partitioned over ``dp x cp`` ranks (Megatron's distributed
optimizer) and its gradients reduce over that group, which is the ``dp x cp`` consecutive data ranks of the rank
grid (tp innermost, then cp, then dp). So memory, the ZeRO and TP collectives and the placement are those of the
same layout with ``dp' = dp x cp`` data ranks training ``cp x`` as many sequences of ``S`` tokens
(:func:`equivalent`); what that leaves out is added here:

* attention FLOPs: a rank's queries see the whole sequence's keys, not ``S`` of them: the compute time is scaled
  by the model FLOPs at ``s`` over those at ``S`` (:func:`compute_scale`; the collectives' overlap is kept as the
  ``S`` layout's, so slightly under-counted);
* the ring's buffers beyond the saved tensors (:func:`ring_in_flight`), transients of one layer's attention:
  forward the block in hand and the one arriving, ``2 B`` with ``B = 2 mb S g d p`` (one key/value block pair);
  backward the same two, the dK/dV partial being summed and the one arriving (``2 B_q``, ``B_q = 2 mb S g d q``)
  and the running ``dq`` (``mb S a d q / t``);
* the ring's bytes (:func:`ring_bytes_per_layer`): forward ``(cp - 1) B`` per rank; backward ``(cp - 1) B`` (the
  blocks go around again) plus ``cp B_q`` (each block's dK/dV sum travels ``cp`` hops back to its owner); full
  recomputation replays the forward's ``(cp - 1) B``.

**Overlap rule** (:func:`ring_overlap`). Every ring step after the first computes a ``2L x L`` block
(``L = s / 2cp``) while the next block travels: ``4 mb 2L L a d / t`` FLOPs forward, twice that backward, at the
planner's achieved FLOP rate. The block travels at the link of the cp ring: the intra-node rate when the ring stays
on a node, else the node's inter-node rate shared by the ranks of the node whose ring hop leaves it
(:meth:`hybrid.grid.Nodes.ring_hop_crosses`), the slower of the two when both kinds of hop exist, plus the
latency of one hop. A step's transfer hides when it takes no longer than the step's attention; otherwise the
difference is exposed, ``(cp - 1)`` times per pass and layer.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from hybrid.context_parallel.ring_attention import accumulation_dtype
from hybrid.dtypes import DTYPE_BYTES, DTYPES
from hybrid.grid import Grid, Nodes
from hybrid.plan.links import LinkSpec
from model_zoo.config import GPTConfig, context_parallel_problem
from model_zoo.flops import flops_per_token
from model_zoo.qkv_layout import qkv_layout

# The one context-parallel attention the planner prices (the ring); a2a is not planned yet.
PLANNED_COMM_TYPE = "p2p"


def cp_problem_at(config: GPTConfig, tp: int, cp: int, sequence_parallel: bool) -> Optional[str]:
    """Why ``config`` cannot run at ``cp`` context-parallel ranks and ``tp`` (None when it can): the model's rule
    :func:`model_zoo.config.context_parallel_problem`, which reads the grid's (:mod:`hybrid.grid`)."""
    run = config.replace(sequence_parallel=bool(sequence_parallel and tp > 1), cp_comm_type=PLANNED_COMM_TYPE)
    return context_parallel_problem(run, tp, cp)


def context_parallel_sizes(config: GPTConfig, tp: int, sequence_parallel: bool,
                           wanted: Sequence[int] = (1,)) -> List[int]:
    """The sizes of ``wanted`` that :func:`cp_problem_at` accepts at ``tp``."""
    return [cp for cp in wanted if cp_problem_at(config, tp, cp, sequence_parallel) is None]


def local_config(config: GPTConfig, cp: int) -> GPTConfig:
    """``config`` with the ``s / cp`` tokens one rank holds as its sequence (learned positions kept long enough)."""
    if cp == 1:
        return config
    return config.replace(seq_length=config.seq_length // cp)


def compute_scale(config: GPTConfig, cp: int, recompute_attention: int = 0) -> float:
    """Model FLOPs per token at the whole sequence over those at ``s / cp`` (``recompute_attention``: the
    recomputed attention forwards, each ``4 L s a d`` per token, as :mod:`hybrid.plan.timing` counts them)."""
    if cp == 1:
        return 1.0
    s, local = config.seq_length, config.seq_length // cp

    def per_token(seq: int) -> float:
        return flops_per_token(config, seq) + recompute_attention * 4 * config.num_layers * seq * \
            config.attention_width

    return per_token(s) / per_token(local)


def _kv_heads(config: GPTConfig, tp: int) -> int:
    return qkv_layout(config).local_heads(tp)[1]


def block_bytes(config: GPTConfig, micro_batch: int, tp: int, cp: int, precision: str) -> int:
    """``B``: one key/value block pair of one rank, ``[2, mb, g, S, d]`` at ``precision``."""
    S = config.seq_length // cp
    return 2 * micro_batch * S * _kv_heads(config, tp) * config.head_dim * DTYPE_BYTES[precision]


def _sum_bytes(precision: str) -> int:
    return accumulation_dtype(DTYPES[precision]).itemsize


def gradient_block_bytes(config: GPTConfig, micro_batch: int, tp: int, cp: int, precision: str) -> int:
    """``B_q``: one dK/dV partial, ``[2, mb, g, S, d]`` in the ring's accumulation dtype."""
    return block_bytes(config, micro_batch, tp, cp, precision) // DTYPE_BYTES[precision] * _sum_bytes(precision)


@dataclasses.dataclass(frozen=True)
class RingInFlight:
    """Bytes the ring holds beyond the saved tensors while one layer's attention runs (transients)."""

    forward: int
    backward: int


def ring_in_flight(config: GPTConfig, micro_batch: int, tp: int, cp: int, precision: str) -> RingInFlight:
    """The module docstring's in-flight buffers (0 at cp 1: no ring)."""
    if cp == 1:
        return RingInFlight(0, 0)
    B = block_bytes(config, micro_batch, tp, cp, precision)
    Bq = gradient_block_bytes(config, micro_batch, tp, cp, precision)
    dq = micro_batch * (config.seq_length // cp) * (config.num_heads // tp) * config.head_dim * _sum_bytes(precision)
    return RingInFlight(forward=2 * B, backward=2 * B + 2 * Bq + dq)


@dataclasses.dataclass(frozen=True)
class RingBytes:
    """Bytes one rank sends around the cp ring for one layer and micro-batch."""

    forward: int
    backward: int
    recompute: int = 0  # full recomputation replays the forward's

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.recompute


def ring_bytes_per_layer(config: GPTConfig, micro_batch: int, tp: int, cp: int, precision: str,
                         recompute: str = "none") -> RingBytes:
    """Forward ``(cp-1) B``; backward ``(cp-1) B + cp B_q``; full recomputation another ``(cp-1) B``."""
    if cp == 1:
        return RingBytes(0, 0)
    B = block_bytes(config, micro_batch, tp, cp, precision)
    Bq = gradient_block_bytes(config, micro_batch, tp, cp, precision)
    forward = (cp - 1) * B
    return RingBytes(forward, forward + cp * Bq, forward if recompute == "full" else 0)


def step_attention_flops(config: GPTConfig, micro_batch: int, tp: int, cp: int) -> int:
    """Forward FLOPs of one ring step after the first on one rank: a ``2L x L`` block, ``4 mb 2L L a d / t``."""
    L = config.seq_length // (2 * cp)
    return 4 * micro_batch * 2 * L * L * (config.num_heads // tp) * config.head_dim


def ring_crossing_senders(tp: int, cp: int, dp: int, ranks_per_node: int) -> int:
    """The most ranks of one node whose cp-ring successor is on another node (one pipeline stage's
    ``tp x cp x dp`` ranks, in :mod:`hybrid.grid`'s order)."""
    grid, nodes = Grid(tp=tp, dp=dp, pp=1, cp=cp), Nodes(min(ranks_per_node, tp * cp * dp))
    counts = {}
    for ring in grid.all_groups("cp"):
        for rank in ring:
            if nodes.ring_hop_crosses(ring, rank):
                counts[nodes.node_of(rank)] = counts.get(nodes.node_of(rank), 0) + 1
    return max(counts.values(), default=0)


def ring_hop_seconds(nbytes: float, crossing: int, link: LinkSpec) -> float:
    """Seconds one ring step moves ``nbytes`` to the next rank: every hop at once, the slowest decides."""
    intra = nbytes / link.intra_bytes_per_s
    inter = nbytes * crossing / link.inter_bytes_per_s_per_node if crossing else 0.0
    return max(intra, inter) + link.latency_s


@dataclasses.dataclass(frozen=True)
class RingOverlap:
    """One layer and micro-batch of the ring, on one rank: seconds per step of transfer and of attention, and
    the seconds left exposed (forward, backward, replayed forward)."""

    transfer_s: float  # forward: one block; backward: one block and one dK/dV partial
    attention_s: float  # forward step's attention
    exposed_s: float
    crosses_nodes: bool

    @property
    def hidden(self) -> bool:
        return self.exposed_s == 0.0


def ring_overlap(config: GPTConfig, micro_batch: int, tp: int, cp: int, dp: int, precision: str, recompute: str,
                 ranks_per_node: int, link: LinkSpec, flops_per_s: float) -> RingOverlap:
    """The module docstring's overlap rule for one layer and micro-batch."""
    if cp == 1:
        return RingOverlap(0.0, 0.0, 0.0, False)
    crossing = ring_crossing_senders(tp, cp, dp, ranks_per_node)
    B = block_bytes(config, micro_batch, tp, cp, precision)
    Bq = gradient_block_bytes(config, micro_batch, tp, cp, precision)
    attention = step_attention_flops(config, micro_batch, tp, cp) / flops_per_s
    forward = ring_hop_seconds(B, crossing, link)
    backward = ring_hop_seconds(B + Bq, crossing, link)
    passes = [(forward, attention), (backward, 2 * attention)]
    if recompute == "full":
        passes.append((forward, attention))
    exposed = sum((cp - 1) * max(0.0, move - compute) for move, compute in passes)
    return RingOverlap(forward, attention, exposed, crossing > 0)

