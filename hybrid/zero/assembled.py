"""A flat tensor that an optimizer's state holds in pieces, assembled only when asked.

Some entries of a ZeRO optimizer's ``state_dict`` do not exist as one tensor:
the master partition of fp32 parameters is this rank's chunks of the flat
parameter buffer (one per segment), and stage 3 keeps the optimizer moments
of decayed and undecayed elements in separate groups. ``state_dict()``
assembles them into a fresh tensor; ``state_dict(lazy=True)`` returns an
:class:`AssembledTensor` instead, which costs nothing until a reader copies
the pieces straight into a buffer of its own (:meth:`AssembledTensor.copy_into`,
what the background checkpoint writer does on its thread: one copy instead of
an assembly on the training thread and a copy of that).

The pieces are live views: an :class:`AssembledTensor` is valid only until
the optimizer next changes its state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class AssembledTensor:
    """A 1-D ``[numel]`` tensor of ``dtype`` made of ``pieces``: ``(offset, 1-D source view)`` pairs that
    cover it without overlap."""

    numel: int
    dtype: torch.dtype
    device: torch.device
    pieces: Tuple[Tuple[int, torch.Tensor], ...]

    @classmethod
    def concat(cls, chunks: Sequence[torch.Tensor]) -> "AssembledTensor":
        """The concatenation of 1-D ``chunks`` (what ``torch.cat(chunks)`` would build)."""
        pieces, offset = [], 0
        for chunk in chunks:
            pieces.append((offset, chunk))
            offset += chunk.numel()
        return cls(offset, chunks[0].dtype, chunks[0].device, tuple(pieces))

    @property
    def shape(self) -> Tuple[int]:
        return (self.numel,)

    def copy_into(self, out: torch.Tensor) -> None:
        """Write the pieces into ``out`` (a ``[numel]`` tensor of any device)."""
        for offset, piece in self.pieces:
            out[offset: offset + piece.numel()].copy_(piece)

    def materialize(self) -> torch.Tensor:
        """A fresh tensor on the pieces' device."""
        out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.copy_into(out)
        return out


def assembled_or_copy(value: AssembledTensor, lazy: bool) -> Any:
    """``value`` itself when ``lazy``, else its fresh assembly (how ``state_dict(lazy=...)`` returns it)."""
    return value if lazy else value.materialize()
