"""Saving a checkpoint from every rank of a job.

Each rank calls :func:`save_checkpoint` with its own state; the call returns on
every rank once ``latest`` names the new checkpoint, or raises the same
:class:`~hybrid.checkpoint.errors.CheckpointError` on every rank when any rank
failed (so no rank is left waiting on a peer that gave up). The one
communication primitive needed is ``all_gather_object`` over the whole world
(``topology.comm.all_gather_object``); it carries each rank's file digests to
the coordinator and doubles as the barrier between the phases.
:class:`PhasedSave` offers the phases one by one, for the background writer
(:mod:`hybrid.checkpoint.background`), which writes on another thread but
exchanges on the training thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Tuple

from hybrid.bounded_call import StillRunning, call_within
from hybrid.checkpoint.errors import CheckpointError
from hybrid.checkpoint.lock import SaveDirLock
from hybrid.checkpoint.manifest import FileRecord
from hybrid.checkpoint.safetensors_stream import TensorLike
from hybrid.checkpoint.writer import CheckpointWriter, check_keep_last, check_layout
from hybrid.layout import ParallelLayout

GatherFn = Callable[[Any], List[Any]]
# The share of the collective timeout a rank's writes may take: its peers, waiting for it in the exchange of
# digests since they finished their own writes, must still be waiting when its failure arrives.
WRITE_SHARE = 0.8


def gather_single_process(obj: Any) -> List[Any]:
    """``all_gather_object`` for a one-process job."""
    return [obj]


def save_checkpoint(save_dir, iteration: int, layout: ParallelLayout, coord, *,
                    model_state: Optional[Mapping[str, TensorLike]] = None,
                    optimizer_state: Any = None, rank_state: Any = None,
                    consumed_samples: int = 0, model_config: Optional[Mapping[str, Any]] = None,
                    param_index: Any = None, trainer_state: Optional[Mapping[str, Any]] = None,
                    keep_last: Optional[int] = None, healthy: bool = True,
                    all_gather_object: GatherFn = gather_single_process,
                    collective_timeout_s: Optional[float] = None) -> Path:
    """Save one iteration; call on every rank with that rank's state.

    Args:
        save_dir: the ``--save`` directory (shared by every node).
        layout: the job's layout (``topology.layout(zero_stage, precision)``).
        coord: this rank's position, anything with ``tp``, ``dp`` and ``pp``
            attributes (``topology.coord``).
        model_state: this rank's TP shard of the weights, name -> tensor (any
            device). Written only by DP rank 0 of each TP group; other ranks may
            pass it or not.
        optimizer_state: this rank's optimizer partition (weights_only types).
        rank_state: per-rank state such as :func:`hybrid.checkpoint.rng.capture_rng_state`.
        consumed_samples, model_config, param_index, trainer_state: recorded in
            ``metadata.json`` from the coordinator's (TP 0, DP 0, PP 0) values.
        keep_last: keep only this many newest checkpoints (after the new one is
            complete and ``latest`` points at it), and always the newest healthy one.
        healthy: whether the state comes from a healthy run (finite, not
            diverging); recorded in ``metadata.json`` for pruning.
        all_gather_object: gathers one picklable object from every rank of the
            world, in rank order (``topology.comm.all_gather_object``).
        collective_timeout_s: how long ``all_gather_object`` waits for a peer.
            Each phase's file work (the coordinator's preparation and commit,
            every rank's writes) then gets :data:`WRITE_SHARE` of it: work stuck
            on a hung file system is reported in the phase's exchange as this
            rank's failure (every rank raises it, naming this rank) while the
            peers still wait there. None: the file work is not bounded.

    The coordinator holds the save directory's lock (:mod:`hybrid.checkpoint.lock`)
    during the save, unless this process already holds it for the whole run
    (the trainer does): a save directory in use by another job is refused on
    every rank before anything in it is touched.

    Returns the new iteration directory.
    """
    save = PhasedSave(save_dir, iteration, layout, coord, all_gather_object, keep_last, collective_timeout_s)
    try:
        save.prepare()
        save.finish_writes(save.write_within(model_state, optimizer_state, rank_state))
        return save.commit(consumed_samples=consumed_samples, model_config=model_config, param_index=param_index,
                           trainer_state=trainer_state, healthy=healthy)
    finally:
        save.release()


class PhasedSave:
    """The three phases of one rank's save, as separate calls (:func:`save_checkpoint` runs them in a row).

    :meth:`prepare` and :meth:`commit` communicate (``all_gather_object``,
    collective over the world) and must run on the thread that issues the
    job's other collectives; :meth:`write` only writes this rank's files and
    may run on any thread (the background writer's). :meth:`finish_writes`
    hands the outcome of :meth:`write` to the exchange of digests. Call
    :meth:`release` last, whatever happened (it lets go of the save
    directory's lock the coordinator took in :meth:`prepare`).
    ``collective_timeout_s``: see :func:`save_checkpoint` (None: file work unbounded).
    """

    def __init__(self, save_dir, iteration: int, layout: ParallelLayout, coord,
                 all_gather_object: GatherFn = gather_single_process, keep_last: Optional[int] = None,
                 collective_timeout_s: Optional[float] = None):
        check_layout(layout)
        _check_coord(layout, coord)
        check_keep_last(keep_last)
        self.writer = CheckpointWriter(save_dir, iteration, layout)
        self.layout, self.coord, self.keep_last = layout, coord, keep_last
        self._gather = all_gather_object
        self._me = f"rank (tp={coord.tp}, dp={coord.dp}, pp={coord.pp})"
        self.coordinator = (coord.tp, coord.dp, coord.pp) == (0, 0, 0)
        self._lock = SaveDirLock(save_dir)  # taken by the coordinator in phase 1
        self._outcomes: List[dict] = []
        self.file_work_s = None if collective_timeout_s is None else WRITE_SHARE * collective_timeout_s

    def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, on a daemon thread joined for at most :attr:`file_work_s` (None: on this thread); a
        CheckpointError when it is still running then (a hung file system). The thread is left blocked:
        nothing can interrupt a stuck write, but the error no longer waits for it."""
        if self.file_work_s is None:
            return fn()
        try:
            return call_within(self.file_work_s, fn, name="hybrid-checkpoint-files")
        except StillRunning:
            raise CheckpointError(f"{what} in {self.iter_dir} did not finish within {self.file_work_s:g} s (a share "
                                  f"of distributed.timeout_minutes): the file system is stuck or far too slow") from None

    @property
    def iter_dir(self) -> Path:
        return self.writer.iter_dir

    def _failed(self, e: BaseException) -> dict:
        return {"error": f"{self._me}: {type(e).__name__}: {e}"}

    def _gather_and_check(self, outcome: dict, phase: str, own_error: Optional[BaseException]) -> list:
        outcomes = self._gather(outcome)
        if len(outcomes) != self.layout.world_size:
            raise CheckpointError(
                f"all_gather_object returned {len(outcomes)} entries but the layout has "
                f"{self.layout.world_size} ranks; pass "
                f"all_gather_object=topology.comm.all_gather_object (a gather over the whole world)")
        failures = [o["error"] for o in outcomes if o.get("error")]
        if failures:
            raise CheckpointError(f"saving {self.iter_dir} failed while {phase}: "
                                  + "; ".join(failures)) from own_error
        return outcomes

    def prepare(self) -> None:
        """Phase 1 (collective): the coordinator takes the lock, clears leftovers and creates the directory."""
        outcome, error = {}, None
        if self.coordinator:
            try:
                self._bounded("preparing the directory", lambda: (self._lock.acquire(), self.writer.prepare()))
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                outcome, error = self._failed(e), e
        self._gather_and_check(outcome, "preparing the directory", error)

    def write(self, model_state=None, optimizer_state=None, rank_state=None,
              file_written: Optional[Callable[[FileRecord], None]] = None,
              prepare_part: Optional[Callable[[str, Any], Any]] = None) -> Tuple[dict, Optional[BaseException]]:
        """Phase 2 (local): write this rank's files; returns the outcome for :meth:`finish_writes` and the error.

        ``file_written`` is called with each file's record once it is durable;
        ``prepare_part(name, value)``, when given, returns what to write for each
        part just before it is written (the background writer's host copy).
        Never raises for a failed write: every rank must learn of it in the exchange.
        """
        try:
            records: List[FileRecord] = []
            for name, value in rank_parts(self.coord, model_state, optimizer_state, rank_state):
                if prepare_part is not None:
                    value = prepare_part(name, value)
                records.append(self._write_part(name, value))
                if file_written is not None:
                    file_written(records[-1])
            return {"records": [r.to_json() for r in records]}, None
        except Exception as e:  # noqa: BLE001
            return self._failed(e), e

    def write_within(self, *args) -> Tuple[dict, Optional[BaseException]]:
        """:meth:`write` bounded by :attr:`file_work_s`: writes still blocked then are this rank's failure."""
        try:
            return self._bounded("writing this rank's files", lambda: self.write(*args))
        except CheckpointError as e:
            return self._failed(e), e

    def _write_part(self, name: str, value: Any) -> FileRecord:
        c, w = self.coord, self.writer
        if name == "model_state":
            return w.write_model_shard(value, c.tp, c.pp)
        if name == "optimizer_state":
            return w.write_optimizer_shard(value, c.tp, c.dp, c.pp)
        return w.write_rank_state(value, c.tp, c.dp, c.pp)

    def finish_writes(self, written: Tuple[dict, Optional[BaseException]]) -> None:
        """Phase 2's exchange (collective): every rank's digests to every rank, or every rank's failure."""
        self._outcomes = self._gather_and_check(written[0], "writing shards", written[1])

    def commit(self, *, consumed_samples: int = 0, model_config: Optional[Mapping[str, Any]] = None,
               param_index: Any = None, trainer_state: Optional[Mapping[str, Any]] = None,
               healthy: bool = True) -> Path:
        """Phase 3 (collective): the coordinator seals the checkpoint and moves ``latest``; everyone learns the
        result. Returns the iteration directory."""
        outcome, error = {}, None
        if self.coordinator:
            try:
                all_records = [FileRecord.from_json(r) for o in self._outcomes for r in o["records"]]
                self._bounded("writing metadata.json and latest", lambda: self.writer.commit(
                    all_records, consumed_samples=consumed_samples, model_config=model_config,
                    param_index=param_index, trainer_state=trainer_state, keep_last=self.keep_last,
                    healthy=healthy))
            except Exception as e:  # noqa: BLE001
                outcome, error = self._failed(e), e
        self._gather_and_check(outcome, "writing metadata.json and latest", error)
        return self.iter_dir

    def release(self) -> None:
        self._lock.release()  # a no-op where not taken; a count down when the run holds the lock


def rank_parts(coord, model_state, optimizer_state, rank_state) -> List[Tuple[str, Any]]:
    """The parts of its state this rank writes, one file each, in the order it writes them, as
    ``(argument name, value)``: its model shard (DP rank 0 only), its optimizer partition, its per-rank state
    (each when given)."""
    parts = [("model_state", model_state if coord.dp == 0 else None), ("optimizer_state", optimizer_state),
             ("rank_state", rank_state)]
    return [(name, value) for name, value in parts if value is not None]


def _check_coord(layout: ParallelLayout, coord) -> None:
    for axis, size in (("tp", layout.tp), ("dp", layout.dp), ("pp", layout.pp)):
        value = getattr(coord, axis, None)
        if not isinstance(value, int) or not 0 <= value < size:
            raise CheckpointError(f"coord.{axis} = {value!r} is outside [0, {size}) for layout "
                                  f"{layout.describe()}; pass topology.coord of a topology matching the layout")
