"""Detect that data-parallel ranks are about to issue different ZeRO-3 collectives.

ZeRO-3 gathers parameters when modules run, so the collectives a rank issues
follow its own forward and backward. If the DP ranks run different modules
(a data-dependent branch, a parameter used only on some ranks), their
all-gathers no longer pair up and the job would hang or mix up buffers.

Before each batch of stage-3 collectives every rank folds what it is about to
issue into a running hash and all-reduces ``[h, -h]`` with MAX over ``dp``
(16 bytes). Equal hashes everywhere give ``max == -max(-h)``; any difference
is seen by every rank in the same call, which then exchange descriptions of
their recent requests and raise :class:`GatherOrderError` together: a clear
error instead of a hang.
"""

from __future__ import annotations

import collections
import zlib
from typing import Deque

import torch

from hybrid.comm import Communicator

_MOD = (1 << 61) - 1
RECENT = 6  # requests quoted in the error message


class GatherOrderError(RuntimeError):
    """Data-parallel ranks disagree on the order of ZeRO-3 parameter gathers or gradient reductions."""


class OrderCheck:
    """Running hash of this rank's stage-3 collective requests, compared over ``dp`` before each issue."""

    def __init__(self, comm: Communicator, enabled: bool = True):
        self.comm = comm
        self.enabled = enabled and comm.size("dp") > 1
        self.hash = 0
        self.count = 0
        self.recent: Deque[str] = collections.deque(maxlen=RECENT)

    def fold(self, kind: str, codes, describe: str) -> None:
        """Fold ``(kind, codes)`` into the hash without comparing it yet: for requests every rank makes alike by
        construction (the next forward's first gathers, read off a recorded sequence whose gathers were each
        verified); the next :meth:`verify` compares them along with the rest."""
        if not self.enabled:
            return
        for c in (zlib.crc32(kind.encode()), *codes):  # crc32: stable across processes, unlike hash()
            self.hash = (self.hash * 1_000_003 + int(c) + 1) % _MOD
        self.count += 1
        self.recent.append(f"#{self.count} {kind}: {describe}")

    def verify(self, kind: str, codes, describe: str) -> None:
        """Fold ``(kind, codes)`` into the hash and check that every DP rank folded the same so far."""
        if not self.enabled:
            return
        self.fold(kind, codes, describe)
        t = torch.tensor([self.hash, -self.hash], dtype=torch.int64)
        self.comm.all_reduce(t, "dp", op="max")
        if int(t[0]) != -int(t[1]):
            self._fail()

    def _fail(self) -> None:
        mine = "; ".join(self.recent)
        everyone = self.comm.all_gather_object(mine, "dp")
        lines = "\n".join(f"  dp rank {r}: {d}" for r, d in enumerate(everyone))
        raise GatherOrderError(
            "ZeRO stage 3: the data-parallel ranks are about to issue different parameter gathers or "
            "gradient reductions, which would hang. Every DP rank must run the same modules in the same "
            "order (the forward visited modules in a data-dependent order, or a parameter was used on some "
            "ranks only). Recent requests per rank:\n" + lines +
            "\nMake the module order independent of the data, or use ZeRO stage 2 for this model.")
