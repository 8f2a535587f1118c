"""Saving and loading an :class:`~hybrid.engine.Engine`'s complete training state: :class:`EngineCheckpoints`.

What one checkpoint holds (see ``docs/checkpoints.md`` for the files):

* the model's TP shard per TP rank (safetensors, written by DP rank 0; under
  ZeRO-3 its units are gathered one at a time and DP rank 0 keeps a host copy);
* each rank's ZeRO partition: fp32 master weights, Adam moments, step, loss
  scaler (``weights_only`` files);
* each rank's RNG states, including the model's tensor-parallel RNG tracker;
* in ``metadata.json``: the layout, the model config, the parameter index
  (name, shape, flat offset, TP partitioning), iteration, consumed samples,
  the LR schedule and the engine's counters.

Loading into the layout that saved is exact: every tensor and generator is
restored bit for bit, so the continued run is identical to one that never
stopped. Another layout is loaded by :func:`hybrid.engine.reshard.load_resharded`.

Context parallelism leaves no trace in a checkpoint: the ``cp`` ranks of a
replica hold the same parameters and ZeRO partitions over all ``dp x cp`` of
them (:meth:`~hybrid.topology.Topology.data_view`), so the files are written
and read as those of a run at ``dp x cp`` data-parallel ranks, each rank at its
data index ``cp_rank + cp * dp_rank`` (the rank order's, so the global ranks
stay in file order). A CP2 x DP1 checkpoint is a DP2 one; ``docs/checkpoints.md``
says why.

:class:`EngineCheckpoints` is given the rank's :class:`~hybrid.engine.parts.TrainingParts`
and the engine's state as one dict (:class:`TrainingState`), not the engine
itself, and owns the background saver of ``checkpoint.async_save``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Protocol

import torch

from hybrid.checkpoint import BackgroundSaver, CheckpointError, CheckpointReader, SaveReport, save_checkpoint
from hybrid.engine.parts import TrainingParts
from hybrid.grid import Coord
from hybrid.optim.lr_schedule import ScheduleSettingsDiffer
from model_zoo.config import load_conflicts, load_notes

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.config.trainer_sections import CheckpointConfig
    from hybrid.layout import ParallelLayout


class TrainingState(Protocol):
    """The engine's complete state as one dict (:meth:`hybrid.engine.Engine.state_dict` and
    :meth:`~hybrid.engine.Engine.load_state_dict`): what a checkpoint holds, split over its files."""

    def state_dict(self, lazy: bool = False) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any], *, schedule: str = "check") -> None: ...


def _model_config(parts: TrainingParts) -> Optional[Dict[str, Any]]:
    config = parts.model_config
    return config.to_dict() if hasattr(config, "to_dict") else None


def _model_defaults(parts: TrainingParts) -> Dict[str, Any]:
    """The defaults of the model config's fields: what a checkpoint saved before a field existed meant
    (a new setting defaults to the behaviour models had before it)."""
    config = parts.model_config
    if not dataclasses.is_dataclass(config):
        return {}
    return {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}


MODEL_16BIT_FILE = "model_16bit.safetensors"  # checkpoint.save_16bit_model's file in each iter_N


class EngineCheckpoints:
    """One engine's checkpoints: :meth:`save`, :meth:`load`, and the background saver of ``checkpoint.async_save``.

    ``parts``: what the files are written from and read into; ``state``: the engine's state as one dict;
    ``settings``: the config's ``checkpoint`` section (``async_save``, ``async_save_chunk_mb``), read at each
    save; ``layout``: the engine's parallel layout (:meth:`hybrid.topology.Topology.layout`: its ``dp`` is the
    data view's, see the module docstring); ``timeout_s``: the bound of every wait of a save, a collective's, so
    that a hung disk ends in an error, never a hang.
    """

    def __init__(self, parts: TrainingParts, state: TrainingState, settings: "CheckpointConfig",
                 layout: "ParallelLayout", timeout_s: float):
        # Files are written and read as the optimizer partitions: over the data view's dp (dp x cp ranks)
        view = parts.topology.data_view()
        self.parts = dataclasses.replace(parts, topology=view)
        self.coord = Coord(tp=view.tp_rank, dp=view.dp_rank, pp=view.pp_rank)
        self.state = state
        self.settings = settings
        self.layout = layout
        self.timeout_s = timeout_s
        self.saver: Optional[BackgroundSaver] = None  # made at the first save with checkpoint.async_save

    def background_saver(self) -> Optional[BackgroundSaver]:
        """The saver of ``checkpoint.async_save`` (made at its first use), None while it is off."""
        if not self.settings.async_save:
            return None
        if self.saver is None:
            chunk = self.settings.async_save_chunk_mb
            self.saver = BackgroundSaver(self.timeout_s, chunk << 20 if chunk is not None else None)
            self.parts.optimizer.write_fence = self.saver.fence  # the update waits for the writer's copy of its state
        return self.saver

    def save(self, save_dir, iteration: int, *, consumed_samples: Optional[int] = None,
             client_state: Optional[Mapping[str, Any]] = None, keep_last: Optional[int] = None,
             healthy: bool = True):
        """Write ``save_dir/iter_{iteration:07d}`` from every rank; returns the directory.

        The engine's :meth:`~hybrid.engine.Engine.state_dict` is split over the
        files: the model part into the model file, the optimizer part into this
        rank's partition file (its parameter index into ``metadata.json``), the
        random state into this rank's file, the progress counters and schedule
        into ``metadata.json`` beside ``client_state`` (JSON-able, returned by
        :meth:`load`). ``consumed_samples`` defaults to the engine's count. Collective over the whole
        world. ``healthy=False`` marks a state saved while the run was not healthy (diverging): pruning by
        ``keep_last`` always keeps the newest healthy checkpoint besides.

        With ``checkpoint.async_save`` the call returns once the small parts of the state are copied; the
        weights and the optimizer partition are copied by the saver's thread
        before the optimizer next changes them (its write fence), then written.
        The directory is complete when the saver reports it
        (:meth:`~hybrid.checkpoint.BackgroundSaver.poll`).
        """
        background = self.background_saver()
        parts, topo = self.parts, self.parts.topology
        started = time.perf_counter()  # a background save's blocking time counts collecting the state
        state = self.state.state_dict(lazy=background is not None)
        optimizer_state = state["optimizer"]
        param_index = optimizer_state.pop("param_index")
        if topo.pp_size > 1:
            # every stage indexes its own parameters: metadata.json keeps one index per stage, in stage order
            param_index = topo.comm.all_gather_object(param_index, "pp")
        if consumed_samples is None:
            consumed_samples = state["progress"]["consumed_samples"]
        # metadata.json's count and the engine's agree: a resumed engine takes its batch sizes from it
        trainer_state = {"engine": dict(state["progress"], consumed_samples=consumed_samples),
                         "client": dict(client_state or {})}
        args = dict(model_state=state["model"], optimizer_state=optimizer_state, rank_state=state["rng"],
                    consumed_samples=consumed_samples, model_config=_model_config(parts), param_index=param_index,
                    trainer_state=trainer_state, keep_last=keep_last, healthy=healthy)
        if background is None:
            path = save_checkpoint(save_dir, iteration, self.layout, self.coord,
                                   all_gather_object=topo.comm.all_gather_object,
                                   collective_timeout_s=self.timeout_s, **args)
            if getattr(self.settings, "save_16bit_model", False):
                self._write_16bit_model(path)
            return path
        # The weights and the optimizer partition change only in the optimizer's update and in loads, behind its
        # write fence: the writer copies them. Module buffers may change in forward: copied now.
        if parts.optimizer.model_state_is_copy:
            deferred, handed_over = ("optimizer_state",), ("model_state",)
        else:
            deferred, handed_over = ("model_state", "optimizer_state"), ()
            if args["model_state"] is not None:
                buffers = {name for name, _ in parts.module.named_buffers(remove_duplicate=False)}
                args["model_state"] = {k: v.clone() if k in buffers else v for k, v in args["model_state"].items()}
        return background.submit(save_dir, iteration, self.layout, self.coord,
                                 all_gather_object=topo.comm.all_gather_object, deferred=deferred,
                                 handed_over=handed_over, started=started, **args)

    def _write_16bit_model(self, path) -> None:
        """``checkpoint.save_16bit_model``: rank 0 writes ``path/model_16bit.safetensors``, the whole model in the
        training precision read back from the checkpoint just written (its fp32 masters rounded, as the weights
        are); every rank waits for it (a world barrier), so that the save returns with the file in place."""
        from hybrid.convert.fp32 import export_fp32
        from hybrid.layout import PRECISION_DTYPES

        topo = self.parts.topology
        if topo.rank == 0:
            dtype = getattr(torch, PRECISION_DTYPES[self.layout.precision])
            export_fp32(path, Path(path) / MODEL_16BIT_FILE, dtype=dtype)
        topo.comm.barrier()

    def load(self, load_dir, *, load_optimizer: bool = True, schedule: str = "check",
             load_progress: Optional[bool] = None, load_rng: Optional[bool] = None) -> Dict[str, Any]:
        """Restore what :meth:`save` wrote; returns iteration, consumed samples, client state and path.

        ``load_optimizer=False`` loads the weights only (fine-tuning: new optimizer,
        schedule and counters). ``load_progress`` (the counters, consumed samples and the
        schedules' position) and ``load_rng`` (each rank's generators, restored where the
        layout is the saved one) default to ``load_optimizer``: Megatron-LM's
        ``--no-load-optim`` is ``load_optimizer=False, load_progress=True``, its
        ``--no-load-rng`` ``load_rng=False``. A saved schedule whose settings differ from the
        configured one is an error unless ``schedule`` is ``"configured"`` (keep the
        configured settings at the saved position) or ``"saved"`` (take the saved ones).
        Raises :class:`~hybrid.checkpoint.CheckpointError` naming what differs when
        the checkpoint cannot be loaded into this engine.
        """
        load_progress = load_optimizer if load_progress is None else load_progress
        load_rng = load_optimizer if load_rng is None else load_rng
        parts, topo = self.parts, self.parts.topology
        reader = CheckpointReader(load_dir)
        saved = reader.model_config
        if saved:
            saved = {**_model_defaults(parts), **saved}
        _check_model_config(saved, _model_config(parts), reader.path, announce=topo.rank == 0)
        parts.optimizer.fence_writes()  # resharding writes module tensors directly: a background copy must be done
        if reader.layout.to_json() != self.layout.to_json() or \
                (load_optimizer and not _same_flat_partitions(parts, reader)):
            from hybrid.engine import reshard  # load_resharded looked up at the call (tests count the calls)

            reshard.load_resharded(parts, reader, load_optimizer=load_optimizer, load_rng=load_rng)
        else:
            state: Dict[str, Any] = {"model": reader.load_model_shard(topo.tp_rank, topo.pp_rank)}
            if load_optimizer:
                state["optimizer"] = reader.load_optimizer_shard(topo.tp_rank, topo.dp_rank, topo.pp_rank)
                state["optimizer"]["param_index"] = reader.stage_param_index(topo.pp_rank)
            if load_rng:
                state["rng"] = reader.load_rank_state(topo.tp_rank, topo.dp_rank, topo.pp_rank)
            self.state.load_state_dict(state)
        trainer_state = reader.trainer_state
        if load_progress:
            try:
                # checkpoints of earlier releases keep the count in metadata.json alone
                progress = {"consumed_samples": reader.consumed_samples, **trainer_state["engine"]}
                self.state.load_state_dict({"progress": progress}, schedule=schedule)
            except ValueError as e:
                hint = (". The trainer's --override-opt-param-scheduler keeps the new settings, "
                        "--use-checkpoint-opt-param-scheduler takes the saved ones"
                        if isinstance(e, ScheduleSettingsDiffer) else "")
                raise CheckpointError(f"{reader.path}: {e}{hint}") from None
        return {"iteration": reader.iteration, "consumed_samples": reader.consumed_samples,
                "client_state": trainer_state.get("client", {}), "path": str(reader.path)}

    # ---- the background save in flight -----------------------------------------------------------------
    def poll(self) -> Optional[SaveReport]:
        """See :meth:`hybrid.engine.Engine.poll_checkpoint` (collective over the world while a save is in flight)."""
        return self.saver.poll() if self.saver is not None else None

    def wait(self) -> Optional[SaveReport]:
        """See :meth:`hybrid.engine.Engine.wait_checkpoint` (collective)."""
        return self.saver.wait() if self.saver is not None else None

    def abandon(self) -> None:
        """Drop a background save in flight without committing it (no communication)."""
        if self.saver is not None:
            self.saver.abandon()

    def close(self) -> None:
        """Commit a background save in flight (collective then); a failure is logged, not raised (close runs in
        ``finally`` blocks)."""
        if self.saver is not None:
            try:
                self.saver.wait()
            except Exception as e:  # noqa: BLE001 - logged: close must not replace an earlier error
                logging.getLogger(__name__).error("%s", e)


def _same_flat_partitions(parts: TrainingParts, reader: CheckpointReader) -> bool:
    """Whether the saved optimizer partitions, in this engine's own layout, hold each parameter where this
    engine's optimizer does, on every rank (one all-reduce over ``"world"``, so that all ranks take the same
    path). They differ when the flat segments do: another ``zero.bucket_size``, or a checkpoint of an interleaved
    pipeline saved before segments ended at its chunk boundaries. Such a state is loaded by resharding."""
    topo = parts.topology
    saved = reader.stage_param_index(topo.pp_rank)
    differs = saved is not None and parts.optimizer.index_mismatch(saved) is not None
    flag = torch.tensor([1.0 if differs else 0.0], dtype=torch.float32, device=topo.device)
    topo.comm.all_reduce(flag, "world", op="max")
    return flag.item() == 0.0


def _check_model_config(saved: Optional[Mapping[str, Any]], current: Optional[Mapping[str, Any]], path,
                        announce: bool = True) -> None:
    if not saved or not current:
        return
    diffs = load_conflicts(saved, current)  # model_zoo's kinds: runtime and training settings may differ
    if diffs:
        raise CheckpointError(f"the checkpoint {path} holds a different model than the one being trained: "
                              + "; ".join(diffs) + ". Use the model settings the checkpoint was saved with.")
    if announce:  # a long-context phase changes the RoPE settings on purpose: say so once, naming both values
        for note in load_notes(saved, current):
            print(f"hybrid: note: {path} continues with other RoPE settings: {note}", file=sys.stderr, flush=True)
