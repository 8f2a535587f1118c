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
from hybrid.convert.consolidate import EXPERT_STATE_FORMAT, CheckpointSource, ConversionError, Target
from hybrid.convert.output import ProgressFactory, nbytes_of, new_checkpoint_in, open_bar, read_ahead, tracked
from hybrid.convert.stages import StageShare, dense_share, expert_share, pipeline_shares
from hybrid.layout import STAGE_TRAITS, LayoutError, ParallelLayout, ZeroStage, pipeline_problem, zero_stage
from hybrid.param_meta import TPMeta, split_units
from hybrid.zero.expert_split import expert_index_entries
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


@dataclasses.dataclass
class RankPlan:
    """What one pipeline rank's optimizer files hold in the target layout: the ``(param_index, groups)`` of
    :func:`plan_partitions` for the whole share, or, for an expert-parallel rank whose share holds experts,
    for its dense half (over ``dp``) and for each ep rank's expert half (over ``edp = dp / ep``)."""

    dense: Tuple[List[dict], List[dict]]
    experts: Optional[List[Tuple[List[dict], List[dict]]]] = None  # per ep rank; None: one plain optimizer

    def metadata_index(self) -> List[dict]:
        """The stage's metadata.json index: the dense records, then every ep rank's expert records
        (:func:`hybrid.zero.expert_split.expert_index_entries`)."""
        index = list(self.dense[0])
        for r, (experts, _) in enumerate(self.experts or ()):
            index += expert_index_entries(experts, r)
        return index

    def halves(self) -> List[Tuple[List[dict], List[dict]]]:
        return [self.dense] + list(self.experts or ())


def _is_moe(model_config: Optional[Mapping[str, Any]]) -> bool:
    return bool((model_config or {}).get("num_experts"))


def plan_rank(src: CheckpointSource, target: ParallelLayout, bucket_size: int, share: StageShare) -> RankPlan:
    """The optimizer partitions of one pipeline rank's ``share`` in ``target``: as
    :class:`~hybrid.zero.expert_split.ExpertSplitOptimizer` lays them out where ``target.ep > 1`` and the
    share trains experts (the dense half over ``dp``, each ep rank's experts over ``edp``, a layout of
    ``dp / ep`` ranks), else as one optimizer over ``dp``."""
    if target.ep == 1 or not share.experts:
        return RankPlan(plan_partitions(src, target, bucket_size, share))
    num_experts = int(src.reader.model_config["num_experts"])
    edp = target.replace(dp=target.dp // target.ep, ep=1)
    return RankPlan(plan_partitions(src, target, bucket_size, dense_share(share)),
                    [plan_partitions(src, edp, bucket_size, expert_share(share, r, num_experts, target.ep))
                     for r in range(target.ep)])


def reshard_checkpoint(load, save, *, target_tp: int, target_dp: Optional[int] = None,
                       target_zero_stage: Optional[int] = None, bucket_size: Optional[int] = None,
                       pipeline: Optional[Mapping[str, Any]] = None, target_ep: Optional[int] = None,
                       progress: Optional[ProgressFactory] = None, force: bool = False) -> Path:
    """Write the checkpoint at ``load`` into save directory ``save`` in the target layout.

    ``target_ep``: the expert-parallel size (``--expert-model-parallel-size`` of the loading job; default: the
    saved one). ``target_dp`` and ``target_zero_stage`` default to the saved ones;
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
    target = _target_layout(saved, target_tp, target_dp, target_zero_stage, pipe.size, target_ep)
    if bucket_size is None:  # 0 is refused by _check_target, not taken for "unset"
        bucket_size = saved_setting(args, "zero.bucket_size") or DEFAULT_BUCKET_SIZE
    _check_target(target, bucket_size, reader, Path(save))
    with CheckpointSource(reader) as src:
        # An MoE model's shares come from the model itself at any pipeline size: the experts' places in the
        # optimizer's order (and, at ep > 1, which half holds each) are the model's.
        shares = pipeline_shares(reader.model_config, pipe, target.pp)[1] \
            if target.pp > 1 or _is_moe(reader.model_config) else [whole_model_share(src)]
        _check_entries(src, shares)
        with_optimizer = src.has_optimizer_state
        plans = [plan_rank(src, target, bucket_size, share) if with_optimizer
                 else RankPlan((_weights_index(src, target, share), [])) for share in shares]
        keys = src.state_keys() if with_optimizer else []
        total = sum(nbytes_of(src.tensors[n].full_shape, src.tensors[n].dtype) for share in shares
                    for n in share.entries)
        # each dp rank's file holds its dense partition and (at ep > 1) one of its ep rank's expert partitions
        total += sum(g["partition_numel"] * 4 * len(keys) * target.tp * target.dp
                     // (1 if plan.experts is None or h == 0 else target.ep)
                     for plan in plans for h, (_, groups) in enumerate(plan.halves()) for g in groups)
        # as a job's save: a job saving into the same folder would delete this rewrite's files as leftovers
        with new_checkpoint_in(save, reader.iteration, force=force):
            bar = open_bar(progress, f"reshard to {target.describe()}", total)
            writer = CheckpointWriter(save, reader.iteration, target)
            try:
                writer.prepare()
                records, param_index = write_shares(writer, src, target, shares, plans, keys, bar)
                records += _write_rank_states(writer, reader, target)
                writer.commit(records, consumed_samples=reader.consumed_samples, model_config=reader.model_config,
                              param_index=param_index, trainer_state=_trainer_state(reader, target, args, pipe))
            finally:
                bar.close()
    return writer.iter_dir


def write_shares(writer: CheckpointWriter, src: CheckpointSource, target: ParallelLayout, shares: List[StageShare],
                 plans: List[RankPlan], keys: List[str], bar) -> Tuple[list, Any]:
    """Every model file of ``target`` and, when ``keys`` (:meth:`CheckpointSource.state_keys`) are given, every
    optimizer file, each pipeline rank's ``share`` laid out as its ``plan`` says, from ``src`` (anything with
    :class:`CheckpointSource`'s ``tensors``, ``read`` and ``optimizer_header``). Returns the file records and
    the parameter index for ``metadata.json`` (one per pipeline stage when ``target.pp > 1``)."""
    records = []
    for p, (share, plan) in enumerate(zip(shares, plans)):
        for t in range(target.tp):
            with read_ahead(_model_sources(src, target, t, share, bar)) as sources:
                records.append(writer.write_model_shard(sources, t, p))
            if keys:
                records += _write_partitions(writer, src, target, t, p, plan, keys, bar)
    indexes = [plan.metadata_index() for plan in plans]
    return records, indexes if target.pp > 1 else indexes[0]


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
                   pp: int, ep: Optional[int] = None) -> ParallelLayout:
    """The saved layout with the requested sizes and stage (the precision stays)."""
    try:
        stage = saved.zero_stage if stage is None else zero_stage(stage, "--target-zero-stage")
        return saved.replace(tp=tp, dp=saved.dp if dp is None else dp, pp=pp, zero_stage=stage,
                             ep=saved.ep if ep is None else ep)
    except LayoutError as e:
        raise ConversionError(f"cannot reshard to --target-tp {tp!r} --target-dp {dp!r} --target-ep {ep!r}: "
                              f"{e}") from None


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
    experts = cfg.get("num_experts")
    if target.ep > 1 and not (isinstance(experts, int) and experts % target.ep == 0):
        raise ConversionError(f"--target-ep {target.ep}: each expert-parallel rank holds num_experts / ep whole "
                              f"experts, but the model has num_experts={experts}; choose an ep that divides it")
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
                      pp_rank: int, plan: RankPlan, keys: List[str], bar) -> list:
    """Every optimizer file of (``tp_rank``, ``pp_rank``), one DP rank's at a time."""
    header = src.optimizer_header()
    records = []
    partitioned = target.traits.optimizer_states
    index, groups = plan.dense
    if plan.experts is None:
        # Without partitioned optimizer state every DP rank holds all of it: build it once, write it dp times.
        for part in range(target.partition_count):
            flats = _partition_flats(src, target, tp_rank, part, index, groups, keys)
            for dp_rank in ([part] if partitioned else range(target.dp)):
                state = _half_header(header, target, tp_rank, part, target.dp, dp_rank, flats)
                records.append(writer.write_optimizer_shard(state, tp_rank, dp_rank, pp_rank))
                bar.update(sum(g["partition_numel"] * 4 * len(keys) for g in groups))
        return records
    # An expert-parallel rank (hybrid.zero.expert_split): its dense partition over dp, its ep rank's expert
    # partition over edp (the ep consecutive dp ranks of an edp position hold different experts).
    edp = target.dp // target.ep
    for dp_rank in range(target.dp):
        edp_rank, ep_rank = divmod(dp_rank, target.ep)
        dense_part, expert_part = (dp_rank, edp_rank) if partitioned else (0, 0)
        expert_index, expert_groups = plan.experts[ep_rank]
        dense = _half_header(header, target, tp_rank, dense_part, target.dp, dp_rank,
                             _partition_flats(src, target, tp_rank, dense_part, index, groups, keys))
        expert = _half_header(header, target, tp_rank, expert_part, edp, edp_rank,
                              _partition_flats(src, target, tp_rank, expert_part, expert_index, expert_groups, keys))
        expert["param_index"] = expert_index  # the expert half checks it on load (metadata.json has it too)
        for half in (dense, expert):  # the run's counters and scaler live at the top (the halves take no step)
            half["loss_scaler"] = None
        state = {"format": EXPERT_STATE_FORMAT, "stage": int(target.zero_stage), "dense": dense, "expert": expert,
                 "dp_size": target.dp, "dp_rank": dp_rank, "tp_size": target.tp, "tp_rank": tp_rank,
                 "ep_size": target.ep, "ep_rank": ep_rank, "edp_size": edp, "edp_rank": edp_rank,
                 "global_steps": header["global_steps"], "skipped_steps": header["skipped_steps"],
                 "loss_scaler": header["loss_scaler"]}
        records.append(writer.write_optimizer_shard(state, tp_rank, dp_rank, pp_rank))
        bar.update(sum(g["partition_numel"] * 4 * len(keys) for g in groups + expert_groups))
    return records


def _half_header(header: dict, target: ParallelLayout, tp_rank: int, part: int, dp: int, dp_rank: int,
                 groups: List[dict]) -> dict:
    """One ZeRO optimizer state (``hybrid.zero/1``): partition ``part`` over ``dp`` ranks, around ``groups``."""
    return {**header, "stage": int(target.zero_stage), "partition_count": dp if target.traits.optimizer_states
            else 1, "part": part, "dp_size": dp, "dp_rank": dp_rank, "tp_size": target.tp, "tp_rank": tp_rank,
            "groups": groups}


def _partition_flats(src: CheckpointSource, target: ParallelLayout, tp_rank: int, part: int, index: List[dict],
                     groups: List[dict], keys: List[str]) -> List[dict]:
    """Partition ``part``'s flat groups (``groups`` with each of ``keys`` as a tensor) for TP rank ``tp_rank``,
    filled from ``src`` parameter by parameter through ``index``'s parts."""
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
    return [{**g, **f} for g, f in zip(groups, flats)]


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
