"""Offline resharding: rewrite a checkpoint in another TP / DP / PP / ZeRO-stage layout.

``Engine.load_checkpoint`` reshards on load by itself (:mod:`hybrid.engine.reshard`);
this is the same conversion done ahead of time, so that the loading job
finds a checkpoint in its own layout and takes the exact same-layout path.

The output is what a job in the target layout would have saved:

* ``model_tpNN[_ppNN].safetensors``: each target TP piece of each pipeline
  rank's entries, cut straight from the saved pieces, row range by row range
  (one tensor in memory at a time);
* ``optim_tpNN_dpNN[_ppNN].pt``: the ZeRO partitions of the target layout.
  Each rank's flat groups are planned with the optimizer's own rules
  (:func:`hybrid.zero.flat_buffer.group_classes`, ``place_group``) for the
  target TP size, DP size, stage and bucket size, and filled parameter by
  parameter from the saved partitions. One partition file is built in memory
  at a time: ``12 bytes x parameters / (tp x dp x pp)`` for Adam (``x dp`` for stage 0);
* ``rank_tpNN_dpNN[_ppNN].pt``: random state, chosen as on load
  (:func:`hybrid.checkpoint.rng.restored_rank`);
* ``metadata.json``: the same iteration, samples, model config and trainer
  state, with the new layout and parameter index (one per pipeline stage).

With pipeline parallelism (``pipeline["size"] > 1``) which parameters each
pipeline rank holds, in which order, and which copy of a tied embedding sits
in a flat group of its own come from that rank's model itself
(:mod:`hybrid.convert.stages`), split as the loading job's ``pipeline``
settings say (balanced, explicit ``layers_per_stage``, or interleaved
``layers_per_virtual_stage``).

The ZeRO bucket size decides where flat segments end, so it must be the one
the loading job uses (``--zero-bucket-size``); by default it is read from the
saved trainer arguments, like the pipeline split when the pipeline size is
unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

import torch

from hybrid.checkpoint import CheckpointReader, CheckpointWriter
from hybrid.checkpoint.rng import restored_rank, tracker_streams_for
from hybrid.config.errors import ConfigError
from hybrid.config.parse import config_from_dict
from hybrid.config.schema import HybridConfig, PipelineConfig
from hybrid.convert.consolidate import CheckpointSource, ConversionError, Target
from hybrid.convert.output import ProgressFactory, nbytes_of, new_checkpoint_in, open_bar, read_ahead, tracked
from hybrid.convert.stages import StageShare, pipeline_shares
from hybrid.layout import STAGE_TRAITS, LayoutError, ParallelLayout, ZeroStage, pipeline_problem, zero_stage
from hybrid.param_meta import TPMeta, split_units
from hybrid.zero.flat_buffer import align_elements, dtype_name, group_classes, place_group

DEFAULT_BUCKET_SIZE = HybridConfig().zero.bucket_size  # the trainer's --zero-bucket-size default
# The keys of the config's pipeline section that decide what each pipeline rank's files hold (the schedule
# does not): the size first.
SPLIT_KEYS = ("size", "layers_per_virtual_stage", "layers_per_stage")

# A partition of the parameters themselves follows the model's modules, which an offline tool does not
# have: those stages are resharded on load only.
OFFLINE_STAGES = tuple(s for s in ZeroStage if not STAGE_TRAITS[s].parameters)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConversionError(f"unknown dtype {name!r} in the parameter index")
    return dtype


def plan_partitions(src: CheckpointSource, target: ParallelLayout, bucket_size: int,
                    share: Optional[StageShare] = None) -> Tuple[List[dict], List[dict]]:
    """The parameter index and flat groups a ZeroOptimizer of ``target``'s layout builds for one pipeline
    rank's ``share`` of this model (default: the whole model, no pipeline), with flat segments of at most
    ``bucket_size`` elements (the optimizer's ``bucket_size``).

    Returns ``(param_index, groups)`` as JSON-ready dicts, the way
    ``ZeroOptimizer.state_dict()`` reports them (groups without tensors).
    """
    share = share or whole_model_share(src)
    # Positions count the parameters with optimizer state: the trainable ones the optimizer registered.
    kept = [i for i, n in enumerate(share.trainable) if src.has_state(n)]
    records = [src.tensors[share.trainable[i]].record for i in kept]
    chunk_sets = None if share.chunks is None else [share.chunks[i] for i in kept]
    classes = group_classes([(r["dtype"], bool(r["weight_decay"]), r["name"] in share.tied) for r in records])
    index, groups = [], []
    for g, ((dtype, decay, _), members) in enumerate(classes.items()):
        shapes = [src.tensors[records[m]["name"]].target_shape(
            Target(TPMeta.from_json(records[m]["tp_meta"]), target.tp, 0)) for m in members]
        numels = [_numel(shape) for shape in shapes]
        segments, placements = place_group(numels, target.partition_count, target.dp, bucket_size,
                                           align_elements(_torch_dtype(dtype)),
                                           None if chunk_sets is None else [chunk_sets[m] for m in members])
        for m, shape, numel, at in zip(members, shapes, numels, placements):
            rec = records[m]
            index.append({"name": rec["name"], "shape": list(shape), "dtype": dtype, "group": g,
                          "segment": at.segment, "offset": at.offset, "numel": numel, "position": m,
                          "weight_decay": decay, "tp_meta": rec["tp_meta"],
                          "parts": [dataclasses.asdict(p) for p in at.parts]})
        numel = segments[-1].start + segments[-1].size
        groups.append({"dtype": dtype_name(_torch_dtype(dtype)), "weight_decay": decay, "numel": numel,
                       "partition_numel": numel // target.partition_count,
                       "segments": [[s.start, s.size, s.used] for s in segments]})
    index.sort(key=lambda e: e["position"])
    return index, groups


def whole_model_share(src: CheckpointSource) -> StageShare:
    """Everything the checkpoint holds, in the model's order (a pipeline checkpoint's stages one after the
    other: registration order at pp=1), as one rank without pipeline parallelism holds it."""
    return StageShare(entries=tuple(src.tensors), trainable=tuple(src.tensors))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def reshard_checkpoint(load, save, *, target_tp: int, target_dp: Optional[int] = None,
                       target_zero_stage: Optional[int] = None, bucket_size: Optional[int] = None,
                       pipeline: Optional[Mapping[str, Any]] = None,
                       progress: Optional[ProgressFactory] = None, force: bool = False) -> Path:
    """Write the checkpoint at ``load`` into save directory ``save`` in the target layout.

    ``target_dp`` and ``target_zero_stage`` default to the saved ones;
    ``bucket_size`` to the saved run's ``--zero-bucket-size``. ``pipeline``: the
    loading job's pipeline settings, keys of the config's ``pipeline`` section
    (``size``, ``layers_per_virtual_stage``, ``layers_per_stage``); ``size``
    defaults to the saved pipeline size, the split to the saved run's when
    neither the size nor a split key is given (else the balanced split). Returns the new
    iteration directory (``save`` gets a ``latest`` pointing at it). A ``save`` already holding checkpoints
    is refused unless ``force`` (:func:`hybrid.convert.output.new_checkpoint_in`).
    """
    from hybrid.config import saved_setting  # reads the trainer's stored settings, nested or (older) flat

    reader = CheckpointReader(load)
    saved = reader.layout
    args = reader.trainer_state.get("client", {}).get("args", {}) or {}
    pipe = _target_pipeline(saved, args, pipeline or {})
    target = _target_layout(saved, target_tp, target_dp, target_zero_stage, pipe.size)
    if bucket_size is None:  # 0 is refused by _check_target, not taken for "unset"
        bucket_size = saved_setting(args, "zero.bucket_size") or DEFAULT_BUCKET_SIZE
    _check_target(target, bucket_size, reader, Path(save))
    with CheckpointSource(reader) as src:
        shares = pipeline_shares(reader.model_config, pipe, target.pp)[1] if target.pp > 1 \
            else [whole_model_share(src)]
        _check_entries(src, shares)
        with_optimizer = src.has_optimizer_state
        plans = [plan_partitions(src, target, bucket_size, share) if with_optimizer
                 else (_weights_index(src, target, share), []) for share in shares]
        keys = src.state_keys() if with_optimizer else []
        total = sum(nbytes_of(src.tensors[n].full_shape, src.tensors[n].dtype) for share in shares
                    for n in share.entries)
        total += sum(g["partition_numel"] * 4 * len(keys) * target.tp * target.dp for _, groups in plans
                     for g in groups)
        # as a job's save: a job saving into the same folder would delete this rewrite's files as leftovers
        with new_checkpoint_in(save, reader.iteration, force=force):
            bar = open_bar(progress, f"reshard to {target.describe()}", total)
            writer = CheckpointWriter(save, reader.iteration, target)
            try:
                writer.prepare()
                records = []
                for p, (share, (index, groups)) in enumerate(zip(shares, plans)):
                    for t in range(target.tp):
                        with read_ahead(_model_sources(src, target, t, share, bar)) as sources:
                            records.append(writer.write_model_shard(sources, t, p))
                        if with_optimizer:
                            records += _write_partitions(writer, src, target, t, p, index, groups, keys, bar)
                records += _write_rank_states(writer, reader, target)
                param_index = [index for index, _ in plans] if target.pp > 1 else plans[0][0]
                writer.commit(records, consumed_samples=reader.consumed_samples, model_config=reader.model_config,
                              param_index=param_index, trainer_state=_trainer_state(reader, target, args, pipe))
            finally:
                bar.close()
    return writer.iter_dir


def _target_pipeline(saved: ParallelLayout, args: dict, given: Mapping[str, Any]) -> PipelineConfig:
    """The loading job's pipeline settings: ``given``, then the saved run's (see :func:`reshard_checkpoint`),
    validated by the trainer's own rules (errors name its flags)."""
    from hybrid.config import saved_setting

    unknown = sorted(set(given) - set(SPLIT_KEYS))
    if unknown:
        raise ConversionError(f"unknown pipeline settings {unknown}; the offline reshard takes {list(SPLIT_KEYS)}")
    size = saved.pp if given.get("size") is None else given["size"]
    # The saved split describes the saved stages: it applies when neither the size nor the split changes.
    keep_split = size == saved.pp and all(given.get(key) is None for key in SPLIT_KEYS[1:])
    tree = {"size": size, **{key: saved_setting(args, f"pipeline.{key}") if keep_split else given.get(key)
                             for key in SPLIT_KEYS[1:]}}
    if tree["layers_per_virtual_stage"] is not None:
        tree["schedule"] = "interleaved"  # the schedule that runs virtual stages; it does not change the files
    try:
        return config_from_dict({"pipeline": tree}).pipeline
    except ConfigError as e:
        raise ConversionError(str(e)) from None


def _target_layout(saved: ParallelLayout, tp: int, dp: Optional[int], stage: Optional[int],
                   pp: int) -> ParallelLayout:
    """The saved layout with the requested sizes and stage (the precision stays)."""
    try:
        stage = saved.zero_stage if stage is None else zero_stage(stage, "--target-zero-stage")
        return saved.replace(tp=tp, dp=saved.dp if dp is None else dp, pp=pp, zero_stage=stage)
    except LayoutError as e:
        raise ConversionError(f"cannot reshard to --target-tp {tp!r} --target-dp {dp!r}: {e}") from None


def _check_target(target: ParallelLayout, bucket_size: int, reader: CheckpointReader, save: Path) -> None:
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ConversionError(f"--zero-bucket-size must be an integer >= 1, got {bucket_size!r}")
    problem = pipeline_problem(target.zero_stage, target.pp)
    if problem:
        raise ConversionError(f"--target-zero-stage {int(target.zero_stage)} with --pipeline-model-parallel-size "
                              f"{target.pp}: {problem}")
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


def _check_entries(src: CheckpointSource, shares: List[StageShare]) -> None:
    """Every entry a target rank's model holds must be in the checkpoint."""
    missing = sorted({n for share in shares for n in share.entries if n not in src.tensors})
    if missing:
        raise ConversionError(f"{src.reader.path} holds a different model than its model_config builds: missing "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def _model_sources(src: CheckpointSource, target: ParallelLayout, tp_rank: int, share: StageShare, bar) -> dict:
    out = {}
    for name in share.entries:
        t = src.tensors[name]
        tgt = Target(t.meta, target.tp, tp_rank)
        try:
            shape = t.target_shape(tgt)
        except ValueError as e:
            raise ConversionError(f"{name}: cannot split it over --target-tp {target.tp}: {e}") from None
        out[name] = tracked(shape, t.dtype, lambda name=name, tgt=tgt: src.read(name, target=tgt), bar)
    return out


def _write_partitions(writer: CheckpointWriter, src: CheckpointSource, target: ParallelLayout, tp_rank: int,
                      pp_rank: int, index: List[dict], groups: List[dict], keys: List[str], bar) -> list:
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
            records.append(writer.write_optimizer_shard(state, tp_rank, dp_rank, pp_rank))
            bar.update(sum(g["partition_numel"] * 4 * len(keys) for g in groups))
    return records


def _write_rank_states(writer: CheckpointWriter, reader: CheckpointReader, target: ParallelLayout) -> list:
    if not reader.has_rank_state:
        return []
    same_tp = reader.layout.tp == target.tp
    records = []
    for p in range(target.pp):
        for t in range(target.tp):
            for d in range(target.dp):
                state = reader.load_rank_state(*restored_rank(reader.layout, target.tp, t, d, p))
                if state.get("tp_rng"):
                    state = dict(state, tp_rng=tracker_streams_for(state["tp_rng"], same_tp))
                records.append(writer.write_rank_state(state, t, d, p))
    return records


def _weights_index(src: CheckpointSource, target: ParallelLayout, share: StageShare) -> List[dict]:
    out = []
    for name in share.entries:
        t = src.tensors[name]
        shape = t.target_shape(Target(t.meta, target.tp, 0))
        out.append({"name": name, "shape": list(shape), "dtype": dtype_name(t.dtype), "tp_meta": t.meta.to_json()})
    return out


def _trainer_state(reader: CheckpointReader, target: ParallelLayout, args: dict, pipe: PipelineConfig) -> dict:
    state = dict(reader.trainer_state)
    if isinstance(args.get("pipeline"), dict):
        # The stored settings describe the files: a later reshard reads the split from them.
        split = {key: getattr(pipe, key) for key in SPLIT_KEYS}
        client = dict(state.get("client", {}), args=dict(args, pipeline=dict(args["pipeline"], **split)))
        state["client"] = client
    eng = state.get("engine")
    micro = args.get("micro_batch_size")
    if isinstance(eng, dict) and isinstance(micro, int):
        # Micro-steps count micro-batches of the saving layout; re-count them for the target one from the
        # samples consumed (a batch ramp-up varies the micro-batches per step).
        consumed = int(eng.get("consumed_samples", reader.consumed_samples))
        if consumed % (micro * target.dp) == 0:
            state["engine"] = dict(eng, consumed_samples=consumed, micro_steps=consumed // (micro * target.dp))
    return state
