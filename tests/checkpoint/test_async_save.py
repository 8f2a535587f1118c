"""Background checkpoint saving (``checkpoint.async_save``): the same guarantees as a synchronous save.

* The state written is the state at the save, even when training changes it
  before the writer starts (the writer is held back until it has), for ZeRO
  stages 0-3, optimizer offload and a bounded host copy (2 gloo ranks).
* A rank SIGKILLed during the background write, or between the snapshot and
  the write, leaves ``latest`` on the previous complete checkpoint, which
  loads and verifies.
* A failed background write is reported at the next collection as one line
  naming the file; ``latest`` stays; the next save works.
* SIGTERM with a save in flight: the trainer waits for it, then saves the
  final state, both verify; the save-folder lock is held until then.

Resuming exactly after an asynchronous save is also covered by
tests/engine/test_engine_checkpoint.py and tests/training/test_resume.py.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import hybrid
from hybrid.checkpoint import CheckpointError, CheckpointReader, IncompleteCheckpointError, background
from hybrid.checkpoint.atomic import AtomicHashedFile
from hybrid.checkpoint.layout import SAVE_LOCK_FILE
from hybrid.checkpoint.save import PhasedSave
from hybrid.topology import Topology
from tests.engine.test_engine_checkpoint import _train
from tests.zero.common import clone_state
from tests.multiproc import ChildFailed, run_distributed


def _model(width=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 1))


def _engine(stage=1, offload="none", chunk_mb=None, topology=None, width=32):
    zero = {"stage": stage, "offload_optimizer": offload}
    if stage == 3:
        zero["persistence_threshold"] = 16
    config = {"zero": zero, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
              "micro_batch_size": 4, "gradient_accumulation_steps": 2,  # as tests/engine's _train steps
              "checkpoint": {"async_save": True, "async_save_chunk_mb": chunk_mb}}
    return hybrid.initialize(_model(width), config, topology=topology or Topology(tp=1))


def _weights(engine):
    with engine.gathered_parameters():
        return [p.detach().clone() for p in engine.module.parameters()]


class _Hold:
    """Holds the background writer when it calls ``owner.name`` until :meth:`release`; :meth:`undo` restores.

    The default holds it before each file it writes, after it has copied the live state it was handed.
    """

    def __init__(self, owner=PhasedSave, name="_write_part"):
        self.go = threading.Event()
        self.owner, self.name, self.original = owner, name, getattr(owner, name)

        def held(*args, **kwargs):
            if threading.current_thread().name == background.THREAD_NAME and not self.go.wait(60):
                raise TimeoutError("the test never released the writer")
            return self.original(*args, **kwargs)

        setattr(owner, name, held)

    def release(self):
        self.go.set()

    def undo(self):
        setattr(self.owner, self.name, self.original)


# ---- what is written is the state at the save, in every layout (2 ranks) --------------------------------
# (stage, offload, async_save_chunk_mb, model width). The last: a 1 MiB bound below the model shard and the
# optimizer partition (about 1.6 MB each), which are written from the live state before the save returns.
FAST_CASES = [(3, "none", None, 32), (1, "none", 1, 50_000)]
CASES = [(0, "none", None, 32), (1, "none", None, 32), (2, "none", None, 32), (2, "cpu", None, 32)] + FAST_CASES


def _save_while_training(save_root: str, cases):
    out = {}
    for stage, offload, chunk, width in cases:
        save_dir = os.path.join(save_root, f"z{stage}-{offload}-{chunk}")
        hold = _Hold()
        engine = _engine(stage, offload, chunk, width=width)
        _train(engine, 2, seed=1)
        at_save = _weights(engine)
        if chunk is not None:  # the parts written live are written before save_checkpoint returns: let it run
            hold.release()
        engine.save_checkpoint(save_dir)
        written_before_return = list(engine.checkpoints.saver._flight["files"])
        after = _train(engine, 2, seed=2)  # changes every live tensor while the writer waits
        in_flight = chunk is not None or engine.poll_checkpoint() is None  # collective: every rank polls
        hold.release()
        report = engine.wait_checkpoint()
        report.verify()
        hold.undo()
        resumed = _engine(stage, offload, chunk, width=width)
        info = resumed.load_checkpoint(save_dir)
        out[(stage, offload, chunk, width)] = {
            "iteration": info["iteration"], "report": (report.iteration, report.nbytes, report.snapshot_bytes),
            "weights_equal": all(torch.equal(a, b) for a, b in zip(at_save, _weights(resumed))),
            "continues": _train(resumed, 2, seed=2) == after, "in_flight": in_flight,
            "written_before_return": written_before_return, "files": report.files}
        engine.close()
        resumed.close()
    return out


@pytest.mark.parametrize("cases", [pytest.param(FAST_CASES, id="z3-and-bounded"),
                                   pytest.param(CASES, id="every-stage-and-offload", marks=pytest.mark.slow)])
def test_the_background_save_writes_the_state_at_the_save_in_every_layout(tmp_path, cases):
    results = run_distributed(_save_while_training, 2, str(tmp_path), cases, timeout=240)
    for rank, out in enumerate(results):
        for case in cases:
            r = out[case]
            assert r["iteration"] == 2 and r["report"][0] == 2 and r["report"][1] > 0, (case, r)
            assert r["weights_equal"] and r["continues"], (rank, case, r)
            optim = f"optim_tp00_dp{rank:02d}.pt"
            if case[2] is None:
                assert r["in_flight"] and r["written_before_return"] == [], (rank, case, r)
                assert r["report"][2] > 0
            else:  # bounded: the large files were written live first, only the RNG state was copied
                live = (["model_tp00.safetensors"] if rank == 0 else []) + [optim]
                assert r["written_before_return"][:len(live)] == live, (rank, r)
                assert 0 < r["report"][2] < 1 << 20, r
            assert optim in r["files"]


# ---- the fence: the next update waits for the writer's copy of the live state ----------------------------------
def _tensors_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "cpu"), (3, "none")])
def test_the_next_update_waits_for_the_writers_copy_of_the_live_state(tmp_path, monkeypatch, stage, offload):
    from hybrid.checkpoint.snapshot import HostSnapshot

    # The writer is released once training waits at the fence (not after a fixed time: on a loaded machine the
    # forward and backward could outlast it, and the fence would then not wait at all).
    waiting, fence = threading.Event(), background.BackgroundSaver.fence

    def noting_fence(saver):
        if not saver._copied.is_set():
            waiting.set()
        return fence(saver)

    monkeypatch.setattr(background.BackgroundSaver, "fence", noting_fence)
    engine = _engine(stage, offload, topology=Topology.local())
    _train(engine, 1, seed=1)
    model_at_save = clone_state(dict(engine.optimizer.model_state_for_save()))
    optimizer_at_save = clone_state(engine.optimizer.state_dict())
    hold = _Hold(HostSnapshot, "run")  # the writer's copy of the tensors it was handed live
    released = threading.Event()

    def release():
        if waiting.wait(120):
            released.set()
        hold.release()

    try:
        engine.save_checkpoint(tmp_path)
        threading.Thread(target=release, daemon=True).start()
        _train(engine, 1, seed=2)  # forward and backward run; the update waits at the fence for the copy
        assert released.is_set(), "the optimizer step finished while the writer had not copied the state"
        report = engine.wait_checkpoint()
    finally:
        hold.release()
        hold.undo()
    assert 0 < report.fence_s <= report.blocking_s, report
    reader = CheckpointReader(tmp_path)
    reader.verify_all()
    assert _tensors_equal(dict(reader.load_model_shard(0, 0)), model_at_save)
    saved = reader.load_optimizer_shard(0, 0, 0)
    assert _tensors_equal(saved["groups"], optimizer_at_save["groups"])
    assert saved["step"] == optimizer_at_save["step"] == 1 and saved["global_steps"] == 1
    engine.close()


# ---- a failed background write ------------------------------------------------------------------------------
def test_a_failed_background_write_is_reported_naming_the_file_and_latest_stays(tmp_path, monkeypatch):
    engine = _engine(topology=Topology.local())
    _train(engine, 1, seed=1)
    engine.save_checkpoint(tmp_path)
    engine.wait_checkpoint()
    original = AtomicHashedFile.write

    def broken(self, data):
        if self.path.name.startswith("optim_"):
            raise OSError(errno.EIO, "Input/output error", str(self.path))
        return original(self, data)

    monkeypatch.setattr(AtomicHashedFile, "write", broken)
    _train(engine, 1, seed=2)
    engine.save_checkpoint(tmp_path)
    assert engine.checkpoints.saver._done.wait(30)
    _train(engine, 1, seed=3)  # training goes on; the failure is reported at the next collection
    with pytest.raises(CheckpointError) as failure:
        engine.poll_checkpoint()
    message = str(failure.value)
    assert "\n" not in message
    assert f"the background save of {tmp_path / 'iter_0000002'} failed, so {tmp_path / 'latest'} still names " \
           f"the previous checkpoint" in message, message
    assert f"{tmp_path / 'iter_0000002' / 'optim_tp00_dp00.pt'}" in message and "Input/output error" in message
    assert engine.poll_checkpoint() is None  # reported once
    assert CheckpointReader(tmp_path).iteration == 1
    CheckpointReader(tmp_path).verify_all()
    monkeypatch.setattr(AtomicHashedFile, "write", original)
    engine.save_checkpoint(tmp_path)  # the next save clears the unfinished directory and succeeds
    assert engine.wait_checkpoint().iteration == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000003", "latest"]
    engine.close()


def test_the_save_folder_lock_is_held_while_a_background_save_is_in_flight(tmp_path):
    from hybrid.checkpoint.writer import CheckpointWriter

    hold = _Hold(CheckpointWriter, "write_model_shard")
    try:
        engine = _engine(topology=Topology.local())
        _train(engine, 1, seed=1)
        engine.save_checkpoint(tmp_path)
        lock = tmp_path / SAVE_LOCK_FILE
        assert f'"pid": {os.getpid()}' in lock.read_text().replace('"pid":{', '"pid": {')
        assert engine.poll_checkpoint() is None
        hold.release()
        engine.wait_checkpoint().verify()
        assert not lock.exists()  # released by the writer once the save is committed
        engine.close()
    finally:
        hold.undo()


# ---- SIGKILL of a rank during the background save --------------------------------------------------------
def _killed_in_background(save_dir: str, when: str):
    engine = _engine()
    _train(engine, 1, seed=1)
    engine.save_checkpoint(save_dir)
    engine.wait_checkpoint()
    if engine.topology.rank == 1:
        if when == "between snapshot and write":
            PhasedSave.write = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        else:  # half-way through the optimizer partition, the second file it writes
            original = AtomicHashedFile.write

            def killing(self, data):
                if self.path.name.startswith("optim_") and threading.current_thread().name == background.THREAD_NAME:
                    original(self, bytes(memoryview(data).cast("B")[:64]))
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(self, data)

            AtomicHashedFile.write = killing
    _train(engine, 1, seed=2)
    engine.save_checkpoint(save_dir)
    _train(engine, 1, seed=3)
    engine.wait_checkpoint()  # rank 0: fails once rank 1 is gone (or the run is ended first)
    return np.zeros(1)


# The kill during the write runs the synchronous save's write code (PhasedSave.write), whose kill mid-shard
# tests/checkpoint/test_distributed.py covers in the default run; here it is under -m slow.
@pytest.mark.parametrize("when", [pytest.param("during the write", marks=pytest.mark.slow),
                                  "between snapshot and write"])
def test_a_rank_killed_in_a_background_save_leaves_latest_on_the_previous_checkpoint(tmp_path, when):
    with pytest.raises(ChildFailed, match=r"rank\(s\) \[1\] .*died with exit codes \[-9\]|rank 0 .*failed"):
        run_distributed(_killed_in_background, 2, str(tmp_path), when, timeout=120, collective_timeout_s=30)
    assert (tmp_path / "latest").read_text() == "iter_0000001\n"
    reader = CheckpointReader(tmp_path)
    assert reader.iteration == 1
    reader.verify_all()
    engine = _engine(topology=Topology.local())
    assert engine.load_checkpoint(tmp_path / "iter_0000001", load_optimizer=False)["iteration"] == 1
    partial = tmp_path / "iter_0000002"
    if partial.exists():  # rank 0's writer got that far: never complete
        with pytest.raises(IncompleteCheckpointError):
            CheckpointReader(partial)


# ---- SIGTERM with a save in flight (the trainer) -----------------------------------------------------------
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--eval-interval", "0", "--log-interval", "100", "--async-save"]


def _sigterm_while_saving(save_dir: str):
    import hybrid.training.trainer as trainer_module
    from hybrid.training import Trainer, parse_args, validate

    lines = []
    trainer_module._log = lambda topology, message: lines.append(message)
    original_write, original_wait = PhasedSave._write_part, background.BackgroundSaver.wait
    waiting = threading.Event()

    def wait(self):
        if self.in_flight:
            waiting.set()
        return original_wait(self)

    def signalled(self, *args, **kwargs):
        if self.writer.iteration == 2 and not waiting.is_set():  # the save in flight when the signal arrives
            lines.append(f"lock held: {(Path(save_dir) / SAVE_LOCK_FILE).exists()}")
            os.kill(os.getpid(), signal.SIGTERM)
            # Held until the trainer, having seen the signal, waits for this save: it is in flight then.
            assert waiting.wait(60), "the trainer never waited for the save in flight"
        return original_write(self, *args, **kwargs)

    background.BackgroundSaver.wait = wait
    PhasedSave._write_part = signalled  # each file, after the writer copied the state (the next update waits)
    cfg = parse_args(TINY + ["--train-iters", "100", "--save", save_dir, "--save-interval", "2"])
    validate(cfg, world_size=1)
    trainer = Trainer(cfg)
    last = trainer.train()
    return last, lines


def test_sigterm_with_a_save_in_flight_waits_for_it_then_saves_the_final_state(tmp_path):
    save = tmp_path / "ckpt"
    ((last, lines),) = run_distributed(_sigterm_while_saving, 1, str(save), timeout=120)
    assert last == 3, lines
    saved = [line for line in lines if "checkpoint" in line or line.startswith(("exiting", "lock"))]
    order = [next(i for i, line in enumerate(saved) if line.startswith(prefix)) for prefix in (
        "lock held: True", f"saved checkpoint {save / 'iter_0000002'} in the background",
        f"saving checkpoint {save / 'iter_0000003'} in the background", "exiting at iteration 3",
        f"saved checkpoint {save / 'iter_0000003'} in the background")]
    assert order == sorted(order), saved
    assert "verified" in saved[order[1]] and "verified" in saved[order[4]], saved
    for iteration in (2, 3):
        CheckpointReader(save / f"iter_{iteration:07d}").verify_all()
    assert (save / "latest").read_text() == "iter_0000003\n"
    assert not (save / SAVE_LOCK_FILE).exists()
