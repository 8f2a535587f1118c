"""Ring attention (``--cp-comm-type p2p``): causal attention over a sequence split over the ``"cp"`` ranks.

Each rank holds its two chunks of the load-balanced split (:mod:`hybrid.context_parallel.split`): queries
``q`` ``[b, nq, S, d]`` and keys/values ``k``, ``v`` ``[b, ng, S, d]`` with ``S = s / cp = 2 L``. The key/value
blocks travel around the ring of the ``"cp"`` axis (rank ``r`` sends to ``r + 1`` and receives from
``r - 1``): at step ``i`` rank ``r`` holds the block of rank ``j = r - i (mod cp)``, and before computing on it
launches the send/recv of that block to the next rank (async, :meth:`hybrid.comm.Communicator.send` /
``recv``), so the transfer overlaps the attention of the block in hand. The causal structure of the split
decides what each step computes (``L``-token chunks; ``q0, q1`` this rank's chunks ``r, 2cp-1-r``):

* step 0 (``j = r``): all ``2L`` queries on all ``2L`` keys, causal (local order is position order);
* ``j < r``: all ``2L`` queries on the first key chunk ``j`` only (chunk ``2cp-1-j`` is in the future of both);
* ``j > r``: the second query chunk only, on both key chunks (chunk ``r`` precedes both of them).

So every step after the first costs the same ``2 L x L`` score block: equal work on every rank. Partial
results combine by the log-sum-exp rule: with running ``(o, lse)`` and a block's ``(o_i, lse_i)``,
``lse' = logaddexp(lse, lse_i)`` and ``o' = o exp(lse - lse') + o_i exp(lse_i - lse')``.

Documents (``document_ids`` ``[b, S]``, the global document number of each local token): the key/value
block's ids travel with it; a query attends a key only inside its own document, so each block pair gets a
boolean "same document (and causal on step 0)" mask of its own shape. A block pair in which no query sees any
key is skipped; a query row that sees no key of a block gets ``lse_i = -inf`` (the fused kernel returns 0 there).

The backward pass runs the same ring (:class:`RingAttention`): the key/value blocks travel again (they are
not kept from the forward pass, which would hold the whole sequence's keys and values), and the partial
gradients dK/dV of each block travel one step behind them, each rank adding its contribution before passing
them on; after ``cp`` steps each block's gradient arrives back at its owner. The exchange of step ``i``'s dK/dV
overlaps the attention backward of step ``i + 1``.

Kernel and what is materialised per step: the fused CPU flash attention
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``), which returns the log-sum-exp
and tiles the score matrix internally, so no score or probability block of ``Lq x Lk`` is kept. Per step a
rank holds: the key/value block in hand and the one arriving (``2 x 2 [b, ng, S, d]``), the keys/values
expanded to ``nq`` heads when ``ng < nq`` (``2 [b, nq, Lk, d]``; the kernel has no grouped-query form), the
block's output and log-sum-exp (``[b, nq, Lq, d]``, ``[b, nq, Lq]``) and, with documents only, an additive mask
``[b, 1, Lq, Lk]`` in the compute dtype (at most ``[b, 1, 2L, 2L]``, on step 0). The running output and
log-sum-exp ``[b, nq, S, d]``, ``[b, nq, S]`` are kept in fp32 (float64 for float64 inputs) and saved for the
backward pass, as are ``q``, ``k``, ``v``. Dropout inside attention is not supported here (refused by
:func:`hybrid.context_parallel.context_parallel_attention`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from hybrid.context_parallel.split import AXIS
from hybrid.p2p_collectives import TAG_SPACE

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.comm import Handle
    from hybrid.topology import Topology

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# The ring's message tags: above the range the communicator's own point-to-point collectives number theirs
# from ([1, TAG_SPACE)) and away from plain send/recv's 0, so no other transfer on "cp" can take them.
TAG_KV, TAG_DOCS, TAG_DKV = TAG_SPACE + 1, TAG_SPACE + 2, TAG_SPACE + 3


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the running output, log-sum-exp and gradient sums: fp32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_plan(cp_rank: int, source: int, L: int) -> Optional[Tuple[slice, slice, bool]]:
    """What rank ``cp_rank`` computes on the key/value block of rank ``source``: ``(query rows, key rows,
    causal)`` of its local ``2L`` tokens and the block's ``2L``, from the causal structure of the split."""
    if source == cp_rank:
        return slice(0, 2 * L), slice(0, 2 * L), True
    if source < cp_rank:
        return slice(0, 2 * L), slice(0, L), False
    return slice(L, 2 * L), slice(0, 2 * L), False


def _expand_groups(x: torch.Tensor, nq: int) -> torch.Tensor:
    """``[b, ng, n, d]`` -> ``[b, nq, n, d]``: query head ``h`` reads group ``h // (nq / ng)``."""
    b, ng, n, d = x.shape
    if ng == nq:
        return x
    return x.unsqueeze(2).expand(b, ng, nq // ng, n, d).reshape(b, nq, n, d)


def _sum_groups(dx: torch.Tensor, ng: int) -> torch.Tensor:
    """The adjoint of :func:`_expand_groups`: ``[b, nq, n, d]`` -> ``[b, ng, n, d]``."""
    b, nq, n, d = dx.shape
    if ng == nq:
        return dx
    return dx.view(b, ng, nq // ng, n, d).sum(2)


def _allowed(docs_q: torch.Tensor, docs_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which keys each query may see, ``[b, Lq, Lk]`` bool: the same document (and causal on the diagonal)."""
    same = docs_q.unsqueeze(2) == docs_k.unsqueeze(1)
    if causal:
        same &= torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril()
    return same


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's mask ``[b, 1, Lq, Lk]`` (0 where allowed, -inf elsewhere; it takes no boolean mask)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")).unsqueeze(1)


class _Block:
    """One block pair's inputs to the kernel: the query/key rows, causal flag and (with documents) mask."""

    def __init__(self, plan, docs_q: Optional[torch.Tensor], docs_k: Optional[torch.Tensor], dtype):
        self.rows, self.cols, self.causal = plan
        self.mask = self.seen = None
        self.skip = False
        if docs_q is not None:
            allowed = _allowed(docs_q[:, self.rows], docs_k[:, self.cols], self.causal)
            self.seen = allowed.any(-1)  # [b, Lq]: the query rows that see some key of this block
            self.skip = not bool(self.seen.any())
            self.mask = None if self.skip else _additive(allowed, dtype)
            self.causal = False  # in the mask


class _Ring:
    """The send/recv of one ring exchange over ``"cp"``: to rank ``r + 1``, from rank ``r - 1``."""

    def __init__(self, topo: "Topology"):
        self.comm, self.n, self.rank = topo.comm, topo.cp_size, topo.cp_rank
        self.next, self.prev = (self.rank + 1) % self.n, (self.rank - 1) % self.n

    def shift(self, tensor: torch.Tensor, tag: int) -> Tuple[torch.Tensor, List["Handle"]]:
        """Launch sending ``tensor`` on and receiving the previous rank's into a new buffer (async)."""
        received = torch.empty_like(tensor)
        handles = [self.comm.send(tensor, AXIS, self.next, async_op=True, tag=tag),
                   self.comm.recv(received, AXIS, self.prev, async_op=True, tag=tag)]
        return received, handles


def _wait(handles: List["Handle"]) -> None:
    for h in handles:
        h.wait()


class RingAttention(torch.autograd.Function):
    """``(q, k, v, document_ids, topo, scale) -> out`` ``[b, nq, S, d]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, topo, scale):
        b, nq, S, d = q.shape
        L = S // 2
        ring = _Ring(topo)
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(b, nq, S, d, dtype=acc, device=q.device)
        lse = torch.full((b, nq, S), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one buffer travels: [2, b, ng, S, d]
        docs = document_ids
        for step in range(ring.n):
            pending: List["Handle"] = []
            if step + 1 < ring.n:  # the next block is on its way while this one is computed
                kv_next, pending = ring.shift(kv, TAG_KV)
                if docs is not None:
                    docs_next, more = ring.shift(docs, TAG_DOCS)
                    pending += more
            block = _Block(block_plan(ring.rank, (ring.rank - step) % ring.n, L), document_ids, docs, q.dtype)
            if not block.skip:
                o_i, lse_i = _flash(q[:, :, block.rows], _expand_groups(kv[0][:, :, block.cols], nq),
                                    _expand_groups(kv[1][:, :, block.cols], nq), 0.0, block.causal,
                                    attn_mask=block.mask, scale=scale)
                ctx.lse_dtype = lse_i.dtype  # what the kernel's backward takes back (fp32 for bf16 inputs)
                lse_i = lse_i.to(acc)
                if block.seen is not None:
                    lse_i = lse_i.masked_fill(~block.seen.unsqueeze(1), float("-inf"))
                # Step 0 (the diagonal) comes first and gives every row a finite lse (a token sees itself), so
                # logaddexp never meets two -inf.
                o_run, lse_run = out[:, :, block.rows], lse[:, :, block.rows]
                new = torch.logaddexp(lse_run, lse_i)
                o_run.mul_(torch.exp(lse_run - new).unsqueeze(-1)).add_(
                    o_i.to(acc) * torch.exp(lse_i - new).unsqueeze(-1))
                lse_run.copy_(new)
            _wait(pending)
            if pending:
                kv = kv_next
                if docs is not None:
                    docs = docs_next
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, document_ids, result, lse)
        ctx.topo, ctx.scale = topo, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, document_ids, out, lse = ctx.saved_tensors
        b, nq, S, d = q.shape
        ng, L = k.shape[1], S // 2
        ring = _Ring(ctx.topo)
        acc = accumulation_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        lse_q = lse.to(ctx.lse_dtype)
        dq = torch.zeros(b, nq, S, d, dtype=acc, device=q.device)
        kv, docs = torch.stack([k, v]), document_ids
        dkv_in: Optional[torch.Tensor] = None
        dkv_pending: List["Handle"] = []
        for step in range(ring.n):
            pending: List["Handle"] = []
            if step + 1 < ring.n:
                kv_next, pending = ring.shift(kv, TAG_KV)
                if docs is not None:
                    docs_next, more = ring.shift(docs, TAG_DOCS)
                    pending += more
            block = _Block(block_plan(ring.rank, (ring.rank - step) % ring.n, L), document_ids, docs, q.dtype)
            # this rank's contribution to the gradient of the block in hand, [2, b, ng, S, d]
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            if not block.skip:
                rows, cols = block.rows, block.cols
                dq_i, dk_i, dv_i = _flash_backward(
                    grad_out[:, :, rows], q[:, :, rows], _expand_groups(kv[0][:, :, cols], nq),
                    _expand_groups(kv[1][:, :, cols], nq), out[:, :, rows], lse_q[:, :, rows].contiguous(),
                    0.0, block.causal, attn_mask=block.mask, scale=ctx.scale)
                dq[:, :, rows] += dq_i
                dkv[0][:, :, cols] += _sum_groups(dk_i, ng)
                dkv[1][:, :, cols] += _sum_groups(dv_i, ng)
            if dkv_in is not None:  # what the ranks before this one added to this block's gradient
                _wait(dkv_pending)
                dkv += dkv_in
            if ring.n > 1:  # on to the next holder of this block (after the last step: back to its owner)
                dkv_in, dkv_pending = ring.shift(dkv, TAG_DKV)
            else:
                dkv_in = dkv
            _wait(pending)
            if pending:
                kv = kv_next
                if docs is not None:
                    docs = docs_next
        _wait(dkv_pending)
        return (dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: "Topology",
                   document_ids: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Causal (and, with ``document_ids`` ``[b, S]``, same-document) attention of this rank's queries ``q``
    ``[b, nq, S, d]`` over the whole sequence, whose keys/values ``k``, ``v`` ``[b, ng, S, d]`` are split over the
    ``"cp"`` axis of ``topo``; ``S`` is this rank's two chunks in split order. Returns ``[b, nq, S, d]``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    docs = None if document_ids is None else document_ids.contiguous()
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), docs, topo, scale)
