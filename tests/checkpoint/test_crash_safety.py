"""A process killed by SIGKILL at the worst moments of a save never costs the previous checkpoint."""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import CheckpointReader, IncompleteCheckpointError
from hybrid.layout import ParallelLayout
from hybrid.topology import Coord
from tests.checkpoint.shard_fixtures import model_shard, optimizer_shard, save_rank

REPO = Path(__file__).resolve().parents[2]
LAYOUT, COORD = ParallelLayout(tp=1, dp=1), Coord(0, 0, 0)

_KILLERS = {
    # Half-way through the model shard (the first file written).
    "mid_shard": "kill_self_after(600)",
    # metadata.json of iteration 2 is written, `latest` not yet moved.
    "before_latest": textwrap.dedent("""
        import hybrid.checkpoint.directory as directory
        directory.write_latest = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    """),
    # `latest` moved to iteration 2, pruning of iteration 1 (keep_last=1) cut short.
    "mid_prune": textwrap.dedent("""
        import shutil
        shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    """),
}


def _save_and_get_killed(save_dir: Path, killer: str) -> int:
    script = textwrap.dedent("""
        import os, signal, sys
        from hybrid.layout import ParallelLayout
        from hybrid.topology import Coord
        from tests.checkpoint.shard_fixtures import kill_self_after, save_rank
        {killer}
        save_rank(sys.argv[1], 2, ParallelLayout(tp=1, dp=1), Coord(0, 0, 0), keep_last=1)
        sys.exit("the save finished: the kill never happened")
    """).format(killer=_KILLERS[killer])
    proc = subprocess.run([sys.executable, "-c", script, str(save_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return proc.returncode


def _assert_loads_iteration_1(save_dir: Path) -> None:
    reader = CheckpointReader(save_dir)
    assert reader.iteration == 1
    reader.verify_all()
    shard = reader.load_model_shard(0)
    assert torch.equal(shard["layers.0.qkv.weight"], model_shard(0)["layers.0.qkv.weight"])
    assert torch.equal(reader.load_optimizer_shard(0, 0)["flat"]["master"],
                       optimizer_shard(0, 0)["flat"]["master"])


@pytest.mark.parametrize("killer", ["mid_shard", "before_latest"])
def test_kill_before_latest_moves_keeps_the_previous_checkpoint(tmp_path, killer):
    save_rank(tmp_path, 1, LAYOUT, COORD)
    _save_and_get_killed(tmp_path, killer)
    assert (tmp_path / "latest").read_text() == "iter_0000001\n"
    _assert_loads_iteration_1(tmp_path)
    partial = tmp_path / "iter_0000002"
    if killer == "mid_shard":
        assert any(".tmp." in p.name for p in partial.iterdir())  # the torn temp file is there
        with pytest.raises(IncompleteCheckpointError, match="iter_0000002 has no metadata.json"):
            CheckpointReader(partial)
    else:
        assert CheckpointReader(partial).iteration == 2  # complete, just not yet `latest`
    # The next save clears the leftovers and moves on.
    save_rank(tmp_path, 3, LAYOUT, COORD)
    survivors = ["iter_0000001", "iter_0000003", "latest"] if killer == "mid_shard" else \
        ["iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    assert sorted(p.name for p in tmp_path.iterdir()) == survivors
    assert CheckpointReader(tmp_path).iteration == 3


def test_kill_while_pruning_leaves_the_new_checkpoint_loadable(tmp_path):
    save_rank(tmp_path, 1, LAYOUT, COORD)
    _save_and_get_killed(tmp_path, "mid_prune")
    assert (tmp_path / "latest").read_text() == "iter_0000002\n"
    reader = CheckpointReader(tmp_path)
    assert reader.iteration == 2
    reader.verify_all()
    # Pruning removed metadata.json first, so the half-removed iteration is not mistaken for a
    # complete one, and the next save finishes removing it.
    with pytest.raises(IncompleteCheckpointError):
        CheckpointReader(tmp_path / "iter_0000001")
    save_rank(tmp_path, 3, LAYOUT, COORD, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "latest"]
