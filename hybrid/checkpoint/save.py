"""Saving a checkpoint from every rank of a job.

Each rank calls :func:`save_checkpoint` with its own state; the call returns on
every rank once ``latest`` names the new checkpoint, or raises the same
:class:`~hybrid.checkpoint.errors.CheckpointError` on every rank when any rank
failed (so no rank is left waiting on a peer that gave up). The one
communication primitive needed is ``all_gather_object`` over the whole world
(``topology.comm.all_gather_object``); it carries each rank's file digests to
the coordinator and doubles as the barrier between the phases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional

from hybrid.checkpoint.errors import CheckpointError
from hybrid.checkpoint.lock import SaveDirLock
from hybrid.checkpoint.manifest import FileRecord
from hybrid.checkpoint.safetensors_stream import TensorLike
from hybrid.checkpoint.writer import CheckpointWriter, check_keep_last, check_layout
from hybrid.layout import ParallelLayout

GatherFn = Callable[[Any], List[Any]]


def gather_single_process(obj: Any) -> List[Any]:
    """``all_gather_object`` for a one-process job."""
    return [obj]


def save_checkpoint(save_dir, iteration: int, layout: ParallelLayout, coord, *,
                    model_state: Optional[Mapping[str, TensorLike]] = None,
                    optimizer_state: Any = None, rank_state: Any = None,
                    consumed_samples: int = 0, model_config: Optional[Mapping[str, Any]] = None,
                    param_index: Any = None, trainer_state: Optional[Mapping[str, Any]] = None,
                    keep_last: Optional[int] = None, healthy: bool = True,
                    all_gather_object: GatherFn = gather_single_process) -> Path:
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

    The coordinator holds the save directory's lock (:mod:`hybrid.checkpoint.lock`)
    during the save, unless this process already holds it for the whole run
    (the trainer does): a save directory in use by another job is refused on
    every rank before anything in it is touched.

    Returns the new iteration directory.
    """
    check_layout(layout)
    _check_coord(layout, coord)
    check_keep_last(keep_last)
    writer = CheckpointWriter(save_dir, iteration, layout)
    me = f"rank (tp={coord.tp}, dp={coord.dp}, pp={coord.pp})"
    coordinator = (coord.tp, coord.dp, coord.pp) == (0, 0, 0)

    def gather_and_check(outcome: dict, phase: str, own_error: Optional[BaseException]) -> list:
        outcomes = all_gather_object(outcome)
        if len(outcomes) != layout.world_size:
            raise CheckpointError(
                f"all_gather_object returned {len(outcomes)} entries but the layout has "
                f"{layout.world_size} ranks; pass "
                f"all_gather_object=topology.comm.all_gather_object (a gather over the whole world)")
        failures = [o["error"] for o in outcomes if o.get("error")]
        if failures:
            raise CheckpointError(f"saving {writer.iter_dir} failed while {phase}: "
                                  + "; ".join(failures)) from own_error
        return outcomes

    lock = SaveDirLock(save_dir)  # taken by the coordinator in phase 1
    try:
        # Phase 1: the coordinator takes the lock, clears leftovers and creates the directory.
        outcome, error = {}, None
        if coordinator:
            try:
                lock.acquire()
                writer.prepare()
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                outcome, error = {"error": f"{me}: {type(e).__name__}: {e}"}, e
        gather_and_check(outcome, "preparing the directory", error)

        # Phase 2: every rank writes its own files and reports their digests.
        outcome, error = {}, None
        try:
            records: List[FileRecord] = []
            if coord.dp == 0 and model_state is not None:
                records.append(writer.write_model_shard(model_state, coord.tp, coord.pp))
            if optimizer_state is not None:
                records.append(writer.write_optimizer_shard(optimizer_state, coord.tp, coord.dp, coord.pp))
            if rank_state is not None:
                records.append(writer.write_rank_state(rank_state, coord.tp, coord.dp, coord.pp))
            outcome = {"records": [r.to_json() for r in records]}
        except Exception as e:  # noqa: BLE001
            outcome, error = {"error": f"{me}: {type(e).__name__}: {e}"}, e
        outcomes = gather_and_check(outcome, "writing shards", error)

        # Phase 3: the coordinator seals the checkpoint; everyone learns the result.
        outcome, error = {}, None
        if coordinator:
            try:
                all_records = [FileRecord.from_json(r) for o in outcomes for r in o["records"]]
                writer.commit(all_records, consumed_samples=consumed_samples, model_config=model_config,
                              param_index=param_index, trainer_state=trainer_state, keep_last=keep_last,
                              healthy=healthy)
            except Exception as e:  # noqa: BLE001
                outcome, error = {"error": f"{me}: {type(e).__name__}: {e}"}, e
        gather_and_check(outcome, "writing metadata.json and latest", error)
    finally:
        lock.release()  # a no-op where not taken; a count down when the run holds the lock
    return writer.iter_dir


def _check_coord(layout: ParallelLayout, coord) -> None:
    for axis, size in (("tp", layout.tp), ("dp", layout.dp), ("pp", layout.pp)):
        value = getattr(coord, axis, None)
        if not isinstance(value, int) or not 0 <= value < size:
            raise CheckpointError(f"coord.{axis} = {value!r} is outside [0, {size}) for layout "
                                  f"{layout.describe()}; pass topology.coord of a topology matching the layout")
