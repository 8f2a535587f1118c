"""All-to-all attention (``--cp-comm-type a2a``, DeepSpeed-Ulysses) over the ``"cp"`` axis.

Each rank holds its two chunks of the load-balanced split (:mod:`hybrid.context_parallel.split`) for all
heads: ``q`` ``[b, nq, S, d]``, ``k``/``v`` ``[b, ng, S, d]``, ``S = s / cp``. One all-to-all over ``"cp"`` per
tensor scatters the heads and gathers the sequence (``[b, nq / cp, s, d]``), the chunks are put back in natural
order, each rank runs plain causal attention on its heads over the whole sequence, and the inverse all-to-all
returns ``[b, nq, S, d]``. The all-to-alls are autograd functions whose backward is the inverse all-to-all.

Heads: ``nq`` must be divisible by cp; the key/value groups ``ng`` too, or else cp a multiple of ``ng``, in which
case each group is replicated ``cp / ng`` times before the all-to-all (each rank then receives exactly the
group its query heads read; the replicas' gradients sum in autograd).

Documents (``document_ids`` ``[b, S]``): gathered over ``"cp"`` (all-gather, no gradient), and attention runs
per document segment (a contiguous run of equal ids, as packing makes them) with causal SDPA on each, so no
``s x s`` mask exists; SDPA's own kernel decides what it holds per segment (the flash kernel for fp32: tiles
only). Without documents: one causal SDPA call over ``s``. Materialised per rank: the gathered ``q``, ``k``,
``v`` and output ``[b, nq / cp (or ng / cp), s, d]`` (as many elements as the local ones) and their reordered
copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from hybrid.context_parallel.split import AXIS, _all_gather_seq, natural_to_rank_order, rank_to_natural_order
from hybrid.grid import a2a_heads_problem

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


def check_heads(num_heads: int, num_groups: int, cp: int) -> None:
    """Refuse (one line) heads that the all-to-all cannot scatter over ``cp`` ranks (:mod:`hybrid.grid`'s rule)."""
    problem = a2a_heads_problem(num_heads, num_groups, cp)
    if problem:
        raise ValueError(problem)


def _seq_to_heads(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """``[b, h, S, d]`` (local sequence, all heads) -> ``[b, h / cp, cp S, d]`` (rank order, this rank's heads)."""
    cp = topo.cp_size
    b, h, S, d = x.shape
    send = x.reshape(b, cp, h // cp, S, d).transpose(0, 1).contiguous()  # row i: the heads of rank i
    recv = torch.empty_like(send)  # row i: rank i's part of the sequence
    topo.comm.all_to_all_single(recv, send, AXIS)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * S, d)


def _heads_to_seq(x: torch.Tensor, topo: "Topology") -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``[b, h / cp, cp S, d]`` -> ``[b, h, S, d]``."""
    cp = topo.cp_size
    b, hl, s, d = x.shape
    send = x.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # row i: rank i's tokens
    recv = torch.empty_like(send)  # row i: the heads of rank i
    topo.comm.all_to_all_single(recv, send, AXIS)
    return recv.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _seq_to_heads(x, topo)

    @staticmethod
    def backward(ctx, dy):
        return _heads_to_seq(dy.contiguous(), ctx.topo), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return _heads_to_seq(x, topo)

    @staticmethod
    def backward(ctx, dy):
        return _seq_to_heads(dy.contiguous(), ctx.topo), None


def _replicate_groups(x: torch.Tensor, times: int) -> torch.Tensor:
    """``[b, ng, S, d]`` -> ``[b, ng * times, S, d]``, each group repeated ``times`` times in place."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: "Topology",
                      document_ids: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Causal (same-document with ``document_ids`` ``[b, S]``) attention of ``q`` ``[b, nq, S, d]``, ``k``, ``v``
    ``[b, ng, S, d]`` split over ``topo``'s ``"cp"`` axis; returns ``[b, nq, S, d]``."""
    cp = topo.cp_size
    nq, ng = q.shape[1], k.shape[1]
    check_heads(nq, ng, cp)
    if ng < cp:
        k, v = _replicate_groups(k, cp // ng), _replicate_groups(v, cp // ng)
    qh, kh, vh = (rank_to_natural_order(_SeqToHeads.apply(t, topo), cp, 2) for t in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if document_ids is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        docs = _all_gather_seq(document_ids, topo, 1)  # [b, s], natural order
        rows = []
        for i in range(qh.shape[0]):
            _, counts = torch.unique_consecutive(docs[i], return_counts=True)
            parts, start = [], 0
            for n in counts.tolist():
                seg = slice(start, start + n)
                parts.append(F.scaled_dot_product_attention(
                    qh[i:i + 1, :, seg], kh[i:i + 1, :, seg], vh[i:i + 1, :, seg], is_causal=True, scale=scale,
                    enable_gqa=gqa))
                start += n
            rows.append(torch.cat(parts, 2))
        o = torch.cat(rows, 0)
    return _HeadsToSeq.apply(natural_to_rank_order(o, cp, 2).contiguous(), topo)
