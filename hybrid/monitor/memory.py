"""Memory in use by this process: CUDA allocator statistics, or resident set size on CPU."""

from __future__ import annotations

import dataclasses
import resource
import sys
from typing import Optional, Tuple

import torch

_PROC_STATUS = "/proc/self/status"


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """A snapshot of memory use, in bytes.

    ``kind == "cuda"``: tensors allocated / reserved by the caching allocator on
    the device, and the peak allocated since start (or the last reset).
    ``kind == "rss"``: the process's resident set size and its high-water mark;
    ``reserved_bytes`` is None.
    """

    kind: str
    allocated_bytes: int
    peak_bytes: int
    reserved_bytes: Optional[int] = None

    def describe(self) -> str:
        if self.kind == "cuda":
            return (f"mem alloc {_gib(self.allocated_bytes)} | reserved "
                    f"{_gib(self.reserved_bytes or 0)} | peak {_gib(self.peak_bytes)}")
        return f"mem rss {_gib(self.allocated_bytes)} | peak rss {_gib(self.peak_bytes)}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def process_rss() -> Tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes.

    Read from /proc/self/status (VmRSS, VmHWM) where it exists; elsewhere both
    come from ``getrusage``'s peak, the only figure it offers.
    """
    try:
        with open(_PROC_STATUS, encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return _kib_field(fields["VmRSS"]), _kib_field(fields["VmHWM"])
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        peak = peak if sys.platform == "darwin" else peak * 1024
        return peak, peak


def _kib_field(value: str) -> int:
    number, unit = value.split()
    if unit != "kB":
        raise ValueError(f"unexpected unit {unit!r} in {_PROC_STATUS}")
    return int(number) * 1024


def read_memory_stats(device: Optional[torch.device] = None) -> MemoryStats:
    """Memory statistics for ``device`` (CUDA allocator) or for the process (CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return MemoryStats("cuda", torch.cuda.memory_allocated(device),
                           torch.cuda.max_memory_allocated(device),
                           torch.cuda.memory_reserved(device))
    rss, peak = process_rss()
    return MemoryStats("rss", rss, max(peak, rss))
