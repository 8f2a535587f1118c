"""Saving in the background: training waits for a host copy of its state, a thread writes it.

:meth:`BackgroundSaver.submit` takes the arguments of
:func:`~hybrid.checkpoint.save_checkpoint` and runs the very phases that
function runs (:class:`~hybrid.checkpoint.save.PhasedSave`), split between
two threads:

1. *prepare* (collective), on the caller's thread: the coordinator takes the
   save directory's lock, clears leftovers and creates the directory;
2. *copy, then write* (local), on the writer thread: the tensors it was
   handed live are copied into reused host buffers
   (:class:`~hybrid.checkpoint.snapshot.HostSnapshot`), then every file is
   written, fsync'd and hashed on its way to disk;
3. *exchange and commit* (collective), on the caller's thread again, once
   every rank's writer has finished (:meth:`BackgroundSaver.poll`, called at
   each step boundary, finds out with one tiny ``all_gather_object``): the
   digests go to the coordinator, which writes ``metadata.json`` and moves
   ``latest``, exactly as a synchronous save does.

So the guarantees are the synchronous save's: a rank killed or a write failed
before the commit leaves ``latest`` on the previous complete checkpoint.

What training waits for: the call and the fence
------------------------------------------------
:meth:`BackgroundSaver.submit` does synchronously only what is small or
collective: the directory and its lock (phase 1), the containers of the state
rebuilt, and a host copy of what may change before the next optimizer step --
the per-rank state (RNG states: the process generators and the model's
tensor-parallel dropout streams, which every forward with dropout advances),
the counters, loss scale, LR schedule and data position (``commit_args``),
and whatever the caller does not name in ``deferred``. The parts named in
``deferred`` (the engine names the model weights and the optimizer partition:
masters and moments) are handed to the writer *live*, and copied by it first.

That is safe because of where those tensors change. The next step's forward
reads the weights (ZeRO-3 gathers copies of them into the modules) and
writes activations; backward writes gradients, which no checkpoint holds;
the weights, the fp32 masters and the moments change only in the optimizer's
update and in loads (:mod:`hybrid.zero.base`, "The write fence"). Each of
those first calls :meth:`BackgroundSaver.fence` (through the optimizer's
``write_fence``, set by the engine), which waits -- at most ``timeout_s`` --
until the writer has finished copying. That includes the CPU Adam of
optimizer offload, which updates the host masters inside the update. Module
buffers may change in forward (running statistics): the engine hands over
copies of those. ZeRO-3's model state is already a fresh host copy (gathered
unit by unit, a collective): the engine names it in ``handed_over`` and it is
written as it is, without a second copy; likewise the optimizers' lazily
assembled tensors (``state_dict(lazy=True)``) are copied once, piece by piece,
by the writer.

The time training blocks is the call plus the fence's wait
(:attr:`SaveReport.blocking_s`). When the copy ends before the next update,
as it does when a step's forward and backward take longer than copying the
rank's state, the fence does not wait at all.

Why a thread, and why no collective on it
-----------------------------------------
The writer's work is file writes, fsyncs, sha256 and memory copies, which all
release the GIL (hashlib for buffers over 2 KiB, file I/O, torch's copies):
a thread overlaps it with training without a second copy of the state in
shared memory or a second process to start (benchmarks/checkpoint_save.py
reports the step times during a background save). The writer issues no
collective: the phases that communicate run on the training thread between
steps, over the training communicator. A writer with a gloo process group of
its own was tried first: on 2 ranks (torch 2.13) its ``all_gather_object``
and the training thread's all-reduces hung against each other in the
engine's test (the cause was not found: two threads doing plain collectives
on two groups did not hang), and two threads issuing collectives at once is
fragile on NCCL besides. The price is that ``latest`` moves at the first step
boundary after the last rank finished writing, not at that very moment, and
one ``all_gather_object`` of a boolean per step while a save is in flight.

Rules
-----
* At most one save in flight: :meth:`submit` first waits for the previous
  one (and raises its failure, if nobody has collected it yet).
* :meth:`poll` (collective while a save is in flight: every rank calls it at
  the same points) commits and hands over a save that every rank has
  finished writing, once (:class:`SaveReport`), or raises its failure as one
  :class:`~hybrid.checkpoint.CheckpointError` that names the file and says
  that ``latest`` still names the previous checkpoint.
* :meth:`wait` waits for this rank's writer (at most ``timeout_s``, the job's
  collective timeout: a writer stuck on a disk is reported, never waited for
  without end), then commits as :meth:`poll`. :meth:`abandon` waits
  (bounded) without committing, for paths that are failing anyway.
* ``chunk_bytes`` bounds the host copy: the parts of the state (one file each:
  model shard, optimizer partition, RNG state, in the order they are written)
  that do not fit are written by the thread from the live tensors while the
  caller waits (no fence needed: the caller is waiting), and only the rest is
  copied, deferred or not. The extra host memory is then at most
  ``chunk_bytes``; the price is a longer wait.

The thread is a daemon, so an abandoned writer never keeps the process alive.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Tuple

from hybrid.checkpoint.errors import CheckpointError
from hybrid.checkpoint.layout import LATEST_FILE
from hybrid.checkpoint.manifest import FileRecord, checkpoint_bytes
from hybrid.checkpoint.reader import CheckpointReader
from hybrid.checkpoint.save import GatherFn, PhasedSave, gather_single_process, rank_parts
from hybrid.checkpoint.snapshot import HostSnapshot, PendingCopy, materialize_lazy, state_nbytes

log = logging.getLogger(__name__)

THREAD_NAME = "hybrid-checkpoint-writer"


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """A finished background save, as this rank saw it.

    ``blocking_s``: how long the save kept the caller (:meth:`BackgroundSaver.submit`
    from its ``started``: collecting the state, the directory, the small copies,
    with ``chunk_bytes`` the parts written from the live state) plus the
    fence's wait (:meth:`BackgroundSaver.fence`); ``write_s``: from the hand-off until this rank's files were
    durable (``latest`` moves at the next collection after every rank's
    are); ``nbytes``: the size of the whole checkpoint (every rank's files,
    from its ``metadata.json``); ``snapshot_bytes``: this rank's host copy;
    ``files``: the files this rank wrote. ``prepare_s``: the part of
    ``blocking_s`` spent preparing the directory (a gather: it waits for the
    slowest rank); ``copy_s``: copying the state to host buffers, on the
    writer thread for the deferred parts; ``fence_s``: the part of
    ``blocking_s`` training waited at the fence for that copy.
    """

    iteration: int
    path: Path
    blocking_s: float
    write_s: float
    nbytes: int
    snapshot_bytes: int
    files: Tuple[str, ...]
    prepare_s: float = 0.0
    copy_s: float = 0.0
    fence_s: float = 0.0

    def verify(self) -> None:
        """Re-read this rank's files and check them against ``metadata.json`` (size and sha256)."""
        reader = CheckpointReader(self.path)
        for name in self.files:
            reader.verify(name)


class BackgroundSaver:
    """Runs the phases of :func:`~hybrid.checkpoint.save_checkpoint` with the writes on a thread, from a host
    copy of the state.

    Args:
        timeout_s: the longest :meth:`wait` and the bounded copy wait for the
            writer thread (None: no bound, for single-process tools only).
        chunk_bytes: bound the host copy to this many bytes (None: copy all).
    """

    def __init__(self, timeout_s: Optional[float], chunk_bytes: Optional[int] = None):
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1 or None, got {chunk_bytes!r}")
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._snapshot = HostSnapshot()
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._copied = threading.Event()  # the deferred tensors are copied (or no save needs them)
        self._copied.set()
        self._save: Optional[PhasedSave] = None
        self._gather: GatherFn = gather_single_process
        self._flight: Dict[str, Any] = {}

    @property
    def in_flight(self) -> bool:
        """Whether a save was submitted and not yet committed or failed."""
        return self._save is not None

    @property
    def writer_done(self) -> bool:
        """Whether this rank's writer has finished (or none is running). Local."""
        return self._done.is_set() or self._thread is None

    # ---- starting a save ------------------------------------------------------------------------------------
    def submit(self, save_dir, iteration: int, layout, coord, *, all_gather_object: GatherFn = gather_single_process,
               model_state=None, optimizer_state=None, rank_state=None, keep_last: Optional[int] = None,
               deferred: Collection[str] = (), handed_over: Collection[str] = (), started: Optional[float] = None,
               **commit_args: Any) -> Path:
        """Start saving ``iteration``; returns its directory (complete once :meth:`poll` or :meth:`wait` reports it).

        The arguments are :func:`~hybrid.checkpoint.save_checkpoint`'s, and:
        ``deferred``: names of parts (``"model_state"``, ``"optimizer_state"``)
        whose tensors the writer copies on its thread: the caller must call
        :meth:`fence` before it changes any of them; ``handed_over``: parts
        that are fresh copies the caller no longer touches, written as they
        are. Other parts and ``commit_args`` are copied before this returns.
        ``started``: the ``time.perf_counter()`` at which the caller began
        the save, when it collected the state before calling (counted as
        blocking time too).
        Collective like :func:`~hybrid.checkpoint.save_checkpoint`: every rank
        submits its own state. A failure to prepare the directory is raised
        here, as a synchronous save raises it.
        """
        if self.in_flight:
            self.wait()  # its failure is raised here when no step has collected it yet
        start = time.perf_counter()
        # its writes are the writer thread's, bounded by wait(); the coordinator's preparation and commit run
        # here, on the training thread, bounded like a synchronous save's
        save = PhasedSave(save_dir, iteration, layout, coord, all_gather_object, keep_last, self.timeout_s)
        try:
            save.prepare()
            prepared = time.perf_counter()
            parts = rank_parts(coord, model_state, optimizer_state, rank_state)
            live = self._live_parts(parts, handed_over)
            live_names = {name for name, _ in parts[:live]}
            to_write = dict(parts[:live])
            pending: List[PendingCopy] = []
            snapshot_bytes = 0
            for name, value in parts[live:]:
                if name in handed_over:
                    to_write[name] = value
                    continue
                to_write[name] = self._snapshot.copy(value, name, pending if name in deferred else None)
                snapshot_bytes += state_nbytes(value)
            self._snapshot.finish()
            frozen_args = self._snapshot.copy(commit_args)
        except BaseException:
            save.release()  # nothing was handed to a writer: the coordinator lets go of the lock
            raise
        self._save, self._gather = save, all_gather_object
        self._flight = {"iteration": iteration, "commit_args": frozen_args, "snapshot_bytes": snapshot_bytes,
                        "files": [], "prepare_s": prepared - start, "copy_s": time.perf_counter() - prepared,
                        "fence_s": 0.0}
        written = threading.Semaphore(0)

        def file_written(record: FileRecord) -> None:
            self._flight["files"].append(record.name)
            written.release()

        def prepare_part(name: str, value: Any) -> Any:
            if name in live_names:  # written from the live state while the caller waits
                return materialize_lazy(value)
            if not self._copied.is_set():  # the first part written from host buffers: fill them first
                copy_start = time.perf_counter()
                self._snapshot.run(pending)
                self._flight["copy_s"] += time.perf_counter() - copy_start
                self._copied.set()
            return value

        self._done.clear()
        if pending:
            self._copied.clear()
        self._flight["started"] = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True,
                                        args=(save, to_write, file_written, prepare_part))
        self._thread.start()
        for _ in range(live):  # the parts written from the live state: training must not change them yet
            if not self._acquire_or_done(written):
                break
        self._flight["blocking_s"] = time.perf_counter() - (start if started is None else started)
        return save.iter_dir

    def fence(self) -> None:
        """Return once the writer has copied the tensors handed to it live (at once when it has; at most
        ``timeout_s``). Call before changing any of them (the engine's optimizer does, before its update
        and its loads). The wait counts as blocking time (:attr:`SaveReport.blocking_s`). Local."""
        if self._copied.is_set():
            return
        start = time.perf_counter()
        if not self._copied.wait(self.timeout_s):
            raise self._timeout_error("copied the state it was handed")
        self._flight["fence_s"] += time.perf_counter() - start

    def _live_parts(self, parts: List[Tuple[str, Any]], handed_over: Collection[str]) -> int:
        """How many leading parts are written from the live state so that the copy of the rest fits the bound
        (parts handed over cost no copy)."""
        if self.chunk_bytes is None:
            return 0
        sizes = [0 if name in handed_over else state_nbytes(value) for name, value in parts]
        live = 0
        while live < len(parts) and sum(sizes[live:]) > self.chunk_bytes:
            live += 1
        return live

    def _acquire_or_done(self, written: threading.Semaphore) -> bool:
        """Wait for the next part written from the live state: True once written, False when the writer ended."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while not written.acquire(timeout=0.05):
            if self._done.is_set():
                return written.acquire(blocking=False)
            if deadline is not None and time.monotonic() > deadline:
                raise self._timeout_error()
        return True

    def _run(self, save: PhasedSave, to_write: Dict[str, Any], file_written, prepare_part) -> None:
        try:
            self._flight["written"] = save.write(file_written=file_written, prepare_part=prepare_part, **to_write)
        except BaseException as e:  # noqa: BLE001 - write() reports failures itself; this is a last resort
            self._flight["written"] = ({"error": f"{type(e).__name__}: {e}"}, e)
        finally:
            self._flight["write_s"] = time.perf_counter() - self._flight["started"]
            self._copied.set()  # a failed or cut-short copy must not hold training: the save is failed anyway
            self._done.set()

    # ---- committing it -------------------------------------------------------------------------------------
    def poll(self) -> Optional[SaveReport]:
        """Commit the save in flight if every rank has finished writing it, and report it (once).

        Collective over the world while a save is in flight (one
        ``all_gather_object`` of a boolean, plus the commit's exchanges when
        all are done); None without communicating when none is. Raises
        :class:`CheckpointError` (once) when the save failed on any rank.
        """
        if self._save is None:
            return None
        if not all(self._gather(self.writer_done)):
            return None
        return self._commit()

    def wait(self) -> Optional[SaveReport]:
        """Wait (at most ``timeout_s``) for this rank's writer, then commit as :meth:`poll` (collective)."""
        if self._save is None:
            return None
        self._join()
        return self._commit()

    def abandon(self) -> None:
        """Wait (bounded) for this rank's writer and drop the save without committing it (no communication).

        For failing paths: ``latest`` stays on the previous checkpoint, the
        unfinished directory is cleared by the next save.
        """
        if self._save is None:
            return
        try:
            self._join()
        except CheckpointError as e:
            log.error("%s", e)
        finally:
            self._save.release()
            self._save, self._thread = None, None

    def _join(self) -> None:
        if not self._done.wait(self.timeout_s):
            raise self._timeout_error()
        self._thread.join(timeout=1.0)  # it has set _done: only its last instructions remain

    def _commit(self) -> SaveReport:
        save, flight = self._save, self._flight
        self._save, self._thread = None, None
        try:
            save.finish_writes(flight["written"])
            path = save.commit(**flight["commit_args"])
        except CheckpointError as e:
            raise CheckpointError(f"the background save of {save.iter_dir} failed, so {_latest_kept(save.iter_dir)}: "
                                  f"{' '.join(str(e).split())}") from e
        finally:
            save.release()
        return SaveReport(flight["iteration"], path, flight["blocking_s"] + flight["fence_s"], flight["write_s"],
                          checkpoint_bytes(path), flight["snapshot_bytes"], tuple(flight["files"]),
                          flight["prepare_s"], flight["copy_s"], flight["fence_s"])

    def _timeout_error(self, what: str = "finished writing") -> CheckpointError:
        return CheckpointError(
            f"the background save of {self._save.iter_dir} has not {what} after {self.timeout_s:g} s (the "
            f"job's collective timeout, distributed.timeout_minutes): its writer is stuck on the disk; "
            f"{_latest_kept(self._save.iter_dir)}")


def _latest_kept(iter_dir: Path) -> str:
    """What a failed save leaves as the resume point: ``latest`` unchanged, or none yet (a first save)."""
    latest = iter_dir.parent / LATEST_FILE
    if latest.exists():
        return f"{latest} still names the previous checkpoint"
    return f"no checkpoint is saved yet ({latest} does not exist)"
