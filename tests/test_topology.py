import itertools

import pytest
import torch

from hybrid.topology import Coord, Grid, Topology, TopologyError
from tests.multiproc import run_distributed

SHAPES = [(w, tp, pp) for w in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
          for tp in (1, 2, 3, 4, 8) for pp in (1, 2, 3, 4) if w % (tp * pp) == 0]


@pytest.mark.parametrize("world,tp,pp", SHAPES)
def test_grid_is_a_bijection_with_tp_innermost(world, tp, pp):
    g = Grid.build(world, tp=tp, pp=pp)
    assert g.dp * tp * pp == world
    for rank in range(world):
        c = g.coord_of(rank)
        assert rank == c.tp + tp * (c.dp + g.dp * c.pp)
        assert g.rank_of(c) == rank
    # Every axis partitions the world into disjoint groups of the axis size.
    for axis in ("tp", "dp", "pp", "mp", "world"):
        groups = g.all_groups(axis)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world))
        assert all(len(grp) == g.size(axis) for grp in groups)
        for grp in groups:
            for pos, r in enumerate(grp):
                assert g.group_ranks(axis, r) == grp
                assert g.rank_in(axis, r) == pos
    # TP groups are runs of adjacent ranks (one node).
    for grp in g.all_groups("tp"):
        assert grp == list(range(grp[0], grp[0] + tp))
    # Members of a dp group differ only in their dp coordinate.
    for grp in g.all_groups("dp"):
        coords = [g.coord_of(r) for r in grp]
        assert len({(c.tp, c.pp) for c in coords}) == 1
        assert [c.dp for c in coords] == list(range(g.dp))


def test_grid_known_layout():
    g = Grid.build(8, tp=2, pp=2)
    assert g.dp == 2
    assert g.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.all_groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.coord_of(7) == Coord(tp=1, dp=1, pp=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=6, tp=4), "not divisible by tp\\*pp = 4\\*1"),
    (dict(world_size=8, tp=2, pp=3), "not divisible by tp\\*pp = 2\\*3"),
    (dict(world_size=4, tp=0), "tp must be an integer >= 1"),
    (dict(world_size=4, pp=-1), "pp must be an integer >= 1"),
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=8, tp=2, dp=3), "does not equal the world size 8"),
    (dict(world_size=8, tp=2, dp=0), "dp must be an integer >= 1"),
])
def test_grid_rejects_bad_shapes(kwargs, match):
    with pytest.raises(TopologyError, match=match):
        Grid.build(**kwargs)


def test_grid_rejects_bad_queries():
    g = Grid.build(4, tp=2)
    with pytest.raises(TopologyError, match="rank 4 is outside"):
        g.coord_of(4)
    with pytest.raises(TopologyError, match="unknown axis 'xp'"):
        g.group_ranks("xp", 0)


def test_single_process_topology_needs_no_process_group():
    topo = Topology()
    assert topo.world_size == 1 and topo.tp_size == 1 and topo.dp_size == 1
    t = torch.ones(3)
    topo.comm.all_reduce(t, "dp")
    assert torch.equal(t, torch.ones(3))
    with pytest.raises(TopologyError):
        Topology(tp=2)


def test_a_topology_answers_its_own_groups_like_the_grid_and_hands_out_copies():
    # This rank's groups are kept after the first question: the answers must stay the grid's, and a caller
    # changing the list it got must not change the next answer.
    for pp_rank in range(3):
        topo = Topology.local(pp=3, pp_rank=pp_rank)
        for axis in ("tp", "dp", "pp", "mp", "embed", "world"):
            expected = topo.grid.group_ranks(axis, pp_rank)
            got = topo.group_ranks(axis)
            assert got == expected and topo.size(axis) == len(expected), axis
            assert topo.rank_in(axis) == expected.index(pp_rank), axis
            got.append(99)
            assert topo.group_ranks(axis) == expected, axis
        assert topo.group_ranks("pp", rank=(pp_rank + 1) % 3) == [0, 1, 2]


AXES_CHECKED = ("tp", "dp", "mp", "world", "cp", "dp_cp", "ep", "edp")
# (tp, cp, ep) at world 4: plain TP sizes, then the context- and expert-parallel axes alone and together
LAYOUTS = ((1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (1, 1, 2))


def _check_groups_all_tp():
    return {layout: _check_groups(Topology(tp=layout[0], cp=layout[1], ep=layout[2])) for layout in LAYOUTS}


def _check_groups(topo):
    import torch.distributed as dist

    out = {}
    for axis in AXES_CHECKED:
        # Every group reduces exactly its members' ranks.
        t = torch.tensor([float(topo.rank)])
        topo.comm.all_reduce(t, axis)
        out[axis] = (t.item(), float(sum(topo.group_ranks(axis))), topo.rank_in(axis), topo.size(axis))
    g = torch.zeros(topo.size("tp"))
    topo.comm.all_gather_into_tensor(g, torch.tensor([float(dist.get_rank())]), "tp")
    out["gathered_tp"] = g.tolist()
    out["tp_ranks"] = topo.group_ranks("tp")
    return out


def test_process_groups_match_the_grid():
    results = run_distributed(_check_groups_all_tp, 4)
    for rank, layout in itertools.product(range(4), LAYOUTS):
        res = results[rank][layout]
        tp, cp, ep = layout
        grid = Grid(tp=tp, dp=4 // (tp * cp), pp=1, cp=cp, ep=ep)
        for axis in AXES_CHECKED:
            got, expected, _, size = res[axis]
            assert got == expected == float(sum(grid.group_ranks(axis, rank))), (rank, layout, axis)
            assert size == grid.size(axis), (rank, layout, axis)
        assert res["gathered_tp"] == [float(r) for r in res["tp_ranks"]]
        assert res["tp"][2] == rank % tp


def test_nodes_come_from_the_argument_or_torchrun(monkeypatch):
    from hybrid.topology import Nodes

    assert Nodes.build(8, 4).node_of(5) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Nodes.build(8).ranks_per_node == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Nodes.build(8).ranks_per_node == 8  # one node
    with pytest.raises(TopologyError, match="not a whole number of nodes of 3"):
        Nodes.build(8, 3)


def test_tp_groups_that_cross_nodes_are_refused_unless_allowed():
    from hybrid.topology import Nodes

    nodes = Nodes(ranks_per_node=2)
    nodes.check_tp_groups(Grid(tp=2, dp=2, pp=1), allowed=False, warn=True)  # TP inside each node
    with pytest.raises(TopologyError, match=r"span nodes of 2 ranks \(e.g. ranks \[0, 1, 2, 3\]\).*divides the "
                                            r"ranks per node \(1, 2\).*--allow-tp-across-nodes"):
        nodes.check_tp_groups(Grid(tp=4, dp=1, pp=1), allowed=False, warn=True)
    with pytest.warns(UserWarning, match="allowed by --allow-tp-across-nodes"):
        nodes.check_tp_groups(Grid(tp=4, dp=1, pp=1), allowed=True, warn=True)


def _inter_node_counts():
    import torch.distributed as dist

    topo = Topology(tp=2, ranks_per_node=2)  # nodes {0, 1} and {2, 3}; DP groups {0, 2} and {1, 3}
    buf = torch.ones(1000)
    counts = {}
    for axis in ("tp", "dp", "world"):
        topo.comm.reset_stats()
        topo.comm.all_reduce(buf, axis)
        topo.comm.reduce_scatter_tensor(torch.empty(1000 // topo.size(axis)), buf, axis)
        counts[axis] = {k: v["inter_node_bytes"] for k, v in topo.comm.report().items()}
    return dist.get_rank(), counts, topo.comm.inter_node_total()


def test_communicator_counts_the_bytes_that_leave_the_node():
    results = run_distributed(_inter_node_counts, 4)
    ring4 = 4000 * 2 * 3 / 4  # a 4000-byte buffer under a ring all-reduce at world 4
    for rank, counts, total in results:
        assert counts["tp"] == {"all_reduce/tp": 0.0, "reduce_scatter/tp": 0.0}  # TP stays on the node
        # DP pairs sit on different nodes: everything a rank sends crosses. The ring reduce-scatter sends
        # (n-1)/n = half the buffer at n = 2, half of what the all-reduce sends.
        assert counts["dp"] == {"all_reduce/dp": 4000.0, "reduce_scatter/dp": 2000.0}
        # The world ring 0 -> 1 -> 2 -> 3 -> 0 crosses at 1 -> 2 and 3 -> 0.
        crossing = ring4 if rank in (1, 3) else 0.0
        assert counts["world"] == {"all_reduce/world": crossing, "reduce_scatter/world": crossing / 2}, (rank, counts)
        assert total == 6000.0 + 1.5 * crossing  # never reset


def test_tp_subaxis_groups_consecutive_tp_ranks():
    from hybrid.topology import Grid, TopologyError, tp_subaxis

    grid = Grid.build(8, tp=4)  # tp groups [0..3], [4..7]
    axis = tp_subaxis(2)
    assert axis == "tp/2" and grid.size(axis) == 2
    assert grid.group_ranks(axis, 5) == [4, 5] and grid.group_ranks(axis, 6) == [6, 7]
    assert grid.all_groups(axis) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.group_ranks("tp/4", 2) == grid.group_ranks("tp", 2)
    with pytest.raises(TopologyError, match="'tp/3': 3 does not divide the tensor-parallel size 4"):
        grid.size("tp/3")
    with pytest.raises(TopologyError, match="unknown axis 'tp/x'"):
        grid.size("tp/x")


@pytest.mark.parametrize("cuda, group, want", [
    (False, None, "cpu"),
    (True, None, "cuda"),  # one process on a GPU (torchrun --nproc-per-node 1 makes no group): its GPU
    (True, "nccl", "cuda"),
    (True, "gloo", "cpu"),  # gloo's collectives take CPU tensors
])
def test_the_device_follows_the_gpu_and_what_the_collectives_take(monkeypatch, cuda, group, want):
    import hybrid.topology as topology_module

    topo = Topology.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(topology_module.dist, "is_initialized", lambda: group is not None)
    monkeypatch.setattr(topology_module.dist, "get_backend", lambda *a: group)
    assert topo.device == (torch.device("cuda", 0) if want == "cuda" else torch.device("cpu"))
