"""Faults that used to destroy checkpoints (issue 13), injected one by one; each must keep what is there.

* ``latest`` missing, empty, garbled, or naming a missing or unfinished
  directory: the trainer stops with one line listing the complete checkpoints
  and how to pick one, instead of starting from scratch and pruning them. Only
  an absent or empty folder starts from scratch.
* ``--keep-last`` never deletes the newest checkpoint saved from a healthy
  state (``healthy`` in ``metadata.json``; absent counts as healthy). A full
  disk fails the save and keeps the previous checkpoint.
* Two jobs sharing one ``--save`` folder: the second is refused at start-up on
  every rank, naming the holder's host and pid, before it touches the first
  job's files in flight; a lock left by a dead process is broken.
* ``to-hf`` never copies the file a ``metadata.json`` names as the tokenizer;
  ``--tokenizer-model`` must be a SentencePiece model.
* A tampered ``metadata.json`` (checksum, layout, settings, iteration,
  truncated, not UTF-8) fails with an error naming the file, and a trainer
  given it stops before saving or pruning anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.checkpoint import (CheckpointError, CheckpointFormatError, CheckpointLockedError, CheckpointReader,
                               ChecksumMismatchError, SaveDirLock, find_resume_point, list_iterations)
from hybrid.checkpoint.layout import SAVE_LOCK_FILE
from hybrid.layout import ParallelLayout
from hybrid.lockfile import LockOwner, process_start_ticks
from hybrid.topology import Coord
from tests.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
        "--eval-interval", "0", "--log-interval", "100"]


def _trainer(argv):
    from hybrid.training import Trainer, parse_args, validate

    cfg = parse_args(TINY + argv)
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return Trainer(cfg)


def _train(argv):
    trainer = _trainer(argv)
    trainer.train()
    return [it for it, _ in trainer.history]


def _failure(argv):
    """The exception a trainer run raises (type name, message), or None when it trained."""
    try:
        _train(argv)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return None


def _contents(d: Path):
    return sorted(p.name for p in d.iterdir() if p.name != SAVE_LOCK_FILE)


# ---- 1. an unusable `latest` -------------------------------------------------------------------------------
LATEST_FAULTS = {
    "missing": None,
    "empty": b"",
    "garbled": b"\xff\xfe\x00iter_00",
    "names a missing dir": b"iter_0000009\n",
    "names an unfinished dir": b"iter_0000006\n",
}


def _latest_faults(root):
    save = Path(root) / "ckpt"
    out = {"first": _train(["--train-iters", "4", "--save", str(save), "--save-interval", "2"])}
    resume = ["--train-iters", "6", "--load", str(save), "--save", str(save), "--save-interval", "2",
              "--keep-last", "1"]
    good = (save / "latest").read_bytes()
    for fault, content in LATEST_FAULTS.items():
        (save / "latest").unlink(missing_ok=True)
        if content is not None:
            (save / "latest").write_bytes(content)
        if fault == "names an unfinished dir":
            (save / "iter_0000006").mkdir()  # a save killed before metadata.json
        out[fault] = (_failure(resume), _contents(save))
        if fault == "names an unfinished dir":
            (save / "iter_0000006").rmdir()
    (save / "latest").write_bytes(good)
    # The way out the error names: an explicit iteration.
    out["explicit"] = _train(resume[:2] + ["--load", str(save / "iter_0000004"), "--save", str(save),
                                           "--save-interval", "2", "--keep-last", "1"])
    out["after explicit"] = _contents(save)
    # Nothing to lose: an absent folder (first launch of --save DIR --load DIR) or an empty one.
    absent, empty = Path(root) / "absent", Path(root) / "empty"
    empty.mkdir()
    out["absent folder"] = _train(["--train-iters", "2", "--load", str(absent), "--save", str(absent)])
    out["empty folder"] = _train(["--train-iters", "2", "--load", str(empty), "--save", str(empty)])
    return out


def test_an_unusable_latest_stops_the_run_and_keeps_every_checkpoint(tmp_path):
    (out,) = run_distributed(_latest_faults, 1, str(tmp_path), timeout=240)
    save = tmp_path / "ckpt"
    assert out["first"] == [1, 2, 3, 4]
    for fault in LATEST_FAULTS:
        failure, contents = out[fault]
        assert failure is not None, f"latest {fault}: the run started instead of stopping"
        kind, message = failure
        assert kind == "CheckpointNotFoundError" and "\n" not in message, (fault, message)
        assert f"{save / 'latest'} " in message and "not starting from scratch" in message, message
        assert f"Complete checkpoints: iter_0000002, iter_0000004; resume one with --load " \
               f"{save / 'iter_0000004'}" in message, message
        assert {"iter_0000002", "iter_0000004"} <= set(contents), (fault, contents)
    assert "is missing" in out["missing"][0][1] and "is empty" in out["empty"][0][1]
    assert "not an iteration directory name" in out["garbled"][0][1]
    assert "names iter_0000009, which does not exist" in out["names a missing dir"][0][1]
    assert "names iter_0000006, whose save did not finish" in out["names an unfinished dir"][0][1]
    assert out["explicit"] == [5, 6] and out["after explicit"] == ["iter_0000006", "latest"]
    assert out["absent folder"] == [1, 2] and out["empty folder"] == [1, 2]


def test_a_missing_load_folder_is_accepted_only_as_the_save_folder(tmp_path):
    from hybrid.config import ConfigError
    from hybrid.training import parse_args, validate

    new = str(tmp_path / "new")
    validate(parse_args(TINY + ["--train-iters", "1", "--load", new, "--save", new]), world_size=1)
    with pytest.raises(ConfigError, match=r"'checkpoint.load' .*typo: no such directory \(a folder that does not "
                                          r"exist yet is only accepted when --save names the same folder"):
        validate(parse_args(TINY + ["--train-iters", "1", "--load", str(tmp_path / "typo"), "--save", new]),
                 world_size=1)
    assert find_resume_point(tmp_path / "new") is None


# ---- 2. keep the newest healthy checkpoint ---------------------------------------------------------------
def _save(save_dir, iteration, healthy, keep_last=1):
    from tests.checkpoint.shard_fixtures import manifest_fields, model_shard

    from hybrid.checkpoint import save_checkpoint

    return save_checkpoint(save_dir, iteration, ParallelLayout(tp=1, dp=1), Coord(0, 0, 0),
                           model_state=model_shard(0), keep_last=keep_last, healthy=healthy,
                           **manifest_fields(iteration))


def test_pruning_keeps_the_newest_healthy_checkpoint(tmp_path):
    _save(tmp_path, 1, True)
    _save(tmp_path, 2, False)
    _save(tmp_path, 3, False)
    assert _contents(tmp_path) == ["iter_0000001", "iter_0000003", "latest"]  # 1: the newest healthy
    assert not CheckpointReader(tmp_path).manifest.healthy
    assert CheckpointReader(tmp_path / "iter_0000001").manifest.healthy
    _save(tmp_path, 4, True)
    assert _contents(tmp_path) == ["iter_0000004", "latest"]
    _save(tmp_path, 5, False, keep_last=2)
    _save(tmp_path, 6, False, keep_last=2)
    assert _contents(tmp_path) == ["iter_0000004", "iter_0000005", "iter_0000006", "latest"]


def test_a_checkpoint_without_the_healthy_field_counts_as_healthy(tmp_path):
    _save(tmp_path, 1, True)
    meta = tmp_path / "iter_0000001" / "metadata.json"
    doc = json.loads(meta.read_text())
    del doc["healthy"], doc["metadata_sha256"]  # as written before either existed
    meta.write_text(json.dumps(doc))
    assert CheckpointReader(tmp_path).manifest.healthy
    _save(tmp_path, 2, False)
    assert _contents(tmp_path) == ["iter_0000001", "iter_0000002", "latest"]


def test_save_engine_records_health_and_pruning_follows_it(tmp_path):
    from tests.convert.common import GPT2_CFG, make_engine, train

    engine = make_engine(GPT2_CFG.replace(num_layers=1), stage=1)
    train(engine, 1)
    engine.save_checkpoint(tmp_path, 1, keep_last=1)
    engine.save_checkpoint(tmp_path, 2, keep_last=1, healthy=False)
    assert _contents(tmp_path) == ["iter_0000001", "iter_0000002", "latest"]
    assert [CheckpointReader(d.path).manifest.healthy for d in list_iterations(tmp_path)] == [True, False]
    engine.save_checkpoint(tmp_path, 3, keep_last=1)
    assert _contents(tmp_path) == ["iter_0000003", "latest"]


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    from hybrid.checkpoint import atomic

    _save(tmp_path, 1, True)
    original = atomic.AtomicHashedFile.write

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.AtomicHashedFile, "write", full)
    with pytest.raises(CheckpointError, match=r"saving .*iter_0000002 failed while writing shards: rank \(tp=0, "
                                              r"dp=0, pp=0\): OSError: \[Errno 28\] No space left on device"):
        _save(tmp_path, 2, True)
    assert _contents(tmp_path) == ["iter_0000001", "iter_0000002", "latest"]  # 2 is unfinished, no temp file
    assert list((tmp_path / "iter_0000002").iterdir()) == []
    assert CheckpointReader(tmp_path).iteration == 1
    monkeypatch.setattr(atomic.AtomicHashedFile, "write", original)
    _save(tmp_path, 3, True)  # the next save clears the unfinished directory
    assert _contents(tmp_path) == ["iter_0000003", "latest"]


# ---- 3. two writers ----------------------------------------------------------------------------------------
@pytest.fixture
def live_holder():
    """A live process of this host, and a function writing a save.lock in its name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])

    def hold(save_dir: Path, host: str = socket.gethostname(), pid: int = proc.pid) -> LockOwner:
        save_dir.mkdir(parents=True, exist_ok=True)
        owner = LockOwner(host, pid, process_start_ticks(pid), time.time())
        (save_dir / SAVE_LOCK_FILE).write_text(owner.to_json())
        return owner

    hold.proc = proc
    yield hold
    proc.kill()
    proc.wait(timeout=30)


def _in_flight(save_dir: Path):
    """What another job's save leaves while it runs: an unfinished iteration with a temp file."""
    part = save_dir / "iter_0000003"
    part.mkdir(parents=True)
    (part / "model_tp00.safetensors.tmp.4242").write_bytes(b"half")
    return part


def _second_trainer(save_dir):
    return _failure(["--train-iters", "2", "--save", save_dir, "--save-interval", "1"])


def test_a_second_job_on_a_save_folder_is_refused_on_every_rank_before_touching_it(tmp_path, live_holder):
    save = tmp_path / "ckpt"
    live_holder(save)
    part = _in_flight(save)
    results = run_distributed(_second_trainer, 2, str(save), timeout=240)
    for failure in results:
        assert failure is not None, "the second job trained"
        kind, message = failure
        assert kind == "CheckpointLockedError" and "\n" not in message, message
        assert f"the save directory {save} (--save) is in use by another job: {save / SAVE_LOCK_FILE} names " \
               f"pid {live_holder.proc.pid} on host {socket.gethostname()}" in message, message
        assert "give this run its own --save folder" in message and f"delete {save / SAVE_LOCK_FILE}" in message
    assert (part / "model_tp00.safetensors.tmp.4242").read_bytes() == b"half"
    assert json.loads((save / SAVE_LOCK_FILE).read_text())["pid"] == live_holder.proc.pid


def test_save_checkpoint_without_the_trainer_also_respects_the_lock(tmp_path, live_holder):
    live_holder(tmp_path)
    part = _in_flight(tmp_path)
    with pytest.raises(CheckpointError, match=r"failed while preparing the directory: .*CheckpointLockedError: "
                                              r"the save directory .* is in use by another job"):
        _save(tmp_path, 5, True)
    assert (part / "model_tp00.safetensors.tmp.4242").exists() and not (tmp_path / "iter_0000005").exists()


def test_the_lock_of_a_dead_process_is_broken_and_the_lock_is_released_at_the_end(tmp_path, live_holder):
    live_holder(tmp_path)
    live_holder.proc.kill()
    live_holder.proc.wait(timeout=30)
    with SaveDirLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        _save(tmp_path, 1, True)  # the run's own saves go through its lock
        assert lock.path.exists()
    assert not lock.path.exists()


@pytest.mark.parametrize("holder", ["another host", "unreadable"])
def test_a_lock_that_cannot_be_checked_is_refused(tmp_path, live_holder, holder):
    if holder == "another host":
        live_holder(tmp_path, host="node-that-is-not-this-one", pid=999999)
        match = "names pid 999999 on host node-that-is-not-this-one"
    else:
        (tmp_path / SAVE_LOCK_FILE).write_text("{")
        match = "exists but cannot be read"
    with pytest.raises(CheckpointLockedError, match=match):
        SaveDirLock(tmp_path).acquire()


# ---- 4. to-hf and the tokenizer ------------------------------------------------------------------------------
def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_to_hf_never_exports_the_file_metadata_names_as_tokenizer(tmp_path, capsys):
    from tests.convert.common import GPT2_CFG, randomized_state, write_weights_checkpoint

    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), 1, tokenizer=str(secret))
    tool = _tool()
    assert tool.main(["to-hf", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
                      "--no-progress"]) == 0
    assert not (tmp_path / "hf" / "tokenizer.model").exists()
    out = capsys.readouterr().out
    assert "note: no tokenizer exported: pass --tokenizer-model PATH" in out and "root:x" not in out
    assert tool.main(["to-hf", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "hf2"),
                      "--tokenizer-model", str(secret), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"convert_checkpoint to-hf: error: --tokenizer-model {secret} is not a SentencePiece " \
                          f"model (it does not load as one); pass the .model file the run was trained with"
    assert not (tmp_path / "hf2").exists()


# ---- 5. a tampered metadata.json --------------------------------------------------------------------------------
def _edit(doc):
    doc["trainer_state"]["lr_scheduler"]["num_steps"] = 7


def _flip_checksum(doc):
    doc["files"]["model_tp00.safetensors"]["sha256"] = "0" * 64


def _layout_tp2(doc):
    doc["layout"]["tp"] = 2


def _stage2(doc):
    doc["layout"]["zero_stage"] = 2


def _iteration(doc):
    doc["iteration"] = 9


CHANGED = r"iter_0000001/metadata\.json was changed after it was written"
TAMPERS = [
    # (how, whether the manifest keeps its digest, error type, message): each names the file. Without the
    # digest (a manifest from before it existed, or one whose digest was removed) the other checks still hold.
    (_flip_checksum, True, CheckpointFormatError, CHANGED),
    (_flip_checksum, False, ChecksumMismatchError, r"checksum mismatch for checkpoint file .*iter_0000001/model_tp00"),
    (_layout_tp2, True, CheckpointFormatError, r"iter_0000001/metadata\.json lists files that do not match its "
                                               r"layout tp=2 .*missing model_tp01\.safetensors"),
    (_stage2, True, CheckpointFormatError, CHANGED),
    (_edit, True, CheckpointFormatError, CHANGED),
    (_iteration, True, CheckpointFormatError, CHANGED),
    (_iteration, False, CheckpointFormatError, r"iter_0000001/metadata\.json records iteration 9 but sits in "
                                               r"iter_0000001"),
    (b'{"format": "hybrid-checkpoint", "format_ver', True, CheckpointFormatError,
     r"iter_0000001/metadata\.json is not valid JSON"),
    (b"\xff\xfe{}", True, CheckpointFormatError, r"iter_0000001/metadata\.json is not valid JSON"),
]


@pytest.mark.parametrize("tamper,digest,error,match", TAMPERS,
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else None)
def test_a_tampered_manifest_fails_naming_the_file(tmp_path, tamper, digest, error, match):
    _save(tmp_path, 1, True, keep_last=None)
    meta = tmp_path / "iter_0000001" / "metadata.json"
    if isinstance(tamper, bytes):
        meta.write_bytes(tamper)
    else:
        doc = json.loads(meta.read_text())
        tamper(doc)
        if not digest:
            del doc["metadata_sha256"]
        meta.write_text(json.dumps(doc, indent=1))
    with pytest.raises(error, match=match):
        CheckpointReader(tmp_path).verify_all()
    assert _contents(tmp_path) == ["iter_0000001", "latest"]


def _tampered_resume(save):
    save = Path(save)
    _train(["--train-iters", "4", "--save", str(save), "--save-interval", "2"])
    meta = save / "iter_0000004" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["consumed_samples"] = 0  # a plausible value: only the manifest's own digest can tell
    meta.write_text(json.dumps(doc, indent=1))
    failure = _failure(["--train-iters", "6", "--load", str(save), "--save", str(save), "--save-interval", "2",
                        "--keep-last", "1"])
    return failure, _contents(save)


def test_a_trainer_given_a_tampered_manifest_stops_and_loses_nothing(tmp_path):
    (result,) = run_distributed(_tampered_resume, 1, str(tmp_path / "ckpt"), timeout=240)
    failure, contents = result
    assert failure is not None, "the run trained from a tampered checkpoint"
    kind, message = failure
    assert kind == "CheckpointFormatError" and f"{tmp_path / 'ckpt' / 'iter_0000004' / 'metadata.json'} was " \
                                              f"changed after it was written" in message, message
    assert contents == ["iter_0000002", "iter_0000004", "latest"]
