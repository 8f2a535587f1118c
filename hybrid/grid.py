"""The rank grid, as plain data: the axes, their order, the rank formula, the node map, and the world rule.

This module is the one place that states **the product rule**: the sizes of
the axes that lay ranks out multiply to the world size (:func:`world_size_of`,
:func:`data_parallel_size`, :func:`divides_world`). The topology, the
configuration check, :class:`hybrid.layout.ParallelLayout` and the planner
call these functions rather than multiplying sizes themselves
(``tests/test_grid.py`` checks the source text for that). It imports neither
torch nor the rest of hybrid, so configuration code and offline tools can use
it; :class:`hybrid.topology.Topology` builds the process groups from it.

**Order** (:data:`RANK_ORDER`, innermost first), as Megatron lays ranks out::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

``tp`` innermost keeps a TP group on adjacent ranks (one node and its fast
links); ``cp`` (context parallel: one sequence split over ranks) next, since
its ranks exchange keys and values in every layer; then ``dp``; ``pp``
outermost, since stages exchange only activations. At ``cp = 1`` this is
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``.

**Expert parallelism** adds no position of its own: ``ep`` subdivides the
``dp * cp`` ranks that hold the same dense parameters (:attr:`Grid.data_ranks`).
Their index ``d = cp_rank + cp * dp_rank`` splits as ``d = ep_rank + ep * edp_rank``:
the ``ep`` consecutive ones share out the experts, and the ``dp * cp / ep`` at the
same ``ep_rank`` (expert data parallel) hold the same experts. So ``ep`` must
divide ``dp * cp``.

Axes (every size defaults to 1 where the grid has such an axis):
    ``tp``     tensor-model parallel (layers split across these ranks)
    ``cp``     context parallel (one sequence split across these ranks)
    ``dp``     data parallel (ZeRO partitions state across these ranks)
    ``dp_cp``  ``dp`` and ``cp`` together: every rank that holds the same parameters
    ``ep``     expert parallel (the experts of a layer shared out across these ranks)
    ``edp``    expert data parallel: the ranks that hold the same experts
    ``pp``     pipeline parallel (stages)
    ``mp``     model parallel = tp × pp (all ranks that hold one model replica)
    ``embed``  the first and the last pipeline stage at one (tp, cp, dp) position: they hold the two copies of
               tied input and output embeddings (a rank of a middle stage, or of a job with pp=1, is alone)
    ``world``  every rank
    ``tp/k``   ``k`` consecutive ranks of one TP group (:meth:`hybrid.topology.Topology.enable_tp_subgroups`):
               the ranks that hold the same replicated piece of a layer, e.g. one key/value head of
               grouped-query attention when there are more TP ranks than key/value heads
    ``dp_node``, ``dp_cross``  the ``dp`` group split by node (:meth:`Nodes.node_axis_groups`)
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Dict, List, Optional, Sequence

# The axes of the rank formula, innermost (fastest-varying) first.
RANK_ORDER = ("tp", "cp", "dp", "pp")
# The axes the topology builds process groups for (``ep`` and ``edp``: expert parallelism, whose groups are
# built only when ``ep > 1``, otherwise ``ep`` is each rank alone and ``edp`` its ``dp`` group; ``cp`` and
# ``dp_cp``: context parallelism, built only when ``cp > 1``, otherwise ``cp`` is each rank alone and ``dp_cp``
# its ``dp`` group).
AXES = ("tp", "dp", "pp", "mp", "embed", "world", "ep", "edp", "cp", "dp_cp")
# The data-parallel group split by node (see Nodes.node_axis_groups): the ranks of this rank's dp group on
# its own node, and the ranks of its dp group at the same position on every node.
NODE_AXES = ("dp_node", "dp_cross")


class TopologyError(ValueError):
    """A parallel layout that cannot be built from the given sizes."""


class WorldSizeError(TopologyError):
    """A world size that the ranks of one data-parallel replica (``replica`` = tp × cp × pp) do not divide."""

    def __init__(self, message: str, world: int, replica: int):
        super().__init__(message)
        self.world = world
        self.replica = replica


def tp_subaxis(size: int) -> str:
    """The axis name of the groups of ``size`` consecutive ranks of a TP group."""
    return f"tp/{size}"


def tp_sub_size(axis: str) -> Optional[int]:
    """``k`` for a ``tp/k`` axis, else None."""
    if isinstance(axis, str) and axis.startswith("tp/") and axis[3:].isdigit() and int(axis[3:]) >= 1:
        return int(axis[3:])
    return None


def check_axis(axis: str) -> None:
    """Raise :class:`TopologyError` unless ``axis`` names an axis of this module."""
    if axis not in AXES and axis not in NODE_AXES and tp_sub_size(axis) is None:
        raise TopologyError(f"unknown axis {axis!r}; expected one of "
                            f"{', '.join(AXES + NODE_AXES)} or tp/k")


def _check_size(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")


# ---- the product rule ------------------------------------------------------------------------

def world_size_of(tp: int, dp: int, pp: int = 1, cp: int = 1) -> int:
    """The number of ranks of a grid of these axis sizes (``ep`` subdivides ``dp * cp`` and adds none)."""
    return tp * cp * dp * pp


def _replica(tp: int, pp: int, cp: int) -> int:
    """Ranks of one data-parallel replica: every axis of :data:`RANK_ORDER` but ``dp``."""
    return world_size_of(tp, 1, pp, cp)


def divides_world(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> bool:
    """Whether ``world`` ranks split into whole data-parallel replicas of ``tp * cp * pp`` ranks."""
    return world % _replica(tp, pp, cp) == 0


def data_parallel_size(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """``dp = world / (tp * cp * pp)``; :class:`WorldSizeError` (its ``replica`` the divisor) when it is not
    whole, :class:`TopologyError` for a size that is not an integer >= 1."""
    for name, value in (("world_size", world), ("tp", tp), ("pp", pp), ("cp", cp)):
        _check_size(name, value)
    replica = _replica(tp, pp, cp)
    if not divides_world(world, tp, pp, cp):
        names, sizes, kinds = ("tp*pp", f"{tp}*{pp}", "tensor-model-parallel and pipeline") if cp == 1 else \
            ("tp*cp*pp", f"{tp}*{cp}*{pp}", "tensor-model-parallel, context-parallel and pipeline")
        raise WorldSizeError(f"world size {world} is not divisible by {names} = {sizes} = {replica}; choose "
                             f"{kinds} sizes whose product divides the number of processes", world, replica)
    return world // replica


def expert_parallel_problem(dp: int, cp: int, ep: int) -> Optional[str]:
    """Why ``ep`` expert-parallel ranks cannot share out the experts among ``dp * cp`` data ranks, or None.
    The one statement of the rule (the grid, :class:`hybrid.layout.ParallelLayout` and the trainer read it)."""
    if (dp * cp) % ep:
        return (f"--expert-model-parallel-size {ep} must divide the data-parallel ranks dp*cp = {dp}*{cp} = "
                f"{dp * cp}: expert parallelism shares the experts out among the ranks that hold the same dense "
                f"parameters; choose a divisor of {dp * cp}")
    return None


# ---- what the context-parallel axis asks of a model (hybrid.context_parallel; model_zoo.config reads these) ----

# The context-parallel attentions: key/value blocks around a ring (p2p), or all-to-all over the heads (a2a).
CP_COMM_TYPES = ("p2p", "a2a")


def cp_comm_type_problem(comm_type: str) -> Optional[str]:
    if comm_type not in CP_COMM_TYPES:
        return (f"--cp-comm-type {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)} (Megatron's allgather and "
                f"a2a+p2p are not implemented: use p2p, the ring)")
    return None


def sequence_split_problem(seq_length: int, cp: int) -> Optional[str]:
    """Why ``cp`` ranks cannot split sequences of ``seq_length`` tokens: each holds two of ``2 cp`` equal chunks
    (the load-balanced causal split); None when they can."""
    if seq_length % (2 * cp):
        return (f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} (the "
                f"load-balanced split cuts each sequence into 2 x cp equal chunks); pick a multiple of {2 * cp}")
    return None


def cp_dropout_problem(cp: int, attention_dropout: float) -> Optional[str]:
    if cp > 1 and attention_dropout > 0:
        return (f"--attention-dropout {attention_dropout} is not supported with --context-parallel-size {cp} "
                f"(attention runs in blocks across ranks); set --attention-dropout 0")
    return None


def a2a_heads_problem(num_heads: int, num_groups: int, cp: int) -> Optional[str]:
    """Why the all-to-all attention cannot scatter ``num_heads`` query heads and ``num_groups`` key/value groups
    (those of one TP rank) over ``cp`` ranks: the heads must divide by ``cp``, the groups divide by it or divide
    it (then they are replicated); None when it can."""
    if num_heads % cp or (num_groups % cp and cp % num_groups):
        return (f"--cp-comm-type a2a scatters heads over --context-parallel-size {cp}: the {num_heads} attention "
                f"heads per tensor-parallel rank (--num-attention-heads over TP) must be divisible by it, and the "
                f"{num_groups} key/value groups (--num-query-groups over TP) divisible by it or a divisor of it; use "
                f"--cp-comm-type p2p or another cp")
    return None


# ---- coordinates -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Coord:
    """A rank's position along each axis of :data:`RANK_ORDER` (``cp`` last so that ``Coord(tp, dp, pp)``
    still reads as before context parallelism)."""

    tp: int
    dp: int
    pp: int
    cp: int = 0


@dataclasses.dataclass(frozen=True)
class ExpertCoord:
    """A rank's position among the ``dp * cp`` ranks of its replica, seen by the experts: ``ep`` which share
    of the experts it holds, ``edp`` which copy of that share."""

    ep: int
    edp: int


@dataclasses.dataclass(frozen=True)
class Grid:
    """Pure rank arithmetic for a world of ``tp * cp * dp * pp`` ranks (see the module docstring)."""

    tp: int
    dp: int
    pp: int
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "cp", "ep"):
            _check_size(name, getattr(self, name))
        problem = expert_parallel_problem(self.dp, self.cp, self.ep)
        if problem:
            raise TopologyError(problem)

    @classmethod
    def build(cls, world_size: int, tp: int = 1, pp: int = 1, dp: Optional[int] = None, cp: int = 1,
              ep: int = 1) -> "Grid":
        """Validate the sizes and infer ``dp`` (:func:`data_parallel_size`) when not given."""
        inferred = data_parallel_size(world_size, tp=tp, pp=pp, cp=cp)
        if dp is None:
            dp = inferred
        else:
            _check_size("dp", dp)
            if dp != inferred:
                names, sizes = ("tp*dp*pp", f"{tp}*{dp}*{pp}") if cp == 1 else \
                    ("tp*cp*dp*pp", f"{tp}*{cp}*{dp}*{pp}")
                raise TopologyError(f"{names} = {sizes} = {world_size_of(tp, dp, pp, cp)} does not equal the "
                                    f"world size {world_size}; leave dp unset to infer it ({inferred})")
        _check_size("ep", ep)
        return cls(tp=tp, dp=dp, pp=pp, cp=cp, ep=ep)

    @property
    def world_size(self) -> int:
        return world_size_of(self.tp, self.dp, self.pp, self.cp)

    @property
    def data_ranks(self) -> int:
        """The ranks that hold the same dense parameters: ``dp * cp``."""
        return self.dp * self.cp

    def size(self, axis: str) -> int:
        check_axis(axis)
        sub = tp_sub_size(axis)
        if sub is not None:
            return self._check_sub(sub)
        if axis in NODE_AXES:
            raise TopologyError(f"axis {axis!r} depends on the node map: ask Nodes.node_axis_groups")
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "dp_cp": self.data_ranks,
                "ep": self.ep, "edp": self.data_ranks // self.ep, "mp": self.tp * self.pp,
                "embed": min(self.pp, 2), "world": self.world_size}[axis]

    def rank_of(self, coord: Coord) -> int:
        """The global rank at ``coord``: the mixed-radix number of its coordinates in :data:`RANK_ORDER`."""
        rank, stride = 0, 1
        for axis in RANK_ORDER:
            value, size = getattr(coord, axis), getattr(self, axis)
            if not 0 <= value < size:
                raise TopologyError(f"{axis} coordinate {value} is outside [0, {size})")
            rank += value * stride
            stride *= size
        return rank

    def coord_of(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside the world [0, {self.world_size})")
        values = {}
        for axis in RANK_ORDER:
            size = getattr(self, axis)
            rank, values[axis] = divmod(rank, size)
        return Coord(**values)

    def expert_coord(self, rank: int) -> ExpertCoord:
        """``rank``'s expert-parallel and expert-data-parallel positions (see the module docstring)."""
        edp, ep = divmod(self._data_index(self.coord_of(rank)), self.ep)
        return ExpertCoord(ep=ep, edp=edp)

    def _data_index(self, c: Coord) -> int:
        """``c``'s position among the ``dp * cp`` ranks that hold its parameters (``cp`` inner)."""
        return c.cp + self.cp * c.dp

    def _at_data_index(self, c: Coord, index: int) -> int:
        """The rank at ``c``'s tp and pp coordinates and data index ``index``."""
        dp, cp = divmod(index, self.cp)
        return self.rank_of(Coord(c.tp, dp, c.pp, cp))

    def rank_in(self, axis: str, rank: int) -> int:
        """The position of global ``rank`` inside its group along ``axis``."""
        return self.group_ranks(axis, rank).index(rank)

    def group_ranks(self, axis: str, rank: int) -> List[int]:
        """Global ranks of the ``axis`` group that contains ``rank``, in group-rank order."""
        check_axis(axis)
        c = self.coord_of(rank)
        if axis == "world":
            return list(range(self.world_size))
        if axis == "tp":
            return [self.rank_of(Coord(t, c.dp, c.pp, c.cp)) for t in range(self.tp)]
        sub = tp_sub_size(axis)
        if sub is not None:
            first = c.tp // self._check_sub(sub) * sub
            return [self.rank_of(Coord(t, c.dp, c.pp, c.cp)) for t in range(first, first + sub)]
        if axis == "cp":
            return [self.rank_of(Coord(c.tp, c.dp, c.pp, k)) for k in range(self.cp)]
        if axis == "dp":
            return [self.rank_of(Coord(c.tp, d, c.pp, c.cp)) for d in range(self.dp)]
        if axis == "dp_cp":
            return [self._at_data_index(c, i) for i in range(self.data_ranks)]
        if axis in ("ep", "edp"):
            edp, ep = divmod(self._data_index(c), self.ep)
            if axis == "ep":
                return [self._at_data_index(c, edp * self.ep + e) for e in range(self.ep)]
            return [self._at_data_index(c, j * self.ep + ep) for j in range(self.data_ranks // self.ep)]
        if axis == "pp":
            return [self.rank_of(Coord(c.tp, c.dp, p, c.cp)) for p in range(self.pp)]
        if axis == "embed":
            if self.pp == 1 or 0 < c.pp < self.pp - 1:
                return [rank]
            return [self.rank_of(Coord(c.tp, c.dp, 0, c.cp)), self.rank_of(Coord(c.tp, c.dp, self.pp - 1, c.cp))]
        if axis == "mp":  # every (tp, pp) pair at this dp and cp coordinate, tp innermost
            return [self.rank_of(Coord(t, c.dp, p, c.cp)) for p in range(self.pp) for t in range(self.tp)]
        raise TopologyError(f"axis {axis!r} depends on the node map: ask Nodes.node_axis_groups")

    def _check_sub(self, size: int) -> int:
        if self.tp % size:
            raise TopologyError(f"axis {tp_subaxis(size)!r}: {size} does not divide the tensor-parallel size {self.tp}")
        return size

    def all_groups(self, axis: str) -> List[List[int]]:
        """Every group along ``axis``, each as its ranks, ordered by their lowest rank."""
        seen: Dict[int, List[int]] = {}
        for r in range(self.world_size):
            ranks = self.group_ranks(axis, r)
            seen.setdefault(min(ranks), ranks)
        return [seen[k] for k in sorted(seen)]


# ---- the node map ------------------------------------------------------------------------------

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


__all__ = ["AXES", "NODE_AXES", "RANK_ORDER", "Coord", "ExpertCoord", "Grid", "Nodes",
           "TopologyError", "WorldSizeError", "check_axis", "data_parallel_size", "divides_world", "tp_sub_size",
           "tp_subaxis", "world_size_of", "expert_parallel_problem", "CP_COMM_TYPES", "a2a_heads_problem",
           "cp_comm_type_problem", "cp_dropout_problem", "sequence_split_problem"]
