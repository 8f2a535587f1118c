"""Saving and loading from 4 gloo ranks (TP=2 x DP=2), then a rank SIGKILLed mid-save.

One ``run_distributed`` call covers it all (process start-up dominates the
cost): the ranks report their checks in JSON files before the kill, since the
kill ends the run.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from hybrid.layout import ParallelLayout
from hybrid.topology import Topology
from tests.checkpoint.shard_fixtures import (assert_state_equal, kill_self_after, model_shard,
                                             optimizer_shard, save_rank)
from tests.multiproc import ChildFailed, run_distributed

VICTIM = 3  # tp=1, dp=1: writes an optimizer shard and a per-rank file, no model file


def _layout(topo: Topology) -> ParallelLayout:
    return topo.layout(zero_stage=1, precision="fp32")


def _save_load_then_die(save_dir: str, report_dir: str) -> None:
    topo = Topology(tp=2)
    c, gather = topo.coord, topo.comm.all_gather_object
    save_rank(save_dir, 1, _layout(topo), c, gather=gather)

    reader = CheckpointReader(save_dir)
    assert reader.iteration == 1 and reader.layout == _layout(topo)
    assert_state_equal(reader.load_model_shard(c.tp),
                       {k: v.contiguous() for k, v in model_shard(c.tp).items()})
    assert_state_equal(reader.load_optimizer_shard(c.tp, c.dp), optimizer_shard(c.tp, c.dp, 1))
    assert torch.equal(reader.load_rank_state(c.tp, c.dp)["rng"], torch.tensor([c.tp, c.dp, 1]))

    # One rank's bad state fails the save on every rank, with the same message.
    bad = optimizer_shard(c.tp, c.dp) if topo.rank != 2 else {"step": np.float32(1.0)}
    try:
        save_checkpoint(save_dir, 2, _layout(topo), c, model_state=model_shard(c.tp),
                        optimizer_state=bad, all_gather_object=gather)
        error = None
    except CheckpointError as e:
        error = str(e)
    save_rank(save_dir, 2, _layout(topo), c, gather=gather, keep_last=1)

    report = {"verified": sorted(reader._verified), "error": error}
    Path(report_dir, f"rank{topo.rank}.json").write_text(json.dumps(report))
    gather(None)  # every report is on disk before the victim dies
    if topo.rank == VICTIM:
        kill_self_after(200)  # inside its optimizer shard of iteration 3
    save_rank(save_dir, 3, _layout(topo), c, gather=gather, keep_last=1)


@pytest.mark.timeout(120)
def test_four_ranks_round_trip_then_survive_a_killed_rank(tmp_path):
    save_dir = tmp_path / "ckpt"
    with pytest.raises(ChildFailed) as failure:
        run_distributed(_save_load_then_die, 4, str(save_dir), str(tmp_path), timeout=90,
                        collective_timeout_s=30)
    # Every rank got through the checks before the kill (else the failure is something else).
    missing = [r for r in range(4) if not (tmp_path / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} failed before the kill:\n{failure.value}"
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(reports):
        t, d = rank % 2, rank // 2
        # Each rank verified exactly the files it read.
        assert r["verified"] == sorted([f"model_tp{t:02d}.safetensors",
                                        f"optim_tp{t:02d}_dp{d:02d}.pt",
                                        f"rank_tp{t:02d}_dp{d:02d}.pt"])
        assert "rank (tp=0, dp=1, pp=0)" in r["error"] and "numpy.float32" in r["error"], r["error"]
    assert len({r["error"] for r in reports}) == 1

    # Iteration 2 completed (pruning iteration 1); iteration 3 died with rank 3.
    assert (save_dir / "latest").read_text() == "iter_0000002\n"
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]
    partial = save_dir / "iter_0000003"
    assert not (partial / "metadata.json").exists()
    assert any(".tmp." in p.name for p in partial.iterdir())
    reader = CheckpointReader(save_dir)
    assert reader.iteration == 2 and reader.consumed_samples == 32
    assert len(reader.manifest.files) == 2 + 4 + 4
    reader.verify_all()
    assert_state_equal(reader.load_optimizer_shard(1, 1), optimizer_shard(1, 1, 2))
    assert_state_equal(reader.load_model_shard(1),
                       {k: v.contiguous() for k, v in model_shard(1).items()})
