"""Process-group topology: the torch process groups of the rank grid, and the communicator over them.

The grid itself (the axes, their order, the rank formula, the node map and the
rule that the axis sizes multiply to the world size) is plain data in
:mod:`hybrid.grid`; this module re-exports its names, so ``from
hybrid.topology import Grid, Coord, Nodes, TopologyError`` keeps working.
Ranks are laid out with TP innermost, so that the ranks of one TP group are
adjacent (they share a node and its fast links)::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

:class:`Topology` builds the torch process groups for every axis into a
:class:`~hybrid.group_table.GroupTable` and hands that table, not itself, to
the :class:`~hybrid.comm.Communicator` that every collective goes through.
The axes are listed in :mod:`hybrid.grid`; the topology builds groups for
``tp``, ``dp``, ``pp``, ``mp``, ``embed``, ``world``, ``ep``, ``edp``, ``cp``
and ``dp_cp``, for ``dp_node`` and ``dp_cross`` on request
(:meth:`Topology.enable_node_axes`), and for ``tp/k``
(:meth:`Topology.enable_tp_subgroups`). Context parallelism (``cp``) splits
each sequence over the ``cp`` ranks between ``tp`` and ``dp`` in the rank
order; the ``dp * cp`` ranks that hold the same parameters are ``dp_cp``.

Expert parallelism (``ep``) adds no ranks: the ``ep`` consecutive ranks of a
``dp`` group share out the experts of every MoE layer, and the ``dp / ep``
ranks at the same ``ep`` position (``edp``, expert data parallel) hold the
same experts. :meth:`Topology.expert_data_view` is this topology seen by the
optimizer of the expert parameters: its ``dp`` axis is ``edp``.
"""

from __future__ import annotations

import atexit
from typing import List, Optional

import torch
import torch.distributed as dist

from hybrid.comm import Communicator
from hybrid.grid import AXES, NODE_AXES, Coord, Grid, Nodes, TopologyError, WorldSizeError, tp_subaxis
from hybrid.group_table import AliasedGroups, GroupTable
from hybrid.layout import ParallelLayout

# The grid's names, read from here by the code written before hybrid.grid existed.
__all__ = ["AXES", "NODE_AXES", "Coord", "Grid", "Nodes", "Topology", "TopologyError", "WorldSizeError",
           "tp_subaxis"]


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
                 allow_tp_across_nodes: bool = False, ep: int = 1, cp: int = 1):
        if dist.is_available() and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size, rank = 1, 0
        self.grid = Grid.build(world_size, tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
        self.rank = rank
        self.coord = self.grid.coord_of(rank)
        self.nodes = Nodes.build(world_size, ranks_per_node)
        self.nodes.check_tp_groups(self.grid, allow_tp_across_nodes, warn=rank == 0)
        self.groups = GroupTable(self.grid, self.nodes, rank)
        self.comm = Communicator(self.groups, timeout_s=timeout_s)
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
        topo.groups = GroupTable(topo.grid, topo.nodes, topo.rank)
        topo.comm = Communicator(topo.groups, timeout_s=None)
        return topo

    def _build_groups(self) -> None:
        # new_group is collective over the whole world: every rank creates every
        # group in the same order and keeps only the ones it belongs to. Without
        # an explicit timeout a group gets the backend's default (30 minutes for
        # gloo), not the one the job configured: give it the communicator's.
        optional = (("cp", "dp_cp") if self.grid.cp > 1 else ()) + (("ep", "edp") if self.grid.ep > 1 else ())
        for axis in ("tp", "dp", "pp", "mp", "embed") + optional:
            for ranks in self.grid.all_groups(axis):
                group = dist.new_group(ranks, timeout=self.comm.timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self.groups.add(axis, group)
        if self.grid.cp == 1:  # no context parallelism: each rank holds whole sequences, its dp group the copies
            self.groups.add("cp", None)
            self.groups.add("dp_cp", self.groups.group("dp"))
        if self.grid.ep == 1 and self.grid.cp == 1:  # every rank holds every expert, its dp group their copies
            self.groups.add("ep", None)
            self.groups.add("edp", self.groups.group("dp"))
        elif self.grid.ep == 1:  # the experts' copies are every rank that holds the same parameters
            self.groups.add("ep", None)
            self.groups.add("edp", self.groups.group("dp_cp"))
        self.groups.add("world", dist.group.WORLD)

    def enable_node_axes(self) -> None:
        """Create the process groups of the ``dp_node`` and ``dp_cross`` axes (collective over the world).

        ``dp_node``: this rank's dp group members on its own node; ``dp_cross``:
        the members at this rank's position within their node, one per node, in
        node order. Every rank must call it, in the same order relative to other
        group creation (the ZeRO optimizer does when ``zero.two_level_reduce``
        is set). Raises :class:`TopologyError` when a dp group is not split
        evenly over nodes. Calling it again does nothing.
        """
        if self.groups.node_axes:
            return
        groups = self.nodes.node_axis_groups(self.grid)
        for axis in NODE_AXES:
            for ranks in groups[axis]:
                if self.world_size > 1:
                    group = dist.new_group(ranks, timeout=self.comm.timeout) if len(ranks) > 1 else None
                    if self.rank in ranks:
                        self.groups.add(axis, group)
        self.groups.mark_node_axes()

    def enable_tp_subgroups(self, size: int) -> str:
        """Create the process groups of axis ``tp/size`` (``size`` consecutive ranks of each TP group) and
        return its name. Collective over the world: every rank calls it, in the same order relative to other
        group creation (building a model does, when it needs one). Each group gets the communicator's
        timeout. Calling it again for the same size does nothing.
        """
        axis = tp_subaxis(size)
        self.grid.size(axis)  # refuses a size that does not divide tp
        if self.groups.has(axis) or size == 1 or self.world_size == 1:
            return axis
        if size == self.tp_size:  # the TP group itself
            self.groups.add(axis, self.groups.group("tp"))
            return axis
        for tp_ranks in self.grid.all_groups("tp"):
            for i in range(0, len(tp_ranks), size):
                ranks = tp_ranks[i:i + size]
                group = dist.new_group(ranks, timeout=self.comm.timeout)
                if self.rank in ranks:
                    self.groups.add(axis, group)
        return axis

    def data_view(self) -> "Topology":
        """This topology as the optimizer of the parameters every rank of a replica holds sees it: its ``dp``
        axis is ``dp_cp``, the ``dp * cp`` ranks that hold the same parameters (under context parallelism each
        sequence is split over the ``cp`` ranks, so their gradients are partial sums too and ZeRO partitions over
        all of them, as Megatron's distributed optimizer does). At ``cp = 1`` it is this topology."""
        return self if self.grid.cp == 1 else self._view("dp_cp")

    def expert_data_view(self) -> "Topology":
        """This topology as the optimizer of the expert parameters sees it: its ``dp`` axis (groups, size, rank,
        collectives) is ``edp``, the ranks that hold the same experts; every other axis is this topology's.
        It shares this topology's process groups and communicator (one byte count, one set of waits, the
        traffic reported under ``edp``) and closes nothing. At ``ep = 1`` it is :meth:`data_view`."""
        return self.data_view() if self.grid.ep == 1 else self._view("edp")

    def _view(self, data_axis: str) -> "Topology":
        """This topology with its ``dp`` axis answered by ``data_axis`` (sharing groups and communicator)."""
        view = Topology.__new__(_DataAxisView)
        view.__dict__.update(self.__dict__)
        view.groups = AliasedGroups(self.groups, {"dp": data_axis})
        view.comm = self.comm.aliased(view.groups)
        view._parent = self
        return view

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
            own = self.groups.release()
            if dist.is_available() and dist.is_initialized():
                for group in own:
                    dist.destroy_process_group(group)
            atexit.unregister(self.close)

    # ---- queries (answered by the group table) ------------------------------------------------
    def group(self, axis: str):
        """The torch process group of this rank along ``axis`` (None when its size is 1)."""
        return self.groups.group(axis)

    def size(self, axis: str) -> int:
        return self.groups.size(axis)

    def rank_in(self, axis: str) -> int:
        return self.groups.rank_in(axis)

    def group_ranks(self, axis: str, rank: Optional[int] = None) -> List[int]:
        """Global ranks of the ``axis`` group that holds ``rank`` (default: this rank), in group-rank order."""
        return self.groups.group_ranks(axis, rank)

    def coord_of(self, rank: int) -> Coord:
        return self.grid.coord_of(rank)

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    # Short names used throughout the library.
    tp_size = property(lambda self: self.grid.tp)
    dp_size = property(lambda self: self.grid.dp)
    pp_size = property(lambda self: self.grid.pp)
    ep_size = property(lambda self: self.grid.ep)
    cp_size = property(lambda self: self.grid.cp)
    cp_rank = property(lambda self: self.coord.cp)
    tp_rank = property(lambda self: self.coord.tp)
    dp_rank = property(lambda self: self.coord.dp)
    pp_rank = property(lambda self: self.coord.pp)
    ep_rank = property(lambda self: self.grid.expert_coord(self.rank).ep)

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live: its GPU when it has one and its collectives take CUDA tensors (an
        NCCL group, or one process with no group at all: ``torchrun --nproc-per-node 1`` creates none), else
        the CPU (no GPU, or a gloo group)."""
        if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def layout(self, zero_stage: int = 0, precision: str = "fp32") -> ParallelLayout:
        """This job's :class:`~hybrid.layout.ParallelLayout` with the given ZeRO stage and precision (validated).
        Its ``dp`` is the ``dp * cp`` ranks that hold the same parameters (:meth:`data_view`): what ZeRO partitions
        over and what a checkpoint records (a layout has no cp: docs/checkpoints.md)."""
        return ParallelLayout(tp=self.tp_size, dp=self.grid.data_ranks, pp=self.pp_size, zero_stage=zero_stage,
                              precision=precision, ep=self.ep_size)

    def describe(self) -> str:
        ep = f" ep={self.ep_size}" if self.ep_size > 1 else ""
        cp = f" cp={self.cp_size}" if self.cp_size > 1 else ""
        cp_coord = f", cp={self.cp_rank}" if self.cp_size > 1 else ""
        return (f"world={self.world_size} tp={self.tp_size} dp={self.dp_size} "
                f"pp={self.pp_size}{cp}{ep} rank={self.rank} coord=(tp={self.tp_rank}, "
                f"dp={self.dp_rank}, pp={self.pp_rank}{cp_coord})")

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"


class _DataAxisView(Topology):
    """A :class:`Topology` whose ``dp`` axis is another axis (:meth:`Topology.data_view`,
    :meth:`Topology.expert_data_view`)."""

    dp_size = property(lambda self: self.groups.size("dp"))
    dp_rank = property(lambda self: self.groups.rank_in("dp"))

    def enable_node_axes(self) -> None:
        axis = self.groups.real_axis("dp")
        raise TopologyError(f"two-level reduction (zero.two_level_reduce) and the secondary partition "
                            f"(zero.hpz_partition_size) split the dp group by node; the {axis} group this optimizer "
                            f"partitions over (expert or context parallelism) has no such split yet: leave them off "
                            f"with expert or context parallelism")

    def enable_tp_subgroups(self, size: int) -> str:
        return self._parent.enable_tp_subgroups(size)

    def data_view(self) -> "Topology":
        return self._parent.data_view()

    def expert_data_view(self) -> "Topology":
        return self._parent.expert_data_view()

    def close(self) -> None:
        """The groups belong to the topology this view was made from: it closes them."""
