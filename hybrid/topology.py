"""Process-group topology: the one place that knows how ranks form a grid.

Ranks are laid out on a (pp, dp, tp) grid with TP innermost, so that the
ranks of one TP group are adjacent (they share a node and its fast links)::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

The grid arithmetic (:class:`Grid`) is pure and needs no processes.
:class:`Topology` builds the torch process groups for every axis and carries
the :class:`~hybrid.comm.Communicator` that every collective goes through.

Axes:
    ``tp``    tensor-model parallel (layers split across these ranks)
    ``dp``    data parallel (ZeRO partitions state across these ranks)
    ``pp``    pipeline parallel (stages)
    ``mp``    model parallel = tp × pp (all ranks that hold one model replica)
    ``embed`` the first and the last pipeline stage at one (tp, dp) position: they hold the two copies of
              tied input and output embeddings (a rank of a middle stage, or of a job with pp=1, is alone)
    ``world`` every rank
    ``tp/k``  ``k`` consecutive ranks of one TP group (:meth:`Topology.enable_tp_subgroups`): the ranks
              that hold the same replicated piece of a layer, e.g. one key/value head of grouped-query
              attention when there are more TP ranks than key/value heads
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hybrid.comm import Communicator
from hybrid.layout import ParallelLayout

AXES = ("tp", "dp", "pp", "mp", "embed", "world")
# The data-parallel group split by node (see Topology.enable_node_axes): the ranks of this rank's dp group on
# its own node, and the ranks of its dp group at the same position on every node.
NODE_AXES = ("dp_node", "dp_cross")


def tp_subaxis(size: int) -> str:
    """The axis name of the groups of ``size`` consecutive ranks of a TP group."""
    return f"tp/{size}"


def _tp_sub_size(axis: str) -> Optional[int]:
    """``k`` for a ``tp/k`` axis, else None."""
    if isinstance(axis, str) and axis.startswith("tp/") and axis[3:].isdigit() and int(axis[3:]) >= 1:
        return int(axis[3:])
    return None


class TopologyError(ValueError):
    """A parallel layout that cannot be built from the given sizes."""


@dataclasses.dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class Grid:
    """Pure rank arithmetic for a world of ``tp * dp * pp`` ranks."""

    tp: int
    dp: int
    pp: int

    @classmethod
    def build(cls, world_size: int, tp: int = 1, pp: int = 1, dp: Optional[int] = None) -> "Grid":
        """Validate the sizes and infer ``dp = world / (tp * pp)`` when not given."""
        for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")
        if world_size % (tp * pp) != 0:
            raise TopologyError(
                f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"choose tensor-model-parallel and pipeline sizes whose product divides the "
                f"number of processes"
            )
        inferred = world_size // (tp * pp)
        if dp is None:
            dp = inferred
        elif not isinstance(dp, int) or dp < 1:
            raise TopologyError(f"dp must be an integer >= 1, got {dp!r}")
        elif dp != inferred:
            raise TopologyError(
                f"tp*dp*pp = {tp}*{dp}*{pp} = {tp * dp * pp} does not equal the world size "
                f"{world_size}; leave dp unset to infer it ({inferred})"
            )
        return cls(tp=tp, dp=dp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def size(self, axis: str) -> int:
        _check_axis(axis)
        sub = _tp_sub_size(axis)
        if sub is not None:
            return self._check_sub(sub)
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp, "mp": self.tp * self.pp,
                "embed": min(self.pp, 2), "world": self.world_size}[axis]

    def rank_of(self, coord: Coord) -> int:
        for name, value, size in (("tp", coord.tp, self.tp), ("dp", coord.dp, self.dp),
                                  ("pp", coord.pp, self.pp)):
            if not 0 <= value < size:
                raise TopologyError(f"{name} coordinate {value} is outside [0, {size})")
        return coord.tp + self.tp * (coord.dp + self.dp * coord.pp)

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside the world [0, {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coord(tp=tp_rank, dp=dp_rank, pp=pp_rank)

    def rank_in(self, axis: str, rank: int) -> int:
        """The position of global ``rank`` inside its group along ``axis``."""
        return self.group_ranks(axis, rank).index(rank)

    def group_ranks(self, axis: str, rank: int) -> List[int]:
        """Global ranks of the ``axis`` group that contains ``rank``, in group-rank order."""
        _check_axis(axis)
        c = self.coord_of(rank)
        if axis == "world":
            return list(range(self.world_size))
        if axis == "tp":
            return [self.rank_of(Coord(t, c.dp, c.pp)) for t in range(self.tp)]
        sub = _tp_sub_size(axis)
        if sub is not None:
            first = c.tp // self._check_sub(sub) * sub
            return [self.rank_of(Coord(t, c.dp, c.pp)) for t in range(first, first + sub)]
        if axis == "dp":
            return [self.rank_of(Coord(c.tp, d, c.pp)) for d in range(self.dp)]
        if axis == "pp":
            return [self.rank_of(Coord(c.tp, c.dp, p)) for p in range(self.pp)]
        if axis == "embed":
            if self.pp == 1 or 0 < c.pp < self.pp - 1:
                return [rank]
            return [self.rank_of(Coord(c.tp, c.dp, 0)), self.rank_of(Coord(c.tp, c.dp, self.pp - 1))]
        # mp: every (tp, pp) pair at this dp coordinate, tp innermost.
        return [self.rank_of(Coord(t, c.dp, p)) for p in range(self.pp) for t in range(self.tp)]

    def _check_sub(self, size: int) -> int:
        if self.tp % size:
            raise TopologyError(f"axis {tp_subaxis(size)!r}: {size} does not divide the tensor-parallel size {self.tp}")
        return size

    def all_groups(self, axis: str) -> List[List[int]]:
        """Every group along ``axis``, each as its ranks, ordered by their lowest rank."""
        seen: Dict[int, List[int]] = {}
        for r in range(self.world_size):
            ranks = self.group_ranks(axis, r)
            seen.setdefault(ranks[0], ranks)
        return [seen[k] for k in sorted(seen)]


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Which node each rank runs on: consecutive blocks of ``ranks_per_node`` ranks.

    torchrun numbers ranks node by node (node k holds ranks k*R .. k*R+R-1),
    and the grid puts TP innermost, so a TP group stays on one node exactly
    when its size divides R.
    """

    ranks_per_node: int

    @classmethod
    def build(cls, world_size: int, ranks_per_node: Optional[int] = None) -> "Nodes":
        """``ranks_per_node`` given, else torchrun's ``LOCAL_WORLD_SIZE``, else one node holds every rank."""
        source = "ranks_per_node"
        if ranks_per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            ranks_per_node, source = (int(env), "LOCAL_WORLD_SIZE") if env else (world_size, "")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node:
            raise TopologyError(f"the world size {world_size} is not a whole number of nodes of {ranks_per_node!r} "
                                f"ranks ({source}); start the same number of processes on every node")
        return cls(ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def spans_nodes(self, ranks: List[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def ring_hop_crosses(self, ranks: Sequence[int], rank: int) -> bool:
        """Whether ``rank``'s sends leave its node in a ring collective over ``ranks``.

        The ring model, written once (the communicator counts bytes with it, the
        planner predicts with it): the ranks in group-rank order, each sending to
        the next and the last to the first.
        """
        successor = ranks[(list(ranks).index(rank) + 1) % len(ranks)]
        return self.node_of(successor) != self.node_of(rank)

    def split(self, ranks: Sequence[int]) -> List[List[int]]:
        """``ranks`` (one group, in group-rank order) as one list per node, nodes in order.

        Raises :class:`TopologyError` unless every node holds the same number of them, in consecutive group
        ranks: the shape a two-level collective needs (a reduction inside each node, then across nodes).
        """
        per_node: Dict[int, List[int]] = {}
        for r in ranks:
            per_node.setdefault(self.node_of(r), []).append(r)
        lists = [per_node[n] for n in sorted(per_node)]
        if len({len(lst) for lst in lists}) != 1 or [r for lst in lists for r in lst] != list(ranks):
            raise TopologyError(f"the group {list(ranks)} is not split evenly over nodes of {self.ranks_per_node} "
                                f"ranks (per node: {lists}); a two-level reduction needs the same number of its "
                                f"ranks on every node")
        return lists

    def node_axis_groups(self, grid: Grid) -> Dict[str, List[List[int]]]:
        """Every group of the ``dp_node`` and ``dp_cross`` axes, global ranks in group-rank order: for each dp
        group (:meth:`split`), its ranks on each node, and its ranks at each position, one per node."""
        groups: Dict[str, List[List[int]]] = {axis: [] for axis in NODE_AXES}
        for ranks in grid.all_groups("dp"):
            per_node = self.split(ranks)
            groups["dp_node"] += per_node
            groups["dp_cross"] += [list(g) for g in zip(*per_node)]
        return groups

    def check_tp_groups(self, grid: Grid, allowed: bool, warn: bool) -> None:
        """Refuse TP groups that cross nodes (every layer's collectives would ride the inter-node link),
        unless ``allowed``; then say it once (``warn``) and go on."""
        crossing = [g for g in grid.all_groups("tp") if self.spans_nodes(g)]
        if not crossing:
            return
        fits = [d for d in range(1, self.ranks_per_node + 1) if self.ranks_per_node % d == 0]
        message = (f"tensor-parallel groups of {grid.tp} ranks span nodes of {self.ranks_per_node} ranks (e.g. "
                   f"ranks {crossing[0]}), so every layer's collectives cross the inter-node link; use a "
                   f"tensor-parallel size that divides the ranks per node ({', '.join(map(str, fits))})")
        if not allowed:
            raise TopologyError(message + ", or allow it explicitly (--allow-tp-across-nodes)")
        if warn:
            warnings.warn("allowed by --allow-tp-across-nodes: " + message, stacklevel=3)


def _check_axis(axis: str) -> None:
    if axis not in AXES and axis not in NODE_AXES and _tp_sub_size(axis) is None:
        raise TopologyError(f"unknown axis {axis!r}; expected one of {', '.join(AXES + NODE_AXES)} or "
                            f"tp/k")


class Topology:
    """The process groups of a parallel layout, and the communicator over them.

    ``Topology(tp, pp=1, dp=None)`` must be constructed by every rank in the
    same order, after :func:`hybrid.init_distributed` (or with a world of one
    process, where no process group is needed). Pass it explicitly to every
    component that communicates.

    ``timeout_s`` bounds every wait of the communicator and is given to every
    process group created here; without it they keep the backend's default
    (the world group keeps what :func:`hybrid.init_distributed` set).

    ``ranks_per_node`` (default: torchrun's ``LOCAL_WORLD_SIZE``, else one
    node) places ranks on nodes (:class:`Nodes`). A TP group that would span
    nodes is refused unless ``allow_tp_across_nodes`` (a Megatron-style
    baseline over slow links wants exactly that), and the communicator counts
    the bytes each rank sends off its node.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: Optional[int] = None, *,
                 timeout_s: Optional[float] = None, ranks_per_node: Optional[int] = None,
                 allow_tp_across_nodes: bool = False):
        if dist.is_available() and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size, rank = 1, 0
        self.grid = Grid.build(world_size, tp=tp, pp=pp, dp=dp)
        self.rank = rank
        self.coord = self.grid.coord_of(rank)
        self.nodes = Nodes.build(world_size, ranks_per_node)
        self.nodes.check_tp_groups(self.grid, allow_tp_across_nodes, warn=rank == 0)
        self._groups: Dict[str, object] = {}
        self._own_groups: Dict[str, Tuple[int, ...]] = {}  # axis -> this rank's group (_own_group)
        self._node_axes = False  # dp_node / dp_cross groups created (enable_node_axes)
        self.comm = Communicator(self, timeout_s=timeout_s)
        if world_size > 1:
            self._build_groups()
            # A script that never calls close() (the few-lines engine path) still tears down in order:
            # atexit runs this before hybrid.distributed's hook that destroys the default group.
            atexit.register(self.close)

    @classmethod
    def local(cls, pp: int = 1, pp_rank: int = 0) -> "Topology":
        """A one-process topology that never communicates, even inside a larger world.

        Used for single-process references (tests, conversion tools). ``pp`` and
        ``pp_rank`` make it stand in for stage ``pp_rank`` of a ``pp``-stage
        pipeline (TP and DP 1): an offline tool builds that stage's share of a
        model from it, on the meta device, to learn its parameters' names and
        order. It still never communicates: run nothing through it.
        """
        if not isinstance(pp, int) or pp < 1 or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
            raise TopologyError(f"Topology.local: pp_rank {pp_rank!r} must lie in [0, pp) with pp >= 1 "
                                f"(got pp={pp!r})")
        topo = cls.__new__(cls)
        topo.grid = Grid(tp=1, dp=1, pp=pp)
        topo.rank = pp_rank
        topo.coord = Coord(0, 0, pp_rank)
        topo.nodes = Nodes(ranks_per_node=1)
        topo._groups = {}
        topo._own_groups = {}
        topo._node_axes = False
        topo.comm = Communicator(topo, timeout_s=None)
        return topo

    def _build_groups(self) -> None:
        # new_group is collective over the whole world: every rank creates every
        # group in the same order and keeps only the ones it belongs to. Without
        # an explicit timeout a group gets the backend's default (30 minutes for
        # gloo), not the one the job configured: give it the communicator's.
        for axis in ("tp", "dp", "pp", "mp", "embed"):
            for ranks in self.grid.all_groups(axis):
                group = dist.new_group(ranks, timeout=self.comm.timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self._groups[axis] = group
        self._groups["world"] = dist.group.WORLD

    def enable_node_axes(self) -> None:
        """Create the process groups of the ``dp_node`` and ``dp_cross`` axes (collective over the world).

        ``dp_node``: this rank's dp group members on its own node; ``dp_cross``:
        the members at this rank's position within their node, one per node, in
        node order. Every rank must call it, in the same order relative to other
        group creation (the ZeRO optimizer does when ``zero.two_level_reduce``
        is set). Raises :class:`TopologyError` when a dp group is not split
        evenly over nodes. Calling it again does nothing.
        """
        if self._node_axes:
            return
        groups = self.nodes.node_axis_groups(self.grid)
        for axis in NODE_AXES:
            for ranks in groups[axis]:
                if self.world_size > 1:
                    group = dist.new_group(ranks, timeout=self.comm.timeout) if len(ranks) > 1 else None
                    if self.rank in ranks:
                        self._groups[axis] = group
        self._node_axes = True

    def enable_tp_subgroups(self, size: int) -> str:
        """Create the process groups of axis ``tp/size`` (``size`` consecutive ranks of each TP group) and
        return its name. Collective over the world: every rank calls it, in the same order relative to other
        group creation (building a model does, when it needs one). Each group gets the communicator's
        timeout. Calling it again for the same size does nothing.
        """
        axis = tp_subaxis(size)
        self.grid.size(axis)  # refuses a size that does not divide tp
        if axis in self._groups or size == 1 or self.world_size == 1:
            return axis
        if size == self.tp_size:  # the TP group itself
            self._groups[axis] = self._groups.get("tp")
            return axis
        for tp_ranks in self.grid.all_groups("tp"):
            for i in range(0, len(tp_ranks), size):
                ranks = tp_ranks[i:i + size]
                group = dist.new_group(ranks, timeout=self.comm.timeout)
                if self.rank in ranks:
                    self._groups[axis] = group
        return axis

    def _node_axis_ranks(self, axis: str, rank: int) -> List[int]:
        if not self._node_axes:
            raise TopologyError(f"axis {axis!r} has no process group yet: call Topology.enable_node_axes() on "
                                f"every rank first")
        return next(g for g in self.nodes.node_axis_groups(self.grid)[axis] if rank in g)

    def close(self) -> None:
        """Wait for this rank's in-flight operations, then destroy its per-axis process groups.

        Teardown order matters: a process that exits with collective work in
        flight, or with process groups still alive, can abort in the backend's
        destructors ("terminate called without an active exception") after its
        results were written. The default (world) group is destroyed afterwards
        by :func:`hybrid.distributed.destroy_distributed`. Calling it again does nothing.
        """
        try:
            self.comm.drain()
        finally:
            own = {id(g): g for axis, g in self._groups.items() if axis != "world" and g is not None}
            self._groups = {}
            if dist.is_available() and dist.is_initialized():
                for group in own.values():
                    dist.destroy_process_group(group)
            atexit.unregister(self.close)

    # ---- queries -----------------------------------------------------------------
    def group(self, axis: str):
        """The torch process group of this rank along ``axis`` (None when its size is 1)."""
        _check_axis(axis)
        return self._groups.get(axis)

    def size(self, axis: str) -> int:
        return len(self._own_group(axis))

    def rank_in(self, axis: str) -> int:
        return self._own_group(axis).index(self.rank)

    def group_ranks(self, axis: str, rank: Optional[int] = None) -> List[int]:
        """Global ranks of the ``axis`` group that holds ``rank`` (default: this rank), in group-rank order."""
        if rank is None or rank == self.rank:
            return list(self._own_group(axis))
        return self._ranks_of(axis, rank)

    def _ranks_of(self, axis: str, rank: int) -> List[int]:
        return self._node_axis_ranks(axis, rank) if axis in NODE_AXES else self.grid.group_ranks(axis, rank)

    def _own_group(self, axis: str) -> Tuple[int, ...]:
        """This rank's group along ``axis``, worked out once: the communicator asks on every operation."""
        ranks = self._own_groups.get(axis)
        if ranks is None:
            ranks = self._own_groups[axis] = tuple(self._ranks_of(axis, self.rank))
        return ranks

    def coord_of(self, rank: int) -> Coord:
        return self.grid.coord_of(rank)

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    # Short names used throughout the library.
    tp_size = property(lambda self: self.grid.tp)
    dp_size = property(lambda self: self.grid.dp)
    pp_size = property(lambda self: self.grid.pp)
    tp_rank = property(lambda self: self.coord.tp)
    dp_rank = property(lambda self: self.coord.dp)
    pp_rank = property(lambda self: self.coord.pp)

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: its GPU when it has one and its collectives take CUDA tensors (an
        NCCL group, or one process with no group at all: ``torchrun --nproc-per-node 1`` creates none), else
        the CPU (no GPU, or a gloo group)."""
        if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def layout(self, zero_stage: int = 0, precision: str = "fp32") -> ParallelLayout:
        """This job's :class:`~hybrid.layout.ParallelLayout` with the given ZeRO stage and precision (validated)."""
        return ParallelLayout(tp=self.tp_size, dp=self.dp_size, pp=self.pp_size, zero_stage=zero_stage,
                              precision=precision)

    def describe(self) -> str:
        return (f"world={self.world_size} tp={self.tp_size} dp={self.dp_size} "
                f"pp={self.pp_size} rank={self.rank} coord=(tp={self.tp_rank}, "
                f"dp={self.dp_rank}, pp={self.pp_rank})")

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"
