"""Context parallelism: the sequence of each sample split over the ``"cp"`` ranks of a
:class:`~hybrid.topology.Topology` (docs/context_parallel.md).

* :mod:`.split`: the load-balanced split (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``), positions,
  split and gather;
* :mod:`.ring_attention`: ``--cp-comm-type p2p``, key/value blocks around a ring with the log-sum-exp rule;
* :mod:`.ulysses`: ``--cp-comm-type a2a``, all-to-all scattering heads and gathering the sequence;
* :func:`context_parallel_attention`: the one entry point.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from hybrid.compile_marks import eager
from hybrid.context_parallel.ring_attention import ring_attention
from hybrid.grid import CP_COMM_TYPES, cp_comm_type_problem, cp_dropout_problem
from hybrid.context_parallel.split import (check_seq_length, gather_sequence, local_positions, split_for_rank,
                                           split_sequence)
from hybrid.context_parallel.ulysses import check_heads, ulysses_attention

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

COMM_TYPES = CP_COMM_TYPES  # hybrid.grid's list

__all__ = ["COMM_TYPES", "check_attention", "check_heads", "check_seq_length", "context_parallel_attention",
           "gather_sequence", "local_positions", "ring_attention", "split_for_rank", "split_sequence",
           "ulysses_attention"]


def check_attention(comm_type: str, cp: int, attention_dropout: float = 0.0) -> None:
    """Refuse (one line) a ``--cp-comm-type`` this package lacks, and dropout inside attention under cp
    (:mod:`hybrid.grid`'s rules)."""
    problem = cp_comm_type_problem(comm_type) or cp_dropout_problem(cp, attention_dropout)
    if problem:
        raise ValueError(problem)


# Inside a compiled block (model_zoo.compile) the attention runs eagerly, one graph break per call: the ring's
# asynchronous send/recv of key/value blocks, overlapped with the block in hand, and its own backward ring are
# communicator calls inside an autograd function; the all-to-all variant and the document segments (lengths read
# on the host) likewise. Everything around the attention (projections, norms, RoPE, the MLP) stays compiled.
@eager
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: "Topology",
                               comm_type: str = "p2p", document_ids: Optional[torch.Tensor] = None,
                               scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of a sequence split over ``topo``'s ``"cp"`` axis by the load-balanced split.

    ``q`` ``[b, nq, S, d]``, ``k`` and ``v`` ``[b, ng, S, d]`` (``ng`` divides ``nq``), ``S = s / cp`` this rank's
    two chunks in split order; ``document_ids`` ``[b, S]`` (optional): the global document number of each local
    token, and attention then also stays inside each document. ``scale`` defaults to ``1 / sqrt(d)``.
    ``comm_type``: ``"p2p"`` (ring) or ``"a2a"`` (Ulysses). At cp 1 the ring runs its single step locally.
    Returns ``[b, nq, S, d]``.
    """
    cp = topo.cp_size
    check_attention(comm_type, cp, dropout_p)
    if dropout_p > 0:  # at cp 1 too: the blocks here run no dropout, and silently dropping it would be wrong
        raise ValueError(f"context_parallel_attention runs no attention dropout (dropout_p {dropout_p}); at "
                         f"--context-parallel-size 1 use plain SDPA, or set --attention-dropout 0")
    b, nq, S, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (S, d) or nq % k.shape[1]:
        raise ValueError(f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"must be [b, nq, S, d] and [b, ng, S, d] with ng dividing nq")
    check_seq_length(S * cp, cp)
    if document_ids is not None and tuple(document_ids.shape) != (b, S):
        raise ValueError(f"context_parallel_attention: document_ids {tuple(document_ids.shape)} must be [b, S] = "
                         f"{(b, S)}")
    if comm_type == "a2a" and cp > 1:
        return ulysses_attention(q, k, v, topo, document_ids, scale)
    return ring_attention(q, k, v, topo, document_ids, 1.0 / math.sqrt(d) if scale is None else scale)
