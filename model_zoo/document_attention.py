"""Attention that stays inside each packed document (Megatron's ``--reset-attention-mask``).

A sequence packs several documents one after the other; ``document_ids``
``[b, s]`` numbers them (a token after an end-of-document token starts the
next one: :func:`hybrid.training.data.packed_document_ids`). A query attends to
keys of its own document at positions up to its own, never across a boundary.

No ``s x s`` mask is built. The documents are the maximal runs of equal ids
along each sample; attention inside one run is plain causal attention, so
the runs of equal length (over the whole micro-batch) are gathered into one
batch ``[n, heads, L, d]`` and go through SDPA with ``is_causal=True``, one
call per distinct length ``L``. What is materialised beyond the inputs:

- the gathered copies of q, k and v and the per-length outputs, each the size
  of its input ``[b, s, ., d]`` summed over all lengths (SDPA keeps its
  inputs for the backward pass), plus the output ``[b, heads, s, d]``;
- the segment table: two int64 tensors ``[documents]`` on the host and one
  index ``[n, L]`` per length on the device;
- inside SDPA, whatever its kernel needs for ``[n, heads, L, L]``: nothing of
  that size for the flash kernels (CPU, CUDA), the score matrix of each
  length group for the math kernel (dropout on CPU): at most
  ``heads x L_max x s`` elements per sample, against ``heads x s x s`` with one
  dense mask.

The number of SDPA calls is the number of distinct document lengths in the
micro-batch (at most about ``sqrt(2 b s)``); a sample of one document is one
causal SDPA over the whole sequence.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from hybrid.tensor_parallel.random import RNGTracker


def document_segments(document_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The documents of a micro-batch: ``(starts, lengths)``, int64 ``[documents]`` on the host.

    ``document_ids`` ``[b, s]`` (any integer dtype, any device). A document is a
    maximal run of equal ids along a sample; ``starts`` index the flattened
    ``[b * s]`` tokens, in order. The ids must not decrease along a sample (as
    :func:`hybrid.training.data.packed_document_ids` builds them): a document
    that reappeared after another would otherwise be split in two, and its
    second part could not see its first as a dense same-id mask would let it.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [b, s], got shape {tuple(document_ids.shape)}")
    ids = document_ids.detach().to("cpu", torch.int64)  # one copy to the host: the grouping is host-side
    b, s = ids.shape
    step = ids[:, 1:] - ids[:, :-1]
    if bool((step < 0).any()):
        raise ValueError("document_ids must not decrease along a sample (number the packed documents in order: "
                         "hybrid.training.data.packed_document_ids)")
    new = torch.ones(b, s, dtype=torch.bool)
    new[:, 1:] = step != 0  # a sample's first token always starts a document
    starts = new.flatten().nonzero().flatten()
    lengths = torch.diff(starts, append=torch.tensor([b * s]))
    return starts, lengths


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, *,
                       dropout_p: float = 0.0, tracker: Optional[RNGTracker] = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """q ``[b, heads, s, d]``, k and v ``[b, groups, s, d]``, ``document_ids`` ``[b, s]`` -> ``[b, heads, s, d]``.

    Equal (in exact arithmetic, and to rounding in floating point: each row's
    softmax runs over the same keys) to SDPA with the dense boolean mask
    ``causal & (document_ids[:, :, None] == document_ids[:, None, :])``,
    forward and backward. ``enable_gqa``: ``heads`` a multiple of ``groups``, as
    SDPA's. Dropout (``dropout_p > 0``) draws from ``tracker``'s ``"tp"``
    stream (each TP rank holds other heads), or from the default generator
    without a tracker. Local to the process: no collective.
    """
    b, heads, s, d = q.shape
    groups = k.shape[1]
    if document_ids.shape != (b, s):
        raise ValueError(f"document_ids must be [b, s] = {[b, s]} to match the queries, got "
                         f"{list(document_ids.shape)}")
    starts, lengths = document_segments(document_ids)
    if starts.numel() == b:  # one document per sample: plain causal attention, nothing gathered
        return _sdpa(q, k, v, dropout_p, tracker, enable_gqa)

    # token-major views [b * s, heads, d]: a document's tokens are then one contiguous run of rows
    qf = q.transpose(1, 2).reshape(b * s, heads, d)
    kf = k.transpose(1, 2).reshape(b * s, groups, k.shape[-1])
    vf = v.transpose(1, 2).reshape(b * s, groups, v.shape[-1])
    outs: List[torch.Tensor] = []
    rows: List[torch.Tensor] = []
    for length in torch.unique(lengths).tolist():
        first = starts[lengths == length]
        index = (first[:, None] + torch.arange(length)).to(q.device)  # [n, L] rows of the n documents
        qs, ks, vs = (t[index].transpose(1, 2) for t in (qf, kf, vf))  # [n, ., L, d]
        out = _sdpa(qs, ks, vs, dropout_p, tracker, enable_gqa)  # [n, heads, L, dv]
        outs.append(out.transpose(1, 2).reshape(-1, heads, out.shape[-1]))
        rows.append(index.flatten())
    # every token is in exactly one document: index_copy puts each row back (and routes its gradient)
    ctx = q.new_zeros(b * s, heads, v.shape[-1]).index_copy(0, torch.cat(rows), torch.cat(outs))
    return ctx.view(b, s, heads, -1).transpose(1, 2)


def _sdpa(q, k, v, dropout_p: float, tracker: Optional[RNGTracker], enable_gqa: bool) -> torch.Tensor:
    """Causal SDPA; dropout under ``tracker``'s ``"tp"`` stream when there is one."""
    gqa = {"enable_gqa": True} if enable_gqa else {}
    if dropout_p == 0.0 or tracker is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, **gqa)
    with tracker.fork("tp", q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, **gqa)


def dense_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, *,
                             enable_gqa: bool = False) -> torch.Tensor:
    """The reference: SDPA with the dense boolean mask ``[b, 1, s, s]`` (causal and the same document), no
    dropout. Shapes as :func:`document_attention`; it materialises ``b x s x s`` booleans (and, in SDPA's math
    kernel, ``b x heads x s x s`` scores). For tests and the memory comparison only."""
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # [b, s, s]
    gqa = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(causal & same).unsqueeze(1), **gqa)
