"""Attention that stays inside each packed document (Megatron's ``--reset-attention-mask``).

A sequence packs several documents one after the other; ``document_ids``
``[b, s]`` numbers them (a token after an end-of-document token starts the
next one). A query attends to keys of its own document at positions up to its
own, never across a boundary.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.tensor_parallel.random import RNGTracker


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, *,
                       dropout_p: float = 0.0, tracker: Optional[RNGTracker] = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """q ``[b, heads, s, d]``, k and v ``[b, groups, s, d]``, ``document_ids`` ``[b, s]`` -> ``[b, heads, s, d]``.

    This version builds the boolean mask ``[b, 1, s, s]`` (causal and the same document) and runs SDPA with it.
    """
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # [b, s, s]
    mask = (causal & same).unsqueeze(1)
    if dropout_p == 0.0 or tracker is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=enable_gqa)
    with tracker.fork("tp", q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=enable_gqa)
