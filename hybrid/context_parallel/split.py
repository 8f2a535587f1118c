"""The load-balanced split of a causal sequence over the context-parallel (``cp``) ranks.

A sequence of ``s`` tokens is cut into ``2 * cp`` equal chunks of ``L = s / (2 * cp)`` tokens; rank ``r`` of
the ``"cp"`` axis holds chunk ``r`` followed by chunk ``2 * cp - 1 - r`` (Megatron-Core's order). Under a
causal mask the work of a query grows with its position, so pairing an early chunk with the mirror-image
late one gives every rank the same work. A rank's ``s / cp`` local tokens are always these two chunks in
this order (their global positions increase along the local sequence), which is what
:mod:`hybrid.context_parallel.ring_attention` and :mod:`hybrid.context_parallel.ulysses` expect.

The gathered ("rank") order of an all-gather over ``cp`` is rank 0's two chunks, then rank 1's, ...:
``[0, 2cp-1, 1, 2cp-2, ...]``; :func:`rank_order_chunks` is that order, the one rule every reorder here reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch

from hybrid.grid import sequence_split_problem

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

AXIS = "cp"


def check_seq_length(seq_length: int, cp: int) -> None:
    """Refuse (one line) a sequence that the ``2 * cp`` chunks cannot cut evenly (:mod:`hybrid.grid`'s rule)."""
    problem = sequence_split_problem(seq_length, cp)
    if problem:
        raise ValueError(problem)


def rank_chunks(cp: int, cp_rank: int) -> List[int]:
    """The two chunk numbers (of ``2 * cp``) that rank ``cp_rank`` holds, in its local order."""
    return [cp_rank, 2 * cp - 1 - cp_rank]


def rank_order_chunks(cp: int) -> List[int]:
    """The chunk numbers in the order an all-gather over ``cp`` lays them out (rank 0's two, rank 1's, ...)."""
    return [c for r in range(cp) for c in rank_chunks(cp, r)]


def local_positions(seq_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions ``[s / cp]`` (long) of the tokens rank ``cp_rank`` holds, in its local order."""
    check_seq_length(seq_length, cp)
    L = seq_length // (2 * cp)
    return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in rank_chunks(cp, cp_rank)])


def _rank_to_natural(cp: int, device=None) -> torch.Tensor:
    """Index ``[2cp]``: natural chunk ``c`` is chunk ``index[c]`` of the rank-ordered layout."""
    order = rank_order_chunks(cp)
    inverse = [0] * (2 * cp)
    for g, c in enumerate(order):
        inverse[c] = g
    return torch.tensor(inverse, device=device)


def natural_to_rank_order(x: torch.Tensor, cp: int, seq_dim: int) -> torch.Tensor:
    """Reorder the whole sequence ``x`` (``seq_dim`` of length ``s``) from natural order into rank order."""
    return _reorder(x, torch.tensor(rank_order_chunks(cp), device=x.device), cp, seq_dim)


def rank_to_natural_order(x: torch.Tensor, cp: int, seq_dim: int) -> torch.Tensor:
    """Reorder the whole sequence ``x`` (``seq_dim`` of length ``s``) from rank order back into natural order."""
    return _reorder(x, _rank_to_natural(cp, x.device), cp, seq_dim)


def _reorder(x: torch.Tensor, chunk_index: torch.Tensor, cp: int, seq_dim: int) -> torch.Tensor:
    seq_dim = seq_dim % x.dim()
    s = x.shape[seq_dim]
    check_seq_length(s, cp)
    chunks = x.unflatten(seq_dim, (2 * cp, s // (2 * cp)))
    return chunks.index_select(seq_dim, chunk_index).flatten(seq_dim, seq_dim + 1)


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, seq_dim: int) -> torch.Tensor:
    """This rank's part ``[.., s / cp, ..]`` of the whole sequence ``x`` (``seq_dim``: 1 for ``[b, s, ...]``, 0
    for ``[s, b, ...]``): chunk ``cp_rank`` then chunk ``2 cp - 1 - cp_rank``. No communication (every rank of
    a cp group reads the same sample); differentiable (the gradient lands on this rank's tokens, zero elsewhere)."""
    seq_dim = seq_dim % x.dim()
    s = x.shape[seq_dim]
    check_seq_length(s, cp)
    if cp == 1:
        return x
    L = s // (2 * cp)
    return torch.cat([x.narrow(seq_dim, c * L, L) for c in rank_chunks(cp, cp_rank)], seq_dim)


def split_for_rank(x: torch.Tensor, topo: "Topology", seq_dim: int) -> torch.Tensor:
    """:func:`split_sequence` for this process's rank of ``topo``'s ``"cp"`` axis."""
    return split_sequence(x, topo.cp_size, topo.cp_rank, seq_dim)


def _all_gather_seq(x: torch.Tensor, topo: "Topology", seq_dim: int) -> torch.Tensor:
    """All-gather over ``"cp"`` of the local parts ``x`` (``seq_dim`` of length ``s / cp``) into the whole
    sequence, in natural order (no autograd)."""
    cp = topo.cp_size
    moved = x.movedim(seq_dim, 0).contiguous()  # gloo gathers along dim 0
    out = moved.new_empty((cp * moved.shape[0],) + tuple(moved.shape[1:]))
    topo.comm.all_gather_into_tensor(out, moved, AXIS)
    return rank_to_natural_order(out, cp, 0).movedim(0, seq_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo, seq_dim, grad):
        ctx.topo, ctx.seq_dim, ctx.grad = topo, seq_dim, grad
        return _all_gather_seq(x, topo, seq_dim)

    @staticmethod
    def backward(ctx, dy):
        topo, seq_dim, cp = ctx.topo, ctx.seq_dim, ctx.topo.cp_size
        if ctx.grad == "slice":
            return split_sequence(dy, cp, topo.cp_rank, seq_dim), None, None, None
        # "sum": every rank used the whole sequence differently; this rank's tokens get the sum of all uses.
        ranked = natural_to_rank_order(dy, cp, seq_dim).movedim(seq_dim, 0).contiguous()
        out = ranked.new_empty((ranked.shape[0] // cp,) + tuple(ranked.shape[1:]))
        topo.comm.reduce_scatter_tensor(out.view(-1), ranked.view(-1), AXIS)
        return out.movedim(0, seq_dim), None, None, None


def gather_sequence(x: torch.Tensor, topo: "Topology", seq_dim: int, grad: str = "slice") -> torch.Tensor:
    """The whole sequence ``[.., s, ..]`` in natural order from every cp rank's part ``x`` ``[.., s / cp, ..]``:
    an all-gather over the ``"cp"`` axis, then the chunks reordered. Differentiable: ``grad="slice"`` (every
    rank computes the same function of the gathered tensor, as a replicated loss does) gives this rank's slice of
    the incoming gradient; ``grad="sum"`` (each rank uses it for a different part of the result) reduce-scatters
    the gradient over ``"cp"``."""
    if grad not in ("slice", "sum"):
        raise ValueError(f"gather_sequence: grad must be 'slice' or 'sum', not {grad!r}")
    if topo.cp_size == 1:
        return x
    return _GatherSequence.apply(x, topo, seq_dim % x.dim(), grad)
