"""benchmarks/slow_link.py's Megatron pipeline layouts: what they run, and that hybrid.train runs it as asked."""

import os
import subprocess
from pathlib import Path

from benchmarks import slow_link
from hybrid.topology import Grid
from tests.multiproc import local_torchrun

REPO = Path(__file__).resolve().parents[1]


def test_pipelines_run_only_when_asked_or_named_and_put_one_stage_on_each_node():
    plain = {c.name for c in slow_link.parse([]).contenders}
    pipelines = {c.name for c in slow_link.CONTENDERS if c.pp > 1}
    assert pipelines and not plain & pipelines
    assert {c.name for c in slow_link.parse(["--pipelines"]).contenders} == plain | pipelines
    for c in slow_link.CONTENDERS:
        if c.pp == 1:
            continue
        assert c.tp * c.pp * c.dp == slow_link.WORLD
        # rank = tp_rank + tp * (dp_rank + dp * pp_rank): a node's ranks are one TP group of one stage, so only
        # the pipeline crosses the link
        grid = Grid(tp=c.tp, dp=c.dp, pp=c.pp)
        for rank in range(slow_link.WORLD):
            assert grid.coord_of(rank).pp == rank // slow_link.RANKS_PER_NODE


def test_the_interleaved_pipeline_trains_under_torchrun_as_slow_link_runs_it():
    args = slow_link.parse(["--hidden", "32", "--layers", "4", "--heads", "4", "--seq", "32", "--vocab", "128",
                            "--iters", "3", "--only", "megatron-tp2-pp2-v2"])
    (c,) = args.contenders
    argv = slow_link.train_argv(c, args, args.iters)
    assert argv[argv.index("--pipeline-model-parallel-size") + 1] == "2" and "--sequence-parallel" in argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(local_torchrun(argv, slow_link.WORLD), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tp=2 dp=1 pp=2" in done.stdout
    assert [i for i, _, _ in slow_link.parse_iterations(done.stdout)] == [1, 2, 3]
    # one node here: the inter-node traffic line is printed on several nodes only
    assert slow_link.parse_profile(done.stdout)["iterations_measured"] == 2


def _layout_label(c) -> str:
    """The layout column of contender ``c``'s row."""
    row = {"tp": c.tp, "dp": c.dp, "pp": c.pp, "zero_stage": c.zero_stage, "micro_batch": c.micro_batch,
           "zero_reduce_once": c.zero_reduce_once, "flags": list(c.extra), "ok": False, "failure": "x",
           "name": c.name}
    (cells,) = slow_link.table_rows({"contenders": [row]})
    return cells[1]


def test_the_layout_column_names_the_interleaved_schedule_only():
    label = _layout_label
    by_name = {c.name: c for c in slow_link.CONTENDERS}
    assert label(by_name["megatron-tp2-pp2-v2"]).endswith(" interleaved")
    assert "interleaved" not in label(by_name["megatron-tp2-pp2"])
    assert label(by_name["megatron-tp2-pp2"]) != label(by_name["megatron-tp2-pp2-v2"])


def test_the_layout_column_names_compression_and_the_other_settings_flags_change():
    by_name = {c.name: c for c in slow_link.CONTENDERS}
    labels = {name: _layout_label(by_name[name]) for name in
              ("hybrid-tp2-z2", "hybrid-tp2-z2-q", "dp4-z3-q-hpz", "dp4-z2-2l", "hybrid-tp2-z0-1bit",
               "hybrid-tp2-z1-opg")}
    assert labels["hybrid-tp2-z2"] == "TP2xDP2 Z2 mb4 once"
    assert labels["hybrid-tp2-z2-q"] == "TP2xDP2 Z2 mb4 once grads int4 weights int8"
    assert labels["dp4-z3-q-hpz"] == "TP1xDP4 Z3 mb4 grads int4 weights int8 hpZ 2"
    assert labels["dp4-z2-2l"] == "TP1xDP4 Z2 mb4 2-level"
    assert labels["hybrid-tp2-z0-1bit"] == "TP2xDP2 Z0 mb4 onebit_adam"
    assert labels["hybrid-tp2-z1-opg"] == "TP2xDP2 Z1 mb4 overlapped gather"
    # every contender of the same layout and zero settings but other flags reads differently
    hybrid = [c for c in slow_link.CONTENDERS if c.peer is None]
    assert len({_layout_label(c) for c in hybrid}) == len(hybrid)
