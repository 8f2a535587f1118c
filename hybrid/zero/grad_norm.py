"""The global gradient L2 norm over DP partitions and TP shards.

The norm must equal the one a single process would compute on the full model.
Every gradient element is therefore counted by exactly one rank:

* **DP**: in stages 1-2 each DP rank counts its own partition; in stage 0
  every DP rank holds the same full reduced gradient, so only DP rank 0 counts.
* **TP**: a TP-partitioned parameter's shards are disjoint, so every TP rank
  counts its shard. A replicated parameter (``get_tp_meta(p).partitioned`` is
  False, e.g. a layer norm) holds the same gradient on every TP rank, so only
  TP rank 0 counts it. A key/value head that several TP ranks hold (grouped-query
  attention with more TP ranks than key/value groups) counts on the first of them.
* **PP**: each pipeline stage counts its own parameters; of a weight tied
  across the first and last stage (a flat group with ``tied`` set) only the
  first stage's copy counts.

The per-rank sums of squares are added with one all-reduce of a float64
scalar over the ``world`` axis. That one scalar also decides overflow for the
whole world: it is non-finite exactly when some rank saw an inf or NaN, so
every rank takes the same skip decision without a second collective.

The fp32 master weights are laid out as the gradients are (the same segments,
chunks and partitions), so the same rule, given the master chunks, gives the
parameter norm (``--log-params-norm``); and counting exact zeros over the same
elements gives the zeros of the whole gradient (``--log-num-zeros-in-grad``).
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch

from hybrid import param_meta
from hybrid.topology import Topology
from hybrid.zero.flat_buffer import FlatGroup


def _counted_runs(group: FlatGroup, segment: int, lo: int, hi: int, tp: int, tp_rank: int) -> List[tuple]:
    """Maximal ``(a, b)`` ranges of ``[lo, hi)`` (buffer coordinates) that this TP rank counts in the norm
    (:func:`hybrid.param_meta.norm_ranges`: partitioned parameters, less key/value heads another rank
    holds too)."""
    runs: List[list] = []
    for r in group.segments[segment].records:
        rec = group.records[r]
        for p_lo, p_hi in param_meta.norm_ranges(rec.tp_meta, rec.shape, tp, tp_rank):
            a, b = max(lo, rec.offset + p_lo), min(hi, rec.offset + p_hi)
            if a >= b:
                continue
            if runs and runs[-1][1] == a:
                runs[-1][1] = b
            else:
                runs.append([a, b])
    return [tuple(x) for x in runs]


class GradNorm:
    """Computes the squared global gradient norm from this rank's gradient chunks.

    ``chunks[g][s]`` is this rank's reduced gradient for segment ``s`` of group
    ``g`` (a view that stays valid across steps); ``part`` is which chunk of
    each segment it is (0 when a rank holds whole segments, in stage 0).
    """

    def __init__(self, groups: Sequence[FlatGroup], chunks: Sequence[Sequence[torch.Tensor]],
                 topology: Topology, part: int, counts_whole_gradient: bool):
        self.topology = topology
        self.device = groups[0].device
        # views: what the norm adds up (TP rank 0 takes whole chunks, whose alignment padding is zero and adds
        # nothing); exact_views: the parameters' elements alone, padding left out, for counting zeros
        self.views: List[torch.Tensor] = []
        self.exact_views: List[torch.Tensor] = []
        if not counts_whole_gradient and topology.dp_rank != 0:
            return  # stage 0: DP rank 0 counts for its DP group
        for group, seg_chunks in zip(groups, chunks):
            if group.tied and topology.pp_rank != 0:
                continue  # the first stage counts the tied weight
            for s, chunk in enumerate(seg_chunks):
                lo, _ = group.segments[s].chunk_range(part, group.parts)
                runs = _counted_runs(group, s, lo, lo + chunk.numel(), topology.tp_size, topology.tp_rank)
                self.exact_views += [chunk[a - lo: b - lo] for a, b in runs]
                if topology.tp_rank == 0:
                    self.views.append(chunk)
        if topology.tp_rank != 0:
            self.views = self.exact_views

    def local_sq(self) -> torch.Tensor:
        """This rank's share of the squared norm, a float64 scalar tensor."""
        return local_sq(self.views, self.device)

    def global_sq(self) -> float:
        """Squared L2 norm of the whole gradient (one all-reduce over ``world``)."""
        return world_sum(self.local_sq(), self.topology)

    def local_zeros(self) -> torch.Tensor:
        """This rank's share of the whole gradient's exact zeros, a float64 scalar tensor."""
        return local_zeros(self.exact_views, self.device)

    def global_zeros(self) -> int:
        """How many elements of the whole gradient are exactly zero (one all-reduce over ``world``)."""
        return int(world_sum(self.local_zeros(), self.topology))


def local_sq(views: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm of ``views`` together, a float64 scalar tensor (zero when there are none)."""
    if not views:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(list(views), 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def local_zeros(views: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many elements of ``views`` are exactly zero, a float64 scalar tensor (exact below 2**53)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for v in views:
        total += (v == 0).sum().to(device=device, dtype=torch.float64)
    return total


def world_sum(local: torch.Tensor, topology: Topology) -> float:
    """The sum over every rank of the scalar ``local`` (all-reduce over ``world``, on the topology's device:
    offloaded masters live on the host)."""
    total = local.reshape(1).to(topology.device)
    topology.comm.all_reduce(total, "world")
    return float(total.item())


def clip_factor(norm: float, max_norm: float) -> float:
    """The multiplier that brings a gradient of L2 ``norm`` to at most ``max_norm`` (0 disables)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
