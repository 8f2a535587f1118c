"""How the communicator hands tensors to the backend: their byte size, their memory without autograd, and
their padding to equal chunks. Shared by :mod:`hybrid.comm` and its algorithm modules."""

from __future__ import annotations

from typing import Tuple

import torch


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def untracked(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory without its autograd identity, for the backend to hold.

    A backend can let go of its reference after the call returned (gloo's worker thread, NCCL's watchdog). A
    tensor that becomes an autograd output (a tensor-parallel mapping's result: its ``grad_fn`` is attached
    after the collective) or a view of one would keep the graph behind it, saved tensors and all, alive
    until then; under full recomputation that moved the measured peak. The alias shares the storage and
    offset, so results land in ``t`` as before."""
    return t.detach()


def padded(flat: torch.Tensor, parts: int) -> Tuple[torch.Tensor, int]:
    """``flat`` [numel] as ``parts`` equal chunks: itself when they divide it, else a zero-padded copy; and the
    chunk size ``ceil(numel / parts)``."""
    k = -(-flat.numel() // parts)
    if k * parts == flat.numel():
        return flat, k
    out = torch.zeros(k * parts, dtype=flat.dtype, device=flat.device)
    out[:flat.numel()].copy_(flat)
    return out, k
