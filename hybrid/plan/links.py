"""The links of a cluster, where ranks sit on its nodes, and which bytes of a step cross between nodes.

Ranks are numbered TP fastest, then DP (:class:`hybrid.topology.Grid`), and
node ``k`` holds ranks ``k*R .. k*R+R-1`` (:class:`hybrid.topology.Nodes`), so
a TP group stays on one node when its size divides ``R`` and crosses nodes
when it is wider (the Megatron-style baseline: TP=4 over 2 nodes of 2).

Which bytes cross is the runtime communicator's model (the docstring of
:meth:`hybrid.comm.Communicator.report`): a collective over a group is a ring
in group-rank order, each rank sending to the next and the last to the first;
what a rank sends crosses the node boundary when the next rank of its ring
sits on another node. Examples at two nodes of two ranks: DP=4 is the ring
0→1→2→3→0, which crosses at 1→2 and 3→0 (one rank per node sends off it); at
TP=2×DP=2 the DP rings are 0→2→0 and 1→3→1, so every rank's DP bytes cross
(both ranks of a node send off it), and TP stays on the node.

Every rank of a node shares the node's one link to the others, so the time of
inter-node traffic is what the whole *node* sends off it over that link
(:class:`LinkSpec`); a hop inside a node uses the sending GPU's own link.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, Tuple

from hybrid.plan.comm_volume import Report, ring_steps
from hybrid.topology import Grid, Nodes


class LinkError(ValueError):
    """Link speeds or a placement that cannot describe a machine."""


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """How fast ranks reach each other.

    ``intra_bytes_per_s``: what one GPU sends to the next GPU of its node
    (NVLink); ``math.inf`` when that link is never the bottleneck.
    ``inter_bytes_per_s_per_node``: what one node sends to the other nodes
    over its link, shared by all of its ranks (8 × 100 Gb/s InfiniBand is
    100e9 bytes/s per node).
    ``latency_s``: the fixed cost of one ring step, one message from each rank
    to the next, paid on the critical path by every step of every collective
    call: an all-reduce over ``n`` ranks takes ``2(n-1)`` steps, a
    reduce-scatter or all-gather ``n-1`` (:func:`hybrid.plan.comm_volume.ring_steps`).
    """

    intra_bytes_per_s: float
    inter_bytes_per_s_per_node: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("intra_bytes_per_s", "inter_bytes_per_s_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise LinkError(f"LinkSpec.{name} must be > 0 bytes/s (math.inf: never the bottleneck), "
                                f"got {value!r}")
        if not (isinstance(self.latency_s, (int, float)) and 0 <= self.latency_s < math.inf):
            raise LinkError(f"LinkSpec.latency_s must be a finite number of seconds >= 0, got {self.latency_s!r}")


@dataclasses.dataclass(frozen=True)
class HostLink:
    """Offload's costs per GPU: ``bytes_per_s`` to host memory, and the CPU Adam step's parameters per second
    (the node's CPU rate divided among its GPUs)."""

    bytes_per_s: float
    cpu_adam_params_per_s: float


@dataclasses.dataclass(frozen=True)
class Placement:
    """``tp × dp`` ranks on ``nodes`` nodes of ``ranks_per_node`` ranks (pp = 1)."""

    tp: int
    dp: int
    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LinkError(f"{name} must be a positive integer, got {value!r}")
        if self.tp * self.dp != self.nodes * self.ranks_per_node:
            raise LinkError(f"tp × dp = {self.tp} × {self.dp} ranks do not fill {self.nodes} node(s) of "
                            f"{self.ranks_per_node}")

    @property
    def grid(self) -> Grid:
        return Grid(tp=self.tp, dp=self.dp, pp=1)

    def group_size(self, axis: str) -> int:
        return self.grid.size(axis)

    def crossing_senders(self, axis: str) -> Tuple[int, ...]:
        """Per node, how many of its ranks send to a ring successor on another node in a collective over
        ``axis`` (all groups of the axis run at once)."""
        return _crossing_senders(self.tp, self.dp, self.ranks_per_node, axis)


@functools.lru_cache(maxsize=None)
def _crossing_senders(tp: int, dp: int, ranks_per_node: int, axis: str) -> Tuple[int, ...]:
    grid, nodes = Grid(tp=tp, dp=dp, pp=1), Nodes(ranks_per_node)
    counts = [0] * (grid.world_size // ranks_per_node)
    placed = set()
    for first in range(grid.world_size):
        if first in placed:
            continue
        ring = grid.group_ranks(axis, first)
        placed.update(ring)
        for rank in ring:
            if nodes.ring_hop_crosses(ring, rank):
                counts[nodes.node_of(rank)] += 1
    return tuple(counts)


@dataclasses.dataclass(frozen=True)
class CollectiveLinks:
    """One ``"op/axis"`` entry of a step's collectives, split by link.

    ``wire_bytes``: what one rank sends (ring model, summed over calls);
    ``steps``: ring steps over all calls; ``inter_bytes_by_node``: what each
    node sends off it; ``intra_bytes_per_rank``: what a rank whose ring hop
    stays inside its node sends over its own link (0 when no hop does).
    """

    name: str
    group_size: int
    steps: int
    wire_bytes: float
    inter_bytes_by_node: Tuple[float, ...]
    intra_bytes_per_rank: float

    @property
    def crosses_nodes(self) -> bool:
        return any(b > 0 for b in self.inter_bytes_by_node)

    @property
    def inter_bytes_per_node(self) -> float:
        """The busiest node's bytes off the node (every node's, when the layout is symmetric)."""
        return max(self.inter_bytes_by_node, default=0.0)


def split_by_link(report: Report, placement: Placement) -> Dict[str, CollectiveLinks]:
    """Each collective of ``report`` (:func:`hybrid.plan.comm_volume.step_volume`) split into the bytes
    that stay inside nodes and those each node sends off it."""
    split = {}
    for name, entry in report.items():
        op, axis = name.split("/")
        n = placement.group_size(axis)
        senders = placement.crossing_senders(axis)
        wire = float(entry["wire_bytes"])
        some_hop_inside = any(c < placement.ranks_per_node for c in senders)
        split[name] = CollectiveLinks(name=name, group_size=n, steps=int(entry["calls"]) * ring_steps(op, n),
                                      wire_bytes=wire, inter_bytes_by_node=tuple(wire * c for c in senders),
                                      intra_bytes_per_rank=wire if some_hop_inside else 0.0)
    return split


def link_seconds(collective: CollectiveLinks, link: LinkSpec) -> float:
    """Seconds of one step's calls of ``collective``: a ring moves in lockstep, so each step waits for its
    slowest hop (the busiest node's link, or a GPU's link inside a node), plus ``latency_s`` per ring step."""
    inter = collective.inter_bytes_per_node / link.inter_bytes_per_s_per_node
    intra = collective.intra_bytes_per_rank / link.intra_bytes_per_s
    return max(inter, intra) + link.latency_s * collective.steps
