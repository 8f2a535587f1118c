"""Saving and loading an :class:`~hybrid.engine.Engine`'s complete training state.

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
stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from hybrid.checkpoint import (CheckpointError, CheckpointReader, Layout, capture_rng_state,
                               restore_rng_state, save_checkpoint)

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.engine.engine import Engine


def engine_layout(engine: "Engine") -> Layout:
    topo = engine.topology
    return Layout(tp=topo.tp_size, dp=topo.dp_size, pp=topo.pp_size, zero_stage=engine.config.zero.stage,
                  precision=engine.config.precision)


def _model_config(engine: "Engine") -> Optional[Dict[str, Any]]:
    config = getattr(engine.module, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else None


def save_engine(engine: "Engine", save_dir, iteration: int, *, consumed_samples: int = 0,
                client_state: Optional[Mapping[str, Any]] = None, keep_last: Optional[int] = None):
    """Write ``save_dir/iter_{iteration:07d}`` from every rank; returns the directory.

    ``client_state`` (JSON-able) is stored in ``metadata.json`` and returned by
    :func:`load_engine`. Collective over the whole world.
    """
    optimizer_state = engine.optimizer.state_dict()
    param_index = optimizer_state.pop("param_index")
    tracker = getattr(engine.module, "rng_tracker", None)
    # Keys as "stream/device" strings: checkpoint files hold only weights_only-safe types.
    rank_state = {"rng": capture_rng_state(),
                  "tp_rng": ({f"{stream}/{dev}": t for (stream, dev), t in tracker.get_states().items()}
                             if tracker is not None else None)}
    trainer_state = {"engine": {"global_step": engine.global_step, "micro_steps": engine.micro_steps,
                                "lr_schedule": engine.lr_schedule.state_dict()},
                     "client": dict(client_state or {})}
    return save_checkpoint(save_dir, iteration, engine_layout(engine), engine.topology.coord,
                           model_state=engine.optimizer.model_state_for_save(), optimizer_state=optimizer_state,
                           rank_state=rank_state, consumed_samples=consumed_samples,
                           model_config=_model_config(engine), param_index=param_index,
                           trainer_state=trainer_state, keep_last=keep_last,
                           all_gather_object=engine.topology.comm.all_gather_object)


def load_engine(engine: "Engine", load_dir, *, load_optimizer: bool = True,
                keep_configured_schedule: bool = False) -> Dict[str, Any]:
    """Restore what :func:`save_engine` wrote; returns iteration, consumed samples and client state.

    ``load_optimizer=False`` loads the weights only (fine-tuning: new optimizer,
    schedule and counters). A saved LR schedule whose settings differ from the
    configured one is an error unless ``keep_configured_schedule``, which keeps
    the configured settings at the saved position. Raises :class:`~hybrid.checkpoint.CheckpointError`
    naming what differs when the checkpoint cannot be loaded into this engine.
    """
    reader = CheckpointReader(load_dir)
    saved, current = reader.layout, engine_layout(engine)
    _check_model_config(reader.model_config, _model_config(engine), reader.path)
    topo = engine.topology
    if (saved.tp, saved.dp, saved.pp, saved.zero_stage, saved.precision) != \
            (current.tp, current.dp, current.pp, current.zero_stage, current.precision):
        from hybrid.engine.reshard import load_resharded

        load_resharded(engine, reader, load_optimizer=load_optimizer)
    else:
        engine.optimizer.load_model_state(reader.load_model_shard(topo.tp_rank, topo.pp_rank))
        if load_optimizer:
            sd = reader.load_optimizer_shard(topo.tp_rank, topo.dp_rank, topo.pp_rank)
            sd["param_index"] = reader.param_index
            engine.optimizer.load_state_dict(sd)
    if load_optimizer and saved == current:
        rank_state = reader.load_rank_state(topo.tp_rank, topo.dp_rank, topo.pp_rank)
        restore_rng_state(rank_state["rng"])
        tracker = getattr(engine.module, "rng_tracker", None)
        if tracker is not None and rank_state.get("tp_rng") is not None:
            tracker.set_states({tuple(k.split("/", 1)): t for k, t in rank_state["tp_rng"].items()})
    state = reader.trainer_state
    if load_optimizer:
        eng = state["engine"]
        engine.global_step = int(eng["global_step"])
        # Counted in this layout's accumulation steps: a checkpoint is always taken at a boundary.
        engine.micro_steps = engine.global_step * engine.batch.gradient_accumulation_steps
        try:
            engine.lr_schedule.load_state_dict(eng["lr_schedule"], strict=not keep_configured_schedule)
        except ValueError as e:
            raise CheckpointError(f"{reader.path}: {e}. The trainer's --override-opt-param-scheduler keeps the "
                                  f"new settings") from None
    return {"iteration": reader.iteration, "consumed_samples": reader.consumed_samples,
            "client_state": state.get("client", {}), "path": str(reader.path)}


def _check_model_config(saved: Optional[Mapping[str, Any]], current: Optional[Mapping[str, Any]], path) -> None:
    if not saved or not current:
        return
    # Settings that change only how a model is computed, not what it is.
    runtime = {"sequence_parallel", "recompute", "hidden_dropout", "attention_dropout", "vocab_pad_multiple"}
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, current model {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if k not in runtime and saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"the checkpoint {path} holds a different model than the one being trained: "
                              + "; ".join(diffs) + ". Use the model settings the checkpoint was saved with.")
