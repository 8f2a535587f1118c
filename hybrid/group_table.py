"""This rank's process group along each axis, and the ranks in it: what the communicator needs of a topology.

:class:`AxisGroups` is all that :class:`hybrid.comm.Communicator` sees of the
job's layout: this rank, the node map (for byte accounting), and per axis the
process group, its ranks, its size and this rank's place in it.
:class:`GroupTable` is the implementation that :class:`hybrid.topology.Topology`
fills as it creates the groups; the topology answers the same questions by
asking it. No torch here: a process group is an opaque object (None for a
group of one rank, which never communicates).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Tuple

from hybrid.grid import NODE_AXES, Grid, Nodes, TopologyError, check_axis


class AxisGroups(Protocol):
    """The narrow view of a topology a communicator works through."""

    rank: int  # this process's global rank
    nodes: Nodes  # which node each rank runs on

    def group(self, axis: str) -> object:
        """The process group of this rank along ``axis`` (None when it has one rank)."""

    def size(self, axis: str) -> int:
        """The number of ranks of this rank's ``axis`` group."""

    def rank_in(self, axis: str) -> int:
        """This rank's position in its ``axis`` group."""

    def group_ranks(self, axis: str, rank: Optional[int] = None) -> List[int]:
        """Global ranks of the ``axis`` group that holds ``rank`` (default: this rank), in group-rank order."""


class GroupTable:
    """This rank's process group per axis (filled by the topology), and the ranks of every group from the
    :class:`~hybrid.grid.Grid` and :class:`~hybrid.grid.Nodes` (satisfies :class:`AxisGroups`)."""

    def __init__(self, grid: Grid, nodes: Nodes, rank: int):
        self.grid = grid
        self.nodes = nodes
        self.rank = rank
        self._groups: Dict[str, object] = {}
        self._own: Dict[str, Tuple[int, ...]] = {}  # axis -> this rank's group's ranks (_own_group)
        self._node_axes = False  # dp_node / dp_cross groups created

    def add(self, axis: str, group: object) -> None:
        """Record ``group`` as this rank's process group along ``axis``."""
        self._groups[axis] = group

    def has(self, axis: str) -> bool:
        return axis in self._groups

    def mark_node_axes(self) -> None:
        """Say that the ``dp_node`` and ``dp_cross`` groups exist (their ranks can be asked for from now on)."""
        self._node_axes = True

    @property
    def node_axes(self) -> bool:
        return self._node_axes

    def release(self) -> List[object]:
        """Forget every group and return this rank's own ones (each once, the world's aside) to destroy."""
        own = {id(g): g for axis, g in self._groups.items() if axis != "world" and g is not None}
        self._groups = {}
        return list(own.values())

    # ---- queries -------------------------------------------------------------------------------
    def group(self, axis: str) -> object:
        check_axis(axis)
        return self._groups.get(axis)

    def size(self, axis: str) -> int:
        return len(self._own_group(axis))

    def rank_in(self, axis: str) -> int:
        return self._own_group(axis).index(self.rank)

    def group_ranks(self, axis: str, rank: Optional[int] = None) -> List[int]:
        if rank is None or rank == self.rank:
            return list(self._own_group(axis))
        return self._ranks_of(axis, rank)

    def _ranks_of(self, axis: str, rank: int) -> List[int]:
        if axis not in NODE_AXES:
            return self.grid.group_ranks(axis, rank)
        if not self._node_axes:
            raise TopologyError(f"axis {axis!r} has no process group yet: call Topology.enable_node_axes() on "
                                f"every rank first")
        return next(g for g in self.nodes.node_axis_groups(self.grid)[axis] if rank in g)

    def _own_group(self, axis: str) -> Tuple[int, ...]:
        """This rank's group along ``axis``, worked out once: the communicator asks on every operation."""
        ranks = self._own.get(axis)
        if ranks is None:
            ranks = self._own[axis] = tuple(self._ranks_of(axis, self.rank))
        return ranks


class AliasedGroups:
    """``base`` (an :class:`AxisGroups`) with some axes answered by others: ``{"dp": "edp"}`` makes the ``dp``
    axis the ``edp`` groups (:meth:`hybrid.topology.Topology.expert_data_view`). :meth:`real_axis` names the
    axis that answers, for byte counts and error messages."""

    def __init__(self, base: AxisGroups, aliases: Dict[str, str]):
        self.base = base
        self.aliases = dict(aliases)
        self.rank = base.rank
        self.nodes = base.nodes
        self.grid = getattr(base, "grid", None)

    def real_axis(self, axis: str) -> str:
        return self.aliases.get(axis, axis)

    def group(self, axis: str) -> object:
        return self.base.group(self.real_axis(axis))

    def size(self, axis: str) -> int:
        return self.base.size(self.real_axis(axis))

    def rank_in(self, axis: str) -> int:
        return self.base.rank_in(self.real_axis(axis))

    def group_ranks(self, axis: str, rank: Optional[int] = None) -> List[int]:
        return self.base.group_ranks(self.real_axis(axis), rank)

    def has(self, axis: str) -> bool:
        return self.base.has(self.real_axis(axis))

    def add(self, axis: str, group: object) -> None:
        self.base.add(self.real_axis(axis), group)

    @property
    def node_axes(self) -> bool:
        return False

    def release(self) -> List[object]:
        return []
