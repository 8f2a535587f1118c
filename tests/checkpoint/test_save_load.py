import json
import random

import numpy as np
import pytest
import torch

from hybrid.checkpoint import (CheckpointError, CheckpointFormatError, CheckpointNotFoundError,
                               CheckpointReader, CheckpointWriter, ChecksumMismatchError,
                               IncompleteCheckpointError, MissingShardError, capture_rng_state,
                               has_checkpoint, model_file, model_positions, optimizer_file,
                               rank_positions, rank_state_file, restore_rng_state, save_checkpoint)
from hybrid.checkpoint.atomic import sha256_of_file
from hybrid.layout import ParallelLayout
from hybrid.topology import Coord
from tests.checkpoint.shard_fixtures import (assert_state_equal, manifest_fields, model_shard,
                                             optimizer_shard, save_rank)

LAYOUT = ParallelLayout(tp=2, dp=2, zero_stage=1, precision="bf16")


def _write_all_ranks(save_dir, iteration, layout=LAYOUT, keep_last=None):
    """One process writes every rank's files, as an offline conversion tool would."""
    writer = CheckpointWriter(save_dir, iteration, layout)
    writer.prepare()
    records = [writer.write_model_shard(model_shard(t), t) for t, _ in model_positions(layout)]
    for t, d, _ in rank_positions(layout):
        records.append(writer.write_optimizer_shard(optimizer_shard(t, d, iteration), t, d))
    writer.commit(records, keep_last=keep_last, **manifest_fields(iteration))
    return writer.iter_dir


def test_round_trip_every_shard_and_the_manifest(tmp_path):
    iter_dir = _write_all_ranks(tmp_path, 40)
    assert iter_dir == tmp_path / "iter_0000040"
    assert (tmp_path / "latest").read_text() == "iter_0000040\n"
    assert sorted(p.name for p in iter_dir.iterdir()) == [
        "metadata.json", "model_tp00.safetensors", "model_tp01.safetensors",
        "optim_tp00_dp00.pt", "optim_tp00_dp01.pt", "optim_tp01_dp00.pt", "optim_tp01_dp01.pt"]
    reader = CheckpointReader(tmp_path)
    assert reader.path == iter_dir and reader.iteration == 40
    assert reader.layout == LAYOUT
    expected = manifest_fields(40)
    assert reader.consumed_samples == expected["consumed_samples"]
    assert reader.model_config == expected["model_config"]
    assert reader.param_index == expected["param_index"]
    assert reader.trainer_state == expected["trainer_state"]
    assert reader.has_optimizer_state and not reader.has_rank_state
    for t in range(2):
        shard = reader.load_model_shard(t)
        assert_state_equal(shard, {k: v.contiguous() for k, v in model_shard(t).items()})
        for d in range(2):
            loaded = reader.load_optimizer_shard(t, d)
            assert_state_equal(loaded, optimizer_shard(t, d, 40))
    with reader.open_model_shard(1) as f:
        assert torch.equal(f.get_tensor("layers.0.qkv.bias"), model_shard(1)["layers.0.qkv.bias"])
    assert reader.model_shard_header(0)["embedding.weight"] == ((16, 8), "BF16")
    # The manifest is plain JSON and records every file's true digest.
    doc = json.loads((iter_dir / "metadata.json").read_text())
    assert doc["layout"] == {"tp": 2, "dp": 2, "pp": 1, "zero_stage": 1, "precision": "bf16"}
    for name, rec in doc["files"].items():
        assert rec["sha256"] == sha256_of_file(iter_dir / name).sha256
    assert CheckpointReader(iter_dir).iteration == 40  # an explicit iteration dir loads too


def test_single_process_save_with_rng_state_resumes_the_same_random_stream(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    save_checkpoint(tmp_path, 7, ParallelLayout(tp=1, dp=1), Coord(0, 0, 0), model_state=model_shard(0),
                    rank_state=capture_rng_state(), **manifest_fields(7))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    restore_rng_state(CheckpointReader(tmp_path).load_rank_state(0, 0))
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]
    with pytest.raises(CheckpointError, match="without optimizer state"):
        CheckpointReader(tmp_path).load_optimizer_shard(0, 0)


def test_corrupted_shard_names_the_file(tmp_path):
    iter_dir = _write_all_ranks(tmp_path, 10)
    victim = iter_dir / "optim_tp01_dp00.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    reader = CheckpointReader(tmp_path)
    reader.load_optimizer_shard(0, 0)  # other files still load
    with pytest.raises(ChecksumMismatchError, match=r"optim_tp01_dp00\.pt.*corrupted"):
        reader.load_optimizer_shard(1, 0)
    with pytest.raises(ChecksumMismatchError, match=r"optim_tp01_dp00\.pt"):
        reader.verify_all()


def test_truncated_and_missing_shards(tmp_path):
    iter_dir = _write_all_ranks(tmp_path, 10)
    model = iter_dir / "model_tp01.safetensors"
    model.write_bytes(model.read_bytes()[:-4])
    with pytest.raises(ChecksumMismatchError, match=r"model_tp01\.safetensors has \d+ bytes"):
        CheckpointReader(tmp_path).load_model_shard(1)
    (iter_dir / "model_tp00.safetensors").unlink()
    with pytest.raises(MissingShardError, match=r"model_tp00\.safetensors is missing"):
        CheckpointReader(tmp_path).load_model_shard(0)


def test_incomplete_directory_is_refused_and_latest_kept(tmp_path):
    _write_all_ranks(tmp_path, 10)
    partial = tmp_path / "iter_0000020"
    partial.mkdir()
    (partial / "model_tp00.safetensors").write_bytes(b"half")
    assert CheckpointReader(tmp_path).iteration == 10
    with pytest.raises(IncompleteCheckpointError,
                       match=r"iter_0000020 has no metadata.json.*points at iter_0000010"):
        CheckpointReader(partial)


def test_next_save_cleans_up_leftovers(tmp_path):
    _write_all_ranks(tmp_path, 10)
    (tmp_path / "iter_0000015").mkdir()
    (tmp_path / "iter_0000015" / "optim_tp00_dp00.pt.tmp.123").write_bytes(b"x")
    (tmp_path / "latest.tmp.456").write_bytes(b"iter_00")
    _write_all_ranks(tmp_path, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000010", "iter_0000020", "latest"]


def test_keep_last_removes_only_older_complete_checkpoints(tmp_path):
    for it in (10, 20, 30):
        _write_all_ranks(tmp_path, it, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000020", "iter_0000030", "latest"]
    # A run rolled back to iteration 20 saves 25: 30 (another timeline) is left alone.
    _write_all_ranks(tmp_path, 25, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000025", "iter_0000030", "latest"]
    assert CheckpointReader(tmp_path).iteration == 25


def test_resaving_the_iteration_latest_points_at(tmp_path):
    _write_all_ranks(tmp_path, 10)
    save_rank(tmp_path, 20, ParallelLayout(tp=1, dp=1), Coord(0, 0, 0), scale=1.0)
    save_rank(tmp_path, 20, ParallelLayout(tp=1, dp=1), Coord(0, 0, 0), scale=2.0)
    reader = CheckpointReader(tmp_path)
    assert reader.iteration == 20 and reader.layout == ParallelLayout(tp=1, dp=1)
    assert torch.equal(reader.load_model_shard(0)["final_norm.weight"], torch.full((8,), 2.0))


def test_nothing_to_load(tmp_path):
    assert not has_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    _write_all_ranks(tmp_path, 10)
    assert has_checkpoint(tmp_path)
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no 'latest' file.*iter_0000010"):
        CheckpointReader(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointNotFoundError, match="not an iteration directory name"):
        CheckpointReader(tmp_path)


def test_unsupported_manifest_version(tmp_path):
    iter_dir = _write_all_ranks(tmp_path, 10)
    doc = json.loads((iter_dir / "metadata.json").read_text())
    doc["format_version"] = 99
    (iter_dir / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError, match="format_version 99"):
        CheckpointReader(tmp_path)


def test_values_that_would_not_load_are_refused_at_save(tmp_path):
    layout, coord = ParallelLayout(tp=1, dp=1), Coord(0, 0, 0)
    with pytest.raises(CheckpointError, match=r"optimizer state for optim_tp00_dp00\.pt\['step'\].*"
                                              r"numpy"):
        save_checkpoint(tmp_path, 1, layout, coord, model_state=model_shard(0),
                        optimizer_state={"step": np.int64(3)})
    with pytest.raises(CheckpointError, match=r"model_config\['dropout'\].*Tensor"):
        save_checkpoint(tmp_path, 1, layout, coord, model_state=model_shard(0),
                        model_config={"dropout": torch.tensor(0.1)})
    with pytest.raises(CheckpointError, match=r"trainer_state\['best'\]: inf"):
        save_checkpoint(tmp_path, 1, layout, coord, model_state=model_shard(0),
                        trainer_state={"best": float("inf")})
    assert not has_checkpoint(tmp_path)


def test_commit_refuses_a_missing_rank_file(tmp_path):
    writer = CheckpointWriter(tmp_path, 5, LAYOUT)
    writer.prepare()
    records = [writer.write_model_shard(model_shard(0), 0)]  # TP rank 1 never wrote
    with pytest.raises(CheckpointError, match=r"missing 1 file\(s\): model_tp01\.safetensors"):
        writer.commit(records)
    assert not (writer.iter_dir / "metadata.json").exists() and not has_checkpoint(tmp_path)


def test_layout_and_coord_validation(tmp_path):
    with pytest.raises(CheckpointError, match=r"coord.dp = 1 is outside \[0, 1\)"):
        save_checkpoint(tmp_path, 1, ParallelLayout(tp=2, dp=1), Coord(0, 1, 0), model_state={})
    with pytest.raises(CheckpointError, match=r"keep_last \(--keep-last\) must be an integer >= 1"):
        save_checkpoint(tmp_path, 1, ParallelLayout(tp=1, dp=1), Coord(0, 0, 0), model_state={},
                        keep_last=0)
    with pytest.raises(CheckpointError, match="must be a hybrid.layout.ParallelLayout"):
        save_checkpoint(tmp_path, 1, {"tp": 1, "dp": 1}, Coord(0, 0, 0), model_state={})
    assert not any(tmp_path.iterdir())  # refused before touching the disk


def test_file_names_of_a_layout():
    layout = ParallelLayout(tp=2, dp=2, pp=2, zero_stage=1)
    assert model_file(layout, 1, 1) == "model_tp01_pp01.safetensors"
    assert optimizer_file(layout, 1, 0, 1) == "optim_tp01_dp00_pp01.pt"
    assert rank_state_file(layout, 0, 1, 0) == "rank_tp00_dp01_pp00.pt"
    flat = ParallelLayout(tp=2, dp=3)  # no pipeline: names carry no pp part
    assert model_file(flat, 1) == "model_tp01.safetensors" and optimizer_file(flat, 1, 2) == "optim_tp01_dp02.pt"
    assert list(model_positions(layout)) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert list(rank_positions(flat)) == [(t, d, 0) for d in range(3) for t in range(2)]  # global-rank order
    with pytest.raises(CheckpointFormatError, match=r"dp rank 3 is outside \[0, 3\) for layout tp=2 dp=3"):
        optimizer_file(flat, 0, 3)


@pytest.mark.parametrize("layout,match", [
    ({"tp": 2, "dp": 2, "pp": 1, "zero_stage": 4, "precision": "bf16"}, "zero_stage must be 0, 1, 2 or 3, got 4"),
    ({"tp": 2, "dp": 2, "pp": 1, "zero_stage": 1, "precision": "fp8"}, "precision must be one of"),
    ({"tp": 0, "dp": 2, "pp": 1, "zero_stage": 1, "precision": "bf16"}, "tp must be an integer >= 1"),
    ({"tp": 2, "dp": 2, "pp": 1, "zero_stage": 1, "precision": "bf16", "cp": 2}, r"unknown keys \['cp'\]"),
    ({"tp": 2, "dp": 3, "pp": 1, "zero_stage": 1, "precision": "bf16", "ep": 2},
     r"--expert-model-parallel-size 2 must divide the data-parallel ranks"),
    ([2, 2], "layout must be a JSON object"),
])
def test_a_bad_layout_in_the_manifest_names_the_file(tmp_path, layout, match):
    iter_dir = _write_all_ranks(tmp_path, 10)
    doc = json.loads((iter_dir / "metadata.json").read_text())
    doc["layout"] = layout
    (iter_dir / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError, match=rf"iter_0000010/metadata\.json: .*{match}"):
        CheckpointReader(tmp_path)


def test_manifest_cannot_point_outside_its_directory(tmp_path):
    iter_dir = _write_all_ranks(tmp_path, 10)
    doc = json.loads((iter_dir / "metadata.json").read_text())
    doc["files"]["../../escape"] = dict(doc["files"]["optim_tp00_dp00.pt"], name="../../escape")
    (iter_dir / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError, match="plain name inside the iteration directory"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("stuck_call,phase,work", [
    ("write_model_shard", "writing shards", "writing this rank's files"),
    ("prepare", "preparing the directory", "preparing the directory"),
    ("commit", "writing metadata.json and latest", "writing metadata.json and latest"),
])
def test_a_write_stuck_on_the_file_system_fails_the_save_in_time_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, stuck_call, phase, work):
    import threading
    import time

    layout, coord = ParallelLayout(tp=1, dp=1), Coord(0, 0, 0)
    save_checkpoint(tmp_path, 1, layout, coord, model_state=model_shard(0), **manifest_fields(1))
    stuck = threading.Event()  # file work that never returns, as on a hung file system, until the test ends
    monkeypatch.setattr(CheckpointWriter, stuck_call, lambda *a, **k: stuck.wait())
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=rf"saving .*iter_0000002 failed while {phase}: rank \(tp=0, dp=0, "
                                                  rf"pp=0\): CheckpointError: {work} in .* did not finish within "
                                                  rf"1\.6 s"):
            save_checkpoint(tmp_path, 2, layout, coord, model_state=model_shard(0), collective_timeout_s=2.0,
                            **manifest_fields(2))
        assert time.perf_counter() - started < 2.0  # within the share, before the peers' exchange times out
    finally:
        stuck.set()
    assert CheckpointReader(tmp_path).iteration == 1  # latest stays on the last complete checkpoint


def test_releasing_the_save_lock_on_a_stuck_file_system_gives_up_in_time(tmp_path, monkeypatch, caplog):
    import threading
    import time

    from hybrid import lockfile
    from hybrid.checkpoint import lock as save_lock

    held = save_lock.SaveDirLock(tmp_path).acquire()
    stuck = threading.Event()  # the guard's open never returns, as on a hung mount, until the test ends
    monkeypatch.setattr(lockfile, "release", lambda *a, **k: stuck.wait())
    monkeypatch.setattr(save_lock, "LOCK_FILE_TIMEOUT_S", 0.5)
    started = time.perf_counter()
    try:
        with caplog.at_level("WARNING", logger=save_lock.__name__):
            held.release()
        assert time.perf_counter() - started < 1.5  # the run goes on to exit and report
    finally:
        stuck.set()
    assert "gave up removing the lock" in caplog.text and "after 0.5 s" in caplog.text
    assert not held.held and (tmp_path / "save.lock").exists()  # left for the next job to break


def test_taking_the_save_lock_on_a_stuck_file_system_fails_in_time_naming_the_folder(tmp_path, monkeypatch):
    import threading
    import time

    from hybrid import lockfile
    from hybrid.checkpoint import lock as save_lock

    stuck = threading.Event()
    monkeypatch.setattr(lockfile, "try_take", lambda *a, **k: stuck.wait())
    monkeypatch.setattr(save_lock, "LOCK_FILE_TIMEOUT_S", 0.5)
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError, match=rf"cannot lock the save directory {tmp_path} \(--save\): the file "
                                                  rf"system did not answer within 0\.5 s"):
            save_lock.SaveDirLock(tmp_path).acquire()
        assert time.perf_counter() - started < 1.5
    finally:
        stuck.set()
    monkeypatch.undo()
    with save_lock.SaveDirLock(tmp_path) as held:  # nothing was left held: the folder can be locked again
        assert held.held and (tmp_path / "save.lock").exists()
    assert not (tmp_path / "save.lock").exists()
