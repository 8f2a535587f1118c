"""hybrid.grid: the rank formula with the context- and expert-parallel axes, the product rule, and that the rule
lives in hybrid/grid.py alone."""

import itertools
import re
from pathlib import Path

import pytest

from hybrid.grid import (AXES, RANK_ORDER, Coord, ExpertCoord, Grid, TopologyError, WorldSizeError,
                         data_parallel_size, divides_world, world_size_of)
from hybrid.layout import ParallelLayout

ROOT = Path(__file__).resolve().parent.parent

# (tp, cp, dp, pp, ep) with ep dividing dp * cp
SHAPES = [(tp, cp, dp, pp, ep) for tp, cp, dp, pp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3, 4), (1, 2, 3))
          for ep in (1, 2, 3, 4, 8) if (dp * cp) % ep == 0]


@pytest.mark.parametrize("tp,cp,dp,pp,ep", SHAPES)
def test_rank_formula_round_trips_with_tp_then_cp_then_dp_then_pp(tp, cp, dp, pp, ep):
    g = Grid.build(world_size_of(tp, dp, pp, cp), tp=tp, pp=pp, cp=cp, ep=ep)
    assert (g.dp, g.world_size) == (dp, tp * cp * dp * pp)
    seen = set()
    for rank in range(g.world_size):
        c = g.coord_of(rank)
        assert rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        assert g.rank_of(c) == rank
        seen.add((c.tp, c.cp, c.dp, c.pp))
        e = g.expert_coord(rank)
        d = c.cp + cp * c.dp  # the data index: cp inner, then dp
        assert e == ExpertCoord(ep=d % ep, edp=d // ep)
        assert g.rank_in("ep", rank) == e.ep and g.rank_in("edp", rank) == e.edp
    assert len(seen) == g.world_size


@pytest.mark.parametrize("tp,cp,dp,pp,ep", SHAPES)
def test_every_axis_partitions_the_world_into_groups_of_its_size(tp, cp, dp, pp, ep):
    g = Grid(tp=tp, dp=dp, pp=pp, cp=cp, ep=ep)
    for axis in ("tp", "cp", "dp", "dp_cp", "ep", "edp", "pp", "mp", "world"):
        groups = g.all_groups(axis)
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(g.world_size)), axis
        assert all(len(grp) == g.size(axis) for grp in groups), axis
        for grp in groups:
            assert all(g.group_ranks(axis, r) == grp for r in grp), axis
    assert g.size("ep") * g.size("edp") == g.size("dp_cp") == dp * cp
    for grp in g.all_groups("cp"):  # cp ranks sit next to each other's tp groups, at one dp and pp position
        coords = [g.coord_of(r) for r in grp]
        assert len({(c.tp, c.dp, c.pp) for c in coords}) == 1 and [c.cp for c in coords] == list(range(cp))
    for grp in g.all_groups("ep"):  # an expert group: consecutive data indices at one tp and pp position
        coords = [g.coord_of(r) for r in grp]
        assert len({(c.tp, c.pp) for c in coords}) == 1
        indices = [c.cp + cp * c.dp for c in coords]
        assert indices == list(range(indices[0], indices[0] + ep)) and indices[0] % ep == 0


def _today(tp, dp, pp, axis, rank):
    """The groups as the grid formed them before cp and ep: rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    at = lambda t_, d_, p_: t_ + tp * (d_ + dp * p_)  # noqa: E731
    return {"tp": [at(x, d, p) for x in range(tp)], "dp": [at(t, x, p) for x in range(dp)],
            "pp": [at(t, d, x) for x in range(pp)],
            "mp": [at(x, d, y) for y in range(pp) for x in range(tp)],
            "embed": [rank] if pp == 1 or 0 < p < pp - 1 else [at(t, d, 0), at(t, d, pp - 1)],
            "world": list(range(tp * dp * pp))}[axis]


@pytest.mark.parametrize("tp,dp,pp", [(tp, dp, pp) for tp in (1, 2, 4) for dp in (1, 2, 3) for pp in (1, 2, 4)])
def test_at_cp_and_ep_one_every_group_is_todays(tp, dp, pp):
    g = Grid.build(tp * dp * pp, tp=tp, pp=pp)
    for rank in range(g.world_size):
        assert g.coord_of(rank) == Coord(rank % tp, (rank // tp) % dp, rank // (tp * dp))
        for axis in ("tp", "dp", "pp", "mp", "embed", "world"):
            assert g.group_ranks(axis, rank) == _today(tp, dp, pp, axis, rank), (axis, rank)
        # the new axes add nothing: cp and ep groups of one, and the data groups are the dp group
        assert g.group_ranks("cp", rank) == g.group_ranks("ep", rank) == [rank]
        assert g.group_ranks("dp_cp", rank) == g.group_ranks("edp", rank) == g.group_ranks("dp", rank)


def test_a_known_layout_with_context_and_expert_parallelism():
    # 16 ranks: tp=2, cp=2, dp=2, pp=2; experts shared out over ep=2 of the dp*cp = 4 data ranks
    g = Grid.build(16, tp=2, pp=2, cp=2, ep=2)
    assert g.dp == 2
    assert g.coord_of(13) == Coord(tp=1, dp=1, pp=1, cp=0)
    assert g.coord_of(7) == Coord(tp=1, dp=1, pp=0, cp=1)
    assert g.group_ranks("cp", 0) == [0, 2]
    assert g.group_ranks("dp", 0) == [0, 4]
    assert g.group_ranks("dp_cp", 1) == [1, 3, 5, 7]
    assert g.group_ranks("ep", 5) == [5, 7]  # data indices 2 and 3
    assert g.group_ranks("edp", 5) == [1, 5]  # ep position 0: data indices 0 and 2
    assert g.group_ranks("pp", 3) == [3, 11]
    assert g.group_ranks("embed", 3) == [3, 11]
    assert g.group_ranks("mp", 2) == [2, 3, 10, 11]


def test_the_rank_order_is_megatrons():
    assert RANK_ORDER == ("tp", "cp", "dp", "pp")
    assert {"cp", "dp_cp", "ep", "edp"} <= set(AXES)  # every axis of the arithmetic has its process groups


# ---- the product rule -------------------------------------------------------------------------

def test_data_parallel_size_is_the_world_over_one_replica():
    assert data_parallel_size(16, tp=2, pp=2) == 4
    assert data_parallel_size(16, tp=2, pp=2, cp=2) == 2
    assert world_size_of(tp=2, dp=4, pp=2) == 16 == world_size_of(2, 2, 2, cp=2)
    assert ParallelLayout(tp=2, dp=3, pp=2).world_size == 12
    for world, tp, pp, cp in itertools.product(range(1, 25), (1, 2, 3, 4), (1, 2, 3), (1, 2)):
        assert divides_world(world, tp, pp, cp) == (world % (tp * pp * cp) == 0)


@pytest.mark.parametrize("call,match", [
    (lambda: data_parallel_size(6, tp=4), r"world size 6 is not divisible by tp\*pp = 4\*1 = 4; choose"),
    (lambda: data_parallel_size(12, tp=2, pp=2, cp=2),
     r"world size 12 is not divisible by tp\*cp\*pp = 2\*2\*2 = 8; choose tensor-model-parallel, context-parallel"),
    (lambda: Grid.build(16, tp=2, cp=2, dp=3), r"tp\*cp\*dp\*pp = 2\*2\*3\*1 = 12 does not equal the world size 16"),
    (lambda: data_parallel_size(8, cp=0), r"cp must be an integer >= 1, got 0"),
    (lambda: Grid.build(8, ep=True), r"ep must be an integer >= 1, got True"),
    (lambda: Grid(tp=1, dp=3, pp=1, ep=2), r"--expert-model-parallel-size 2 must divide the data-parallel ranks dp\*cp = 3\*1 = 3"),
    (lambda: Grid.build(12, tp=2, cp=3, ep=4), r"--expert-model-parallel-size 4 must divide the data-parallel ranks dp\*cp = 2\*3 = 6"),
])
def test_bad_sizes_are_refused_in_one_line(call, match):
    with pytest.raises(TopologyError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_the_world_size_error_carries_the_replica_for_callers_that_word_it_their_way():
    with pytest.raises(WorldSizeError) as info:
        data_parallel_size(10, tp=2, pp=3)
    assert (info.value.world, info.value.replica) == (10, 6)


def test_config_validation_and_the_planner_read_the_rule():
    from hybrid.config import HybridConfig
    from hybrid.config.validate import validate_world

    cfg = HybridConfig()
    cfg.tensor_parallel_size, cfg.pipeline.size = 2, 3
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tensor_parallel_size x pipeline.size = "
                                         r"2 x 3; start a multiple of 6 processes"):
        validate_world(cfg, 8)


# The product of the axis sizes, written as code: tp times pp with any of cp, dp, ep between (``tp * pp``,
# ``self.tp * self.dp * self.pp``, ``tp * cp * dp * pp``), in either order. A stage's ranks (``tp * dp``) or a
# rank formula (``tp * (dp_rank + ...)``) are other things.
_SIZE = r"(?:\w+\.)?(?:tp|pp|cp|dp|ep)(?:_size)?"
PRODUCT = re.compile(rf"\b(?:\w+\.)?(tp|pp)(?:_size)?\s*\*\s*(?:{_SIZE}\s*\*\s*)*(?:\w+\.)?(tp|pp)(?:_size)?\b")


def test_the_product_rule_is_written_in_hybrid_grid_alone():
    """The sizes multiply to the world size in hybrid/grid.py (world_size_of, data_parallel_size,
    divides_world), and nowhere else in hybrid/: the topology, the config check, the layout and the planner
    call those functions."""
    assert PRODUCT.search("dp = world // (tp * pp)") and PRODUCT.search("self.tp * self.dp * self.pp")
    assert PRODUCT.search("tp * cp * dp * pp") and PRODUCT.search("pp_size * tp_size")
    assert not PRODUCT.search("stage = tp * dp") and not PRODUCT.search("tp * (dp_rank + dp * pp_rank)")
    where = {}
    for path in sorted((ROOT / "hybrid").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = PRODUCT.search(line)
            if match and match.group(1) != match.group(2):
                where.setdefault(str(path.relative_to(ROOT)), []).append(f"{number}: {line.strip()}")
    assert "hybrid/grid.py" in where, "the rule moved: update this test's docstring and pattern"
    elsewhere = {p: lines for p, lines in where.items() if p != "hybrid/grid.py"}
    assert not elsewhere, f"the product of the axis sizes is restated outside hybrid/grid.py: {elsewhere}"
