"""Every rank's figures of a benchmark run on the emulated cluster (``tools/emulated_cluster.py``): gathered to
rank 0, printed there as one tagged JSON line, and read back by the driver from node 0's output."""

from __future__ import annotations

import json
from typing import List, Optional


def print_on_rank0(prefix: str, mine) -> None:
    """All-gather this rank's JSON-able ``mine`` over the world (gloo) and print the list, in rank order, on
    rank 0 as ``prefix`` + JSON."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(prefix + json.dumps(every), flush=True)


def read_ranks(output: str, prefix: str) -> Optional[List]:
    """The per-rank list :func:`print_on_rank0` printed into ``output``; None when no line carries ``prefix``."""
    line = next((ln for ln in output.splitlines() if ln.startswith(prefix)), None)
    return None if line is None else json.loads(line[len(prefix):])
