"""Loading a checkpoint saved in any layout into a running engine.

:meth:`hybrid.engine.checkpoint.EngineCheckpoints.load` calls :func:`load_resharded`
(with the rank's :class:`~hybrid.engine.parts.TrainingParts`) when the saved
layout (TP size, DP size, ZeRO stage, precision) differs from the engine's.
Every rank then, one parameter at a time:

1. reads its own TP piece of each weight straight from the saved TP pieces
   (merge and re-split along the recorded partition dim, strided fused
   layouts and vocabulary re-padding included; see :mod:`hybrid.convert.ranges`);
2. rebuilds its flat ZeRO partition of the fp32 master weights and of every
   optimizer moment: each parameter's saved state is gathered from the saved
   flat partitions through the recorded offsets (stage 0 saved the whole
   state on every DP rank: DP rank 0's copy is read), cut to this rank's TP
   piece, and written at the offsets of *this* layout's partition;
3. hands that partition to ``ZeroOptimizer.load_state_dict``, which writes
   the masters into the parameters and all-gathers them over ``"dp"``.

Under ZeRO-3 the trainable parameters have no whole tensors to copy into:
step 1 writes this rank's slice of each weight into its partition
(``Stage3Optimizer.write_parameter``) and step 2 fills the stage-3 partition
through the same parameter index (one flat group whose segments are the
units). A stage-3 checkpoint is read like any other, so any layout loads
from it and into it.

Counters, the loss scaler and (in ``EngineCheckpoints.load``) the LR schedule carry
over unchanged. A bf16/fp16 run's checkpoint loaded into an fp32 run
continues from the fp32 master weights, not from their rounded copies.

Random state: a new layout has no exact counterpart of every saved rank, so
each rank restores the generators of the saved rank
:func:`hybrid.checkpoint.rng.restored_rank` names, without the per-TP-rank
dropout stream when the TP size changed
(:func:`~hybrid.checkpoint.rng.tracker_streams_for`). Only a same-layout
resume is bit-exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from hybrid.checkpoint import CheckpointReader
from hybrid.checkpoint.rng import restored_rank
from hybrid.convert.consolidate import MASTER, WEIGHT, CheckpointSource, ConversionError, Target
from hybrid.engine.parts import TrainingParts
from hybrid.param_meta import REPLICATED, full_shape, get_tp_meta
from model_zoo.config import SHAPE_FIELDS, as_weights_see_it  # the settings that decide shapes

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.zero import ZeroOptimizer


def load_resharded(parts: TrainingParts, reader: CheckpointReader, *, load_optimizer: bool = True,
                   load_rng: Optional[bool] = None) -> None:
    """Load ``reader``'s checkpoint into ``parts`` (an engine's model, optimizer and generators, placed by its
    topology) whatever layout saved it.

    ``load_optimizer=False``: weights only (fine-tuning); the optimizer stays
    fresh, with its master weights set from the checkpoint. ``load_rng`` (default:
    ``load_optimizer``) restores each rank's generators (``--no-load-rng`` turns it off). Collective over
    ``"dp"`` (the optimizer all-gathers the loaded parameters): every rank
    must call it. Raises :class:`~hybrid.convert.consolidate.ConversionError`
    naming both values when the checkpoint holds a different model.
    """
    topo = parts.topology
    opt = parts.optimizer
    entries = dict(parts.module.state_dict(keep_vars=True))
    metas = {name: get_tp_meta(t) for name, t in entries.items()}
    # ZeRO-3 trainable parameters: written into this rank's partition, not into the (empty) module tensors
    owners = {name: opt.parameter_name(t) for name, t in entries.items()}
    shapes = {name: opt.parameter_shape(owners[name]) if owners.get(name) else tuple(t.shape)
              for name, t in entries.items()}
    # Entries the parameter index does not describe (frozen parameters, buffers) split like the current ones.
    with CheckpointSource(reader, meta_fallback=lambda name: metas.get(name, REPLICATED)) as src:
        # an expert-parallel run holds its own experts: the other ep ranks' are in the checkpoint, not here
        _check_names(src, entries, reader, parts.model_config, whole=topo.pp_size == 1,
                     elsewhere=getattr(opt, "other_expert_keys", frozenset()))
        if load_optimizer and not src.has_optimizer_state:
            raise ConversionError(f"{reader.path} holds no optimizer state (it was saved for inference or "
                                  f"imported); load it for its weights only (--finetune)")
        masters = src.has_optimizer_state and (load_optimizer or src.weights_from_master)
        from_optimizer = {r.name for r in opt.param_index if masters and src.has_state(r.name)}
        with torch.no_grad():
            for name, tensor in entries.items():
                target = Target(metas[name], topo.tp_size, topo.tp_rank)
                _check_shape(name, src, shapes[name], target, parts.model_config, reader)
                owner = owners.get(name)
                if name in from_optimizer or (owner is not None and owner != name):
                    continue  # arrives with the master weights below, or under the tied parameter's first name
                value = src.read(name, WEIGHT, target=target)
                if owner is not None:
                    opt.write_parameter(name, value)
                else:
                    tensor.copy_(value)
        if masters:
            keys = src.state_keys() if load_optimizer else [MASTER]
            opt.load_state_dict(_partition_state(opt, src, topo, keys, restore_counters=load_optimizer))
        else:
            opt.weights_loaded()
    if load_optimizer if load_rng is None else load_rng:
        _restore_rng(parts, reader)


# ---- checks ---------------------------------------------------------------------------------------
def _check_names(src: CheckpointSource, entries: Dict[str, torch.Tensor], reader: CheckpointReader,
                 model_config, whole: bool, elsewhere=frozenset()) -> None:
    """The checkpoint must hold exactly the model's entries and ``elsewhere`` (the experts the other ep ranks
    hold); ``whole=False`` (one pipeline stage of the model): at least this stage's."""
    saved, current = set(src.tensors), set(entries) | set(elsewhere)
    missing, extra = sorted(current - saved), sorted(saved - current) if whole else []
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        parts.append(f"not in the current model: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    raise ConversionError(f"{reader.path} holds a different model: " + "; ".join(parts)
                          + _config_hint(reader.model_config, model_config))


def _check_shape(name: str, src: CheckpointSource, shape: Tuple[int, ...], target: Target, model_config,
                 reader: CheckpointReader) -> None:
    saved = src.tensors[name]
    current_full = tuple(full_shape(shape, target.meta, target.tp))
    if saved.full_shape != current_full:
        raise ConversionError(f"{name}: the checkpoint {reader.path} holds full shape {list(saved.full_shape)}, "
                              f"the current model {list(current_full)}"
                              + _config_hint(reader.model_config, model_config))
    try:
        expected = saved.target_shape(target)
    except ValueError as e:
        raise ConversionError(f"{name}: cannot split the checkpoint's tensor for tp={target.tp}: {e}") from None
    if expected != tuple(shape):
        raise ConversionError(f"{name}: its TP piece at tp={target.tp} has shape {list(shape)} in the "
                              f"current model but {list(expected)} from the checkpoint's metadata {saved.meta}; the "
                              f"vocabulary padding (vocab_pad_multiple) or TP metadata differ")


def _config_hint(saved: Optional[dict], current) -> str:
    if not saved or current is None or not hasattr(current, "to_dict"):
        return ""
    then, now = as_weights_see_it(saved), as_weights_see_it(current.to_dict())
    diffs = [f"{k} {then.get(k)!r} in the checkpoint vs {now.get(k)!r} now" for k in SHAPE_FIELDS
             if k in saved and then.get(k) != now.get(k)]
    return f" ({'; '.join(diffs)})" if diffs else ""


# ---- optimizer partitions ----------------------------------------------------------------------------
def _partition_state(opt: "ZeroOptimizer", src: CheckpointSource, topo, keys: List[str],
                     restore_counters: bool) -> dict:
    """A ``ZeroOptimizer.state_dict()`` for this rank's partition in the current layout, filled from ``src``.

    ``keys``: the optimizer tensors to take from the checkpoint (the others stay as this optimizer has them:
    zero moments for a fresh one). ``restore_counters``: also take step counts and the loss scaler.

    An expert-parallel optimizer (:class:`~hybrid.zero.expert_split.ExpertSplitOptimizer`) gets each half's
    state filled the same way (the dense half's partition over ``dp``, this ep rank's experts' over ``edp``:
    each half's records say where), under its own header. Every parameter is read from wherever the saved
    layout kept it (any ep size: the index locates each expert's partitions).
    """
    halves = getattr(opt, "halves", None)
    if halves is None:
        return _half_state(opt, opt.state_dict(), src, topo, keys, restore_counters)
    template = opt.state_dict()
    state = dict(template, dense=_half_state(opt.dense, template["dense"], src, topo, keys, restore_counters),
                 expert=_half_state(opt.expert, template["expert"], src, topo, keys, restore_counters))
    if restore_counters:
        header = src.optimizer_header()
        for k in ("global_steps", "skipped_steps", "loss_scaler"):
            state[k] = header[k]
    return state


def _half_state(opt: "ZeroOptimizer", template: dict, src: CheckpointSource, topo, keys: List[str],
                restore_counters: bool) -> dict:
    """:func:`_partition_state` for one flat optimizer ``opt`` whose state is ``template`` (its own
    ``state_dict()``, or an expert-parallel optimizer's half of it)."""
    wanted = [MASTER] + list(opt.inner.state_names)
    saved_keys = src.state_keys()
    absent = [k for k in keys if k in wanted and k not in saved_keys]
    header = src.optimizer_header()
    if absent:
        raise ConversionError(f"{src.reader.path} has no optimizer state {absent} (saved by optimizer "
                              f"{header.get('optimizer', {}).get('type')!r}); this run uses "
                              f"{opt.inner.kind!r}: set the same optimizer, or load weights only (--finetune)")
    records: Dict[int, list] = {}
    for rec in opt.param_index:
        records.setdefault(rec.group, []).append(rec)
    groups = []
    for g, tmpl in enumerate(template["groups"]):
        numel, dtype = tmpl[MASTER].numel(), tmpl[MASTER].dtype
        flats = {k: (torch.zeros(numel, dtype=dtype) if k in keys else tmpl[k].clone()) for k in wanted}
        for rec in records.get(g, []):
            mine = [p for p in rec.parts if p.part == opt.part]
            if not mine:
                continue
            if not src.has_state(rec.name):
                raise ConversionError(f"{src.reader.path} has no optimizer state for {rec.name!r}; load weights "
                                      f"only (--finetune)")
            target = Target(rec.tp_meta, topo.tp_size, topo.tp_rank)
            for k in keys:
                if k not in flats:
                    continue
                local = src.read(rec.name, k, target=target).reshape(-1)
                for p in mine:
                    n = p.param_end - p.param_start
                    flats[k][p.partition_offset: p.partition_offset + n] = local[p.param_start: p.param_end]
        groups.append({**{k: v for k, v in tmpl.items() if not isinstance(v, torch.Tensor)}, **flats})
    state = dict(template, groups=groups)
    if restore_counters:
        for k in ("step", "global_steps", "skipped_steps"):
            state[k] = header[k]
        if template.get("loss_scaler") is not None or header["loss_scaler"] is None:
            state["loss_scaler"] = header["loss_scaler"]  # the halves of an expert split keep none of their own
        state["optimizer"] = dict(template["optimizer"], type=header["optimizer"]["type"],
                                  lr=header["optimizer"]["lr"])
    return state


# ---- counters and random state ---------------------------------------------------------------------------
def _restore_rng(parts: TrainingParts, reader: CheckpointReader) -> None:
    if not reader.has_rank_state:
        return
    saved, topo = reader.layout, parts.topology
    state = reader.load_rank_state(*restored_rank(saved, topo.tp_size, topo.tp_rank, topo.dp_rank, topo.pp_rank))
    parts.rng.load_state_dict(state, same_tp_size=saved.tp == topo.tp_size)
