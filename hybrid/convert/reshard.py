"""Offline resharding: rewrite a checkpoint in another TP / DP / ZeRO-stage layout.

``load_engine`` reshards on load by itself (:mod:`hybrid.engine.reshard`);
this is the same conversion done ahead of time, so that the loading job
finds a checkpoint in its own layout and takes the exact same-layout path.

The output is what a job in the target layout would have saved:

* ``model_tpNN.safetensors``: each target TP piece is cut straight from the
  saved pieces, row range by row range (one tensor in memory at a time);
* ``optim_tpNN_dpNN.pt``: the ZeRO partitions of the target layout. Its
  flat buffers are planned with the optimizer's own rules
  (:func:`hybrid.zero.flat_buffer.plan_segments`, ``param_parts``) for the
  target TP size, DP size, stage and bucket size, and filled parameter by
  parameter from the saved partitions. One partition file is built in memory
  at a time: ``12 bytes x parameters / (tp x dp)`` for Adam (``x dp`` for stage 0);
* ``rank_tpNN_dpNN.pt``: random state, chosen as on load (see
  :mod:`hybrid.engine.reshard`);
* ``metadata.json``: the same iteration, samples, model config and trainer
  state, with the new layout and parameter index.

The ZeRO bucket size decides where flat segments end, so it must be the one
the loading job uses (``--zero-bucket-size``); by default it is read from the
saved trainer arguments.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from hybrid.checkpoint import CheckpointReader, CheckpointWriter
from hybrid.convert.consolidate import CheckpointSource, ConversionError, Target
from hybrid.convert.output import ProgressFactory, nbytes_of, open_bar, read_ahead, tracked
from hybrid.layout import STAGE_TRAITS, LayoutError, ParallelLayout, ZeroStage, zero_stage
from hybrid.param_meta import TPMeta, split_units
from hybrid.zero.flat_buffer import align_elements, dtype_name, param_parts, plan_segments

DEFAULT_BUCKET_SIZE = 25_000_000  # the trainer's --zero-bucket-size default

# A partition of the parameters themselves follows the model's modules, which an offline tool does not
# have: those stages are resharded on load only.
OFFLINE_STAGES = tuple(s for s in ZeroStage if not STAGE_TRAITS[s].parameters)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConversionError(f"unknown dtype {name!r} in the parameter index")
    return dtype


def plan_partitions(src: CheckpointSource, target: ParallelLayout,
                    bucket_size: int) -> Tuple[List[dict], List[dict]]:
    """The parameter index and flat groups a ZeroOptimizer of ``target``'s layout builds for this model,
    with flat segments of at most ``bucket_size`` elements (the optimizer's ``bucket_size``).

    Returns ``(param_index, groups)`` as JSON-ready dicts, the way
    ``ZeroOptimizer.state_dict()`` reports them (groups without tensors).
    """
    # The model's order (a pipeline checkpoint's stages one after the other): registration order at pp=1.
    records = [dict(t.record, position=k) for k, t in
               enumerate(t for t in src.tensors.values() if src.has_state(t.name))]
    classes: Dict[Tuple[str, bool], List[dict]] = {}
    for rec in records:  # groups appear in the order of their first parameter, like the optimizer's
        classes.setdefault((rec["dtype"], bool(rec["weight_decay"])), []).append(rec)
    index, groups = [], []
    for g, ((dtype, decay), members) in enumerate(classes.items()):
        shapes = [src.tensors[r["name"]].target_shape(Target(TPMeta.from_json(r["tp_meta"]), target.tp, 0))
                  for r in members]
        numels = [_numel(s) for s in shapes]
        segments = plan_segments(numels, target.dp, bucket_size, align_elements(_torch_dtype(dtype)))
        for s_idx, seg in enumerate(segments):
            offset = seg.start
            for r in seg.records:
                rec, numel = members[r], numels[r]
                parts = param_parts(offset, numel, seg, target.partition_count)
                index.append({"name": rec["name"], "shape": list(shapes[r]), "dtype": dtype, "group": g,
                              "segment": s_idx, "offset": offset, "numel": numel, "position": rec["position"],
                              "weight_decay": decay, "tp_meta": rec["tp_meta"],
                              "parts": [dataclasses.asdict(p) for p in parts]})
                offset += numel
        numel = segments[-1].start + segments[-1].size
        groups.append({"dtype": dtype_name(_torch_dtype(dtype)), "weight_decay": decay, "numel": numel,
                       "partition_numel": numel // target.partition_count,
                       "segments": [[s.start, s.size, s.used] for s in segments]})
    index.sort(key=lambda e: e["position"])
    return index, groups


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def reshard_checkpoint(load, save, *, target_tp: int, target_dp: Optional[int] = None,
                       target_zero_stage: Optional[int] = None, bucket_size: Optional[int] = None,
                       progress: Optional[ProgressFactory] = None) -> Path:
    """Write the checkpoint at ``load`` into save directory ``save`` in the target layout.

    ``target_dp`` and ``target_zero_stage`` default to the saved ones;
    ``bucket_size`` to the saved run's ``--zero-bucket-size``. Returns the new
    iteration directory (``save`` gets a ``latest`` pointing at it).
    """
    from hybrid.config import saved_setting  # reads the trainer's stored settings, nested or (older) flat

    reader = CheckpointReader(load)
    saved = reader.layout
    args = reader.trainer_state.get("client", {}).get("args", {}) or {}
    target = _target_layout(saved, target_tp, target_dp, target_zero_stage)
    bucket_size = bucket_size or saved_setting(args, "zero.bucket_size") or DEFAULT_BUCKET_SIZE
    _check_target(target, bucket_size, reader, Path(save))
    with CheckpointSource(reader) as src:
        with_optimizer = src.has_optimizer_state
        index, groups = plan_partitions(src, target, bucket_size) if with_optimizer \
            else (_weights_index(src, target), [])
        keys = src.state_keys() if with_optimizer else []
        total = sum(nbytes_of(t.full_shape, t.dtype) for t in src.tensors.values())
        total += sum(g["partition_numel"] * 4 * len(keys) * target.tp * target.dp for g in groups)
        bar = open_bar(progress, f"reshard to {target.describe()}", total)
        writer = CheckpointWriter(save, reader.iteration, target)
        try:
            writer.prepare()
            records = []
            for t in range(target.tp):
                with read_ahead(_model_sources(src, target, t, bar)) as sources:
                    records.append(writer.write_model_shard(sources, t))
                if with_optimizer:
                    records += _write_partitions(writer, src, target, t, index, groups, keys, bar)
            records += _write_rank_states(writer, reader, target)
            writer.commit(records, consumed_samples=reader.consumed_samples, model_config=reader.model_config,
                          param_index=index, trainer_state=_trainer_state(reader, target, args))
        finally:
            bar.close()
    return writer.iter_dir


def _target_layout(saved: ParallelLayout, tp: int, dp: Optional[int], stage: Optional[int]) -> ParallelLayout:
    """The saved layout with the requested sizes and stage (the precision stays). Always without pipeline
    parallelism: a pipeline job loads any checkpoint and reshards it on load, which knows its stages."""
    try:
        stage = saved.zero_stage if stage is None else zero_stage(stage, "--target-zero-stage")
        return saved.replace(tp=tp, dp=saved.dp if dp is None else dp, pp=1, zero_stage=stage)
    except LayoutError as e:
        raise ConversionError(f"cannot reshard to --target-tp {tp!r} --target-dp {dp!r}: {e}") from None


def _check_target(target: ParallelLayout, bucket_size: int, reader: CheckpointReader, save: Path) -> None:
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ConversionError(f"--zero-bucket-size must be an integer >= 1, got {bucket_size!r}")
    if target.zero_stage not in OFFLINE_STAGES:
        raise ConversionError(
            f"--target-zero-stage {int(target.zero_stage)}: a partition of the parameters follows the model's "
            f"modules, which an offline tool does not have; load the checkpoint as it is into that run (it "
            f"reshards on load), or reshard to stage {', '.join(str(int(s)) for s in OFFLINE_STAGES)} here")
    cfg = reader.model_config or {}
    for key in ("num_heads", "ffn_hidden_size"):
        value = cfg.get(key)
        if isinstance(value, int) and value % target.tp:
            raise ConversionError(f"--target-tp {target.tp} does not divide the model's {key}={value}; choose a "
                                  f"TP size that divides it")
    groups = cfg.get("num_query_groups")
    if isinstance(groups, int):
        try:
            split_units(groups, target.tp, "the model's num_query_groups")
        except ValueError as e:
            raise ConversionError(f"--target-tp {target.tp}: {e}") from None
    src_root = reader.path.resolve().parent
    if save.resolve() == src_root or save.resolve() == reader.path.resolve():
        raise ConversionError(f"--save {save} is the checkpoint's own directory; write the resharded checkpoint "
                              f"to a new directory")


def _model_sources(src: CheckpointSource, target: ParallelLayout, tp_rank: int, bar) -> dict:
    out = {}
    for name, t in src.tensors.items():
        tgt = Target(t.meta, target.tp, tp_rank)
        try:
            shape = t.target_shape(tgt)
        except ValueError as e:
            raise ConversionError(f"{name}: cannot split it over --target-tp {target.tp}: {e}") from None
        out[name] = tracked(shape, t.dtype, lambda name=name, tgt=tgt: src.read(name, target=tgt), bar)
    return out


def _write_partitions(writer: CheckpointWriter, src: CheckpointSource, target: ParallelLayout, tp_rank: int,
                      index: List[dict], groups: List[dict], keys: List[str], bar) -> list:
    header = src.optimizer_header()
    records = []
    # Without partitioned optimizer state every DP rank holds all of it: build it once, write it dp times.
    partitioned = target.traits.optimizer_states
    parts = range(target.partition_count)
    for part in parts:
        flats = [{k: torch.zeros(g["partition_numel"], dtype=torch.float32) for k in keys} for g in groups]
        for entry in index:
            mine = [p for p in entry["parts"] if p["part"] == part]
            if not mine:
                continue
            tgt = Target(TPMeta.from_json(entry["tp_meta"]), target.tp, tp_rank)
            for k in keys:
                local = src.read(entry["name"], k, target=tgt).reshape(-1)
                for p in mine:
                    n = p["param_end"] - p["param_start"]
                    flats[entry["group"]][k][p["partition_offset"]: p["partition_offset"] + n] = \
                        local[p["param_start"]: p["param_end"]]
        dp_ranks = [part] if partitioned else range(target.dp)
        for dp_rank in dp_ranks:
            state = {**header, "stage": int(target.zero_stage), "partition_count": target.partition_count,
                     "part": part, "dp_size": target.dp, "dp_rank": dp_rank, "tp_size": target.tp,
                     "tp_rank": tp_rank, "groups": [{**g, **f} for g, f in zip(groups, flats)]}
            records.append(writer.write_optimizer_shard(state, tp_rank, dp_rank))
            bar.update(sum(g["partition_numel"] * 4 * len(keys) for g in groups))
    return records


def _write_rank_states(writer: CheckpointWriter, reader: CheckpointReader, target: ParallelLayout) -> list:
    if not reader.has_rank_state:
        return []
    saved = reader.layout
    same_tp = saved.tp == target.tp
    records = []
    for t in range(target.tp):
        for d in range(target.dp):
            state = reader.load_rank_state(t if same_tp else 0, d if d < saved.dp else 0)
            streams = state.get("tp_rng")
            if streams and not same_tp:  # per-TP-rank dropout streams have no counterpart at another TP size
                state = dict(state, tp_rng={k: v for k, v in streams.items()
                                            if (k[0] if isinstance(k, (tuple, list)) else k) != "tp"})
            records.append(writer.write_rank_state(state, t, d))
    return records


def _weights_index(src: CheckpointSource, target: ParallelLayout) -> List[dict]:
    out = []
    for name, t in src.tensors.items():
        shape = t.target_shape(Target(t.meta, target.tp, 0))
        out.append({"name": name, "shape": list(shape), "dtype": dtype_name(t.dtype), "tp_meta": t.meta.to_json()})
    return out


def _trainer_state(reader: CheckpointReader, target: ParallelLayout, args: dict) -> dict:
    state = dict(reader.trainer_state)
    eng = state.get("engine")
    micro, global_batch = args.get("micro_batch_size"), args.get("global_batch_size")
    if isinstance(eng, dict) and "global_step" in eng and isinstance(micro, int):
        global_batch = global_batch or micro * reader.layout.dp
        if global_batch % (micro * target.dp) == 0:
            # Micro-steps count micro-batches of the saving layout; re-count them for the target one.
            state["engine"] = dict(eng, micro_steps=int(eng["global_step"]) * (global_batch // (micro * target.dp)))
    return state
