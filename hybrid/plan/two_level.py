"""Two-level gradient reduction (``zero.two_level_reduce``) in the planner: how a dp group sits on the nodes.

The runtime (:meth:`hybrid.topology.Topology.enable_node_axes`) splits every dp group of ``n = l*m`` ranks
with :meth:`hybrid.topology.Nodes.split` into ``l`` ranks on each of ``m`` nodes, and reduces over two
axes: ``dp_node`` (the group's ``l`` ranks on one node) and ``dp_cross`` (the ``m`` ranks at the same
position on every node, one per node). The bytes each axis carries are
:func:`hybrid.plan.comm_volume.dp_volume`'s (``node_split``); which of them cross nodes,
:mod:`hybrid.plan.links`, from the groups below. A dp group not split evenly over the nodes is refused, in
the words of :meth:`Nodes.split`, as the ZeRO optimizer refuses it.

hpZ (``zero.hpz_partition_size``) shards stage 3's secondary weights over the same ``dp_node`` groups, so its
size must be their ``l`` (:func:`hpz_placement_problem`, the runtime's rule).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from hybrid.grid import NODE_AXES, Grid, Nodes, TopologyError
from hybrid.zero.secondary_partition import hpz_size_problem

__all__ = ["NODE_AXES", "hpz_placement_problem", "node_axis_groups", "node_split", "two_level_problem"]


@functools.lru_cache(maxsize=None)
def _splits(tp: int, dp: int, ranks_per_node: int) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    grid, nodes = Grid(tp=tp, dp=dp, pp=1), Nodes(ranks_per_node)
    return tuple(tuple(map(tuple, nodes.split(ranks))) for ranks in grid.all_groups("dp"))


def node_split(tp: int, dp: int, ranks_per_node: int) -> Tuple[int, int]:
    """``(l, m)``: the ``l`` ranks of each dp group on each of its ``m`` nodes. Raises
    :class:`hybrid.topology.TopologyError` (:meth:`Nodes.split`'s words) when a group is not split evenly."""
    first = _splits(tp, dp, ranks_per_node)[0]  # every dp group splits alike (a TP-fastest grid; tested)
    return len(first[0]), len(first)


def node_axis_groups(tp: int, dp: int, ranks_per_node: int, axis: str) -> List[List[int]]:
    """Every group of ``axis`` (``dp_node`` or ``dp_cross``), global ranks in group-rank order, as
    :meth:`~hybrid.topology.Topology.enable_node_axes` builds them."""
    if axis not in NODE_AXES:
        raise ValueError(f"not a node axis: {axis!r} (expected one of {', '.join(NODE_AXES)})")
    return Nodes(ranks_per_node).node_axis_groups(Grid(tp=tp, dp=dp, pp=1))[axis]


def two_level_problem(tp: int, dp: int, ranks_per_node: int) -> Optional[str]:
    """Why ``zero.two_level_reduce`` cannot run with this placement (None when it can): the runtime's
    refusal, ``zero.two_level_reduce: `` and :meth:`Nodes.split`'s error."""
    try:
        node_split(tp, dp, ranks_per_node)
    except TopologyError as e:
        return f"zero.two_level_reduce: {e}"
    return None


def hpz_placement_problem(size: int, tp: int, dp: int, ranks_per_node: int) -> Optional[str]:
    """Why ``zero.hpz_partition_size = size`` cannot run with this placement (None when it can, and always when
    ``size`` is 1): the dp groups must split evenly over the nodes, and ``size`` must be the ``l`` dp ranks of
    a group on each node (:func:`hybrid.zero.secondary_partition.hpz_size_problem`, the runtime's words)."""
    if size == 1:
        return None
    try:
        l, _ = node_split(tp, dp, ranks_per_node)
    except TopologyError as e:
        return f"zero.hpz_partition_size: {e}"
    return hpz_size_problem(size, l)
