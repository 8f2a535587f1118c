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

A quantized reduce-scatter (``zero.quantized_gradients``) is an all-to-all
instead: a rank sends one packed chunk straight to every peer of its group,
so what leaves a node is the chunk times, summed over the node's ranks, each
rank's peers on other nodes. At DP=4 on two nodes of two every rank has two
peers on the other node: a node sends four chunks off it per call.

Two-level reduction (``zero.two_level_reduce``, :mod:`hybrid.plan.two_level`)
reduces over the ``dp_node`` and ``dp_cross`` axes, whose groups are the dp
group's ranks on one node and its ranks at one position on every node: the
``dp_node`` rings never cross, and the ``dp_cross`` ring (one rank per node)
crosses on every hop. At DP=4 on two nodes of two: ``dp_node`` 0→1→0 and
2→3→2, ``dp_cross`` 0→2→0 and 1→3→1.

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
from hybrid.plan.two_level import NODE_AXES, node_axis_groups, node_split
from hybrid.grid import Grid, Nodes


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
    """``tp × dp`` ranks on ``nodes`` nodes of ``ranks_per_node`` ranks (pp = 1); ``ep``: the expert-parallel
    size, whose groups (``ep`` consecutive dp ranks, :mod:`hybrid.grid`) the ``ep`` and ``edp`` axes follow."""

    tp: int
    dp: int
    nodes: int
    ranks_per_node: int
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "nodes", "ranks_per_node", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LinkError(f"{name} must be a positive integer, got {value!r}")
        if self.tp * self.dp != self.nodes * self.ranks_per_node:
            raise LinkError(f"tp × dp = {self.tp} × {self.dp} ranks do not fill {self.nodes} node(s) of "
                            f"{self.ranks_per_node}")

    @property
    def grid(self) -> Grid:
        return Grid(tp=self.tp, dp=self.dp, pp=1, ep=self.ep)

    def group_size(self, axis: str) -> int:
        if axis in NODE_AXES:
            return self.node_split[NODE_AXES.index(axis)]
        return self.grid.size(axis)

    @property
    def node_split(self) -> Tuple[int, int]:
        """``(l, m)``: each dp group's ``l`` ranks on each of its ``m`` nodes (the sizes of the ``dp_node`` and
        ``dp_cross`` axes). :class:`hybrid.topology.TopologyError` when a dp group is not split evenly."""
        return node_split(self.tp, self.dp, self.ranks_per_node)

    def crossing_senders(self, axis: str) -> Tuple[int, ...]:
        """Per node, how many of its ranks send to a ring successor on another node in a collective over
        ``axis`` (all groups of the axis run at once)."""
        return _crossing_senders(self.tp, self.dp, self.ranks_per_node, axis, self.ep)

    def remote_peers(self, axis: str) -> Tuple[int, ...]:
        """Per node, summed over its ranks, the peers of each rank's ``axis`` group that sit on other nodes:
        the chunks a node sends off it in one all-to-all over ``axis``."""
        return _peer_counts(self.tp, self.dp, self.ranks_per_node, axis, self.ep)[0]

    def local_peers(self, axis: str) -> int:
        """The most peers of one rank's ``axis`` group on the rank's own node: the chunks a rank sends over
        its own link in one all-to-all."""
        return _peer_counts(self.tp, self.dp, self.ranks_per_node, axis, self.ep)[1]


def _groups(tp: int, dp: int, ranks_per_node: int, axis: str, ep: int = 1):
    """Every group of ``axis``, global ranks in group-rank order (the node axes: :mod:`hybrid.plan.two_level`)."""
    if axis in NODE_AXES:
        return node_axis_groups(tp, dp, ranks_per_node, axis)
    return Grid(tp=tp, dp=dp, pp=1, ep=ep).all_groups(axis)


@functools.lru_cache(maxsize=None)
def _crossing_senders(tp: int, dp: int, ranks_per_node: int, axis: str, ep: int = 1) -> Tuple[int, ...]:
    nodes = Nodes(ranks_per_node)
    counts = [0] * (tp * dp // ranks_per_node)
    for ring in _groups(tp, dp, ranks_per_node, axis, ep):
        for rank in ring:
            if nodes.ring_hop_crosses(ring, rank):
                counts[nodes.node_of(rank)] += 1
    return tuple(counts)


@functools.lru_cache(maxsize=None)
def _peer_counts(tp: int, dp: int, ranks_per_node: int, axis: str, ep: int = 1) -> Tuple[Tuple[int, ...], int]:
    """(per node, its ranks' group peers on other nodes, summed; the most group peers one rank has on its node)."""
    nodes = Nodes(ranks_per_node)
    remote = [0] * (tp * dp // ranks_per_node)
    local = 0
    for group in _groups(tp, dp, ranks_per_node, axis, ep):
        for rank in group:
            peers = [r for r in group if r != rank]
            away = sum(nodes.node_of(r) != nodes.node_of(rank) for r in peers)
            remote[nodes.node_of(rank)] += away
            local = max(local, len(peers) - away)
    return tuple(remote), local


@dataclasses.dataclass(frozen=True)
class CollectiveLinks:
    """One ``"op/axis"`` entry of a step's collectives, split by link.

    ``wire_bytes``: what one rank sends (ring model, summed over calls);
    ``steps``: ring steps over all calls; ``inter_bytes_by_node``: what each
    node sends off it; ``intra_bytes_per_rank``: what a rank whose ring hop
    stays inside its node sends over its own link (0 when no hop does).
    An all-to-all entry (one with ``peer_bytes``) counts ``n - 1`` steps per
    call, a message to each peer, like the ring reduce-scatter it replaces;
    its ``intra_bytes_per_rank`` is what the rank with the most peers on its
    own node sends to them.
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
    that stay inside nodes and those each node sends off it: rings by their crossing hops, all-to-alls (the
    entries with ``peer_bytes``, bytes sent to each peer) by the peers on other nodes."""
    split = {}
    for name, entry in report.items():
        op, axis = name.split("/", 1)  # "op/tp/2": the axis is "tp/2"
        n = placement.group_size(axis)
        wire = float(entry["wire_bytes"])
        if "peer_bytes" in entry:  # an all-to-all: every peer gets its chunk straight from the rank
            each = float(entry["peer_bytes"])
            split[name] = CollectiveLinks(name=name, group_size=n, steps=int(entry["calls"]) * (n - 1),
                                          wire_bytes=wire,
                                          inter_bytes_by_node=tuple(each * c for c in placement.remote_peers(axis)),
                                          intra_bytes_per_rank=each * placement.local_peers(axis))
            continue
        senders = placement.crossing_senders(axis)
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
