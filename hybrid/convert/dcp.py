"""``to-dcp`` and ``from-dcp``: hybrid checkpoints <-> ``torch.distributed.checkpoint`` (DCP) folders.

The layout is torchtitan's (``torchtitan.components.checkpoint``): the model's state dict at the top level (its
fully qualified names, as ``CheckpointManager._flattened_model_states_sd`` writes them), the optimizer's under
``optimizer`` in the flat form of ``torch.distributed.checkpoint.state_dict`` with
``flatten_optimizer_state_dict=True``, and the step under ``train_state``:

=======================================================  ===============================================
key                                                      value
=======================================================  ===============================================
``{fqn}``                                                the full weight (TP-merged, vocabulary padding
                                                         removed); the fp32 master of a bf16/fp16 run
``optimizer.state.{fqn}.exp_avg`` / ``.exp_avg_sq``      Adam's moments, fp32, the weight's shape
``optimizer.state.{fqn}.step``                           Adam's step count (a float32 scalar, as
                                                         ``torch.optim.AdamW`` keeps it)
``optimizer.param_groups.{fqn}.{lr,betas,eps,...}``      ``torch.optim.AdamW``'s group settings;
                                                         ``weight_decay`` 0 where hybrid applies none
``train_state.step``                                     the iteration (int32)
``train_state.consumed_samples``                         hybrid's own: the samples consumed (int64)
=======================================================  ===============================================

``fqn`` is hybrid's parameter name (``layers.0.attention.qkv_proj.weight``, the names of
:mod:`hybrid.convert.fp32`): a model with hybrid's module names loads the model part with ``dcp.load``, and any
process reads the folder with ``torch.distributed.checkpoint.load`` or ``format_utils.dcp_to_torch_save``. The
optimizer part is written where that mapping is defined: an Adam / AdamW checkpoint that holds its state (the
master is the weight itself, since a torchtitan model's parameters are fp32). Older torchtitan folders nest the
model under ``model.``; :func:`import_from_dcp` reads both.

Reading a DCP folder runs no code from it: its ``.metadata`` is a pickle, read by a restricted unpickler that
builds only DCP's metadata classes, ``torch.Size``, dtypes and paths (:data:`METADATA_GLOBALS`; anything else is
refused in one line naming the file and the global, checked by :mod:`hybrid.convert.safe_pickle`'s scan before any
object is built), and its non-tensor values (hyperparameters) are loaded with ``torch.load(weights_only=True)``.
``torch.distributed.checkpoint``'s own reader unpickles ``.metadata`` with plain ``pickle.load``.

Memory: both directions hold the whole model and its optimizer state in memory at once (DCP plans one state
dict); the import writes a TP=1, DP=1 checkpoint, which any layout loads (resharding on load) or
``convert_checkpoint.py reshard`` rewrites.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Dict, Optional

import torch

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.consolidate import MASTER, CheckpointSource, ConversionError
from hybrid.convert.converted_writer import MOMENTS
from hybrid.convert.output import ProgressFactory, nbytes_of, new_checkpoint_in, open_bar
from hybrid.convert.safe_pickle import PlainGlobals, UnsafePickleError, check_globals
from hybrid.dtypes import DTYPES, PRECISION_OF_DTYPE

OPTIMIZER, TRAIN_STATE, MODEL_PREFIX = "optimizer", "train_state", "model."  # torchtitan's state names
ADAM_TYPES = ("adam", "adamw")  # the optimizers whose state maps onto torch.optim.AdamW's
MODEL_CONFIG_FILE = "hybrid_model_config.json"  # beside the DCP files: what from-dcp builds the model from
METADATA_FILE = ".metadata"


# ---- reading a DCP folder without running its code --------------------------------------------------------
def _metadata_globals() -> Dict[str, Any]:
    """``{module.name: object}``: what a DCP ``.metadata`` pickle may name, each bound to a class that only
    holds data."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    out: Dict[str, Any] = {f"torch.distributed.checkpoint.metadata.{name}": getattr(metadata, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")}
    out["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    # Metadata.all_local_plans: the save plans a writer caches (megatron-core's torch_dist records them)
    out.update({f"torch.distributed.checkpoint.planner.{name}": getattr(planner, name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")})
    out["torch.Size"] = torch.Size
    out["torch.serialization._get_layout"] = torch.serialization._get_layout  # name -> torch.strided & co.
    # the checkpoint id a writer recorded: a path, kept as a pure path (nothing touches the file system)
    out["pathlib.PosixPath"] = out["pathlib.PurePosixPath"] = PurePosixPath
    out["pathlib.WindowsPath"] = out["pathlib.PureWindowsPath"] = PureWindowsPath
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            out[f"torch.{name}"] = value
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what :func:`_metadata_globals` names (a second guard after the scan)."""

    def __init__(self, file, path: Path, allowed: Dict[str, Any]):
        super().__init__(file)
        self._path, self._allowed = path, allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get(f"{module}.{name}")
        if found is None:
            raise UnsafePickleError(f"{self._path}: refused to load: it names the global {module}.{name}, which is "
                                    f"not a DCP metadata class (nothing from the file was run)")
        return found


def read_metadata(folder) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of a DCP folder, unpickled with the allowlist;
    :class:`UnsafePickleError` naming the file and the global for anything else."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        raise ConversionError(f"--input {folder} is not a torch.distributed.checkpoint folder (no {METADATA_FILE} "
                              f"in it)")
    allowed = _metadata_globals()
    # the scan: every global the pickle names, before any object is built (hybrid.convert.safe_pickle)
    check_globals(path, PlainGlobals(records=frozenset(allowed)))
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path, allowed).load()
        except UnsafePickleError:
            raise
        except Exception as e:  # a truncated or garbled pickle
            raise ConversionError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise ConversionError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


_GLOBAL_NAMED = re.compile(r"GLOBAL (\S+)")


def _reader_and_planner(folder: Path, metadata):
    """A DCP storage reader whose metadata is the one read safely, and a load planner whose non-tensor values
    are loaded with ``weights_only``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            key = read_item.dest_index.fqn
            try:
                self.state_dict[key] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                named = _GLOBAL_NAMED.search(str(e))
                what = f"it names the global {named.group(1)}" if named else str(e).strip().splitlines()[0]
                raise UnsafePickleError(f"{folder}: refused to load the value of {key}: {what}, which is not plain "
                                        f"data (nothing from the file was run)") from None

    return SafeReader(folder), SafePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def load_dcp(folder, keys=None) -> Dict[str, Any]:
    """``{key: value}`` of a DCP folder (keys as its metadata spells them, nested states joined with ``.``), or of
    ``keys`` only. One process, no process group; nothing from the folder is executed."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    metadata = read_metadata(folder)
    wanted = metadata.state_dict_metadata if keys is None else {k: metadata.state_dict_metadata[k] for k in keys}
    state: Dict[str, Any] = {}
    for key, md in wanted.items():
        state[key] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) \
            else None
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _reader_and_planner(folder, metadata)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:  # DCP wraps each rank's exception with its traceback: the first, alone
        first = next(iter(e.failures.values()))[0]
        if isinstance(first, UnsafePickleError):
            raise first from None
        raise ConversionError(f"{folder}: reading it failed: {type(first).__name__}: {first}") from None
    return state


# ---- export ---------------------------------------------------------------------------------------------------
def adamw_group_settings(optimizer: dict) -> Dict[str, Any]:
    """``torch.optim.AdamW``'s param-group settings (``params`` left out) for hybrid's optimizer settings: every
    key torch keeps, so that ``set_optimizer_state_dict`` finds them all."""
    group = torch.optim.AdamW([torch.zeros(1)], lr=float(optimizer["lr"]), betas=tuple(optimizer["betas"]),
                              eps=float(optimizer["eps"]), weight_decay=float(optimizer["weight_decay"]))
    return {k: v for k, v in group.param_groups[0].items() if k != "params"}


def export_to_dcp(load, output, *, dtype: Optional[str] = None, optimizer: bool = True,
                  progress: Optional[ProgressFactory] = None) -> Dict[str, Any]:
    """Write the checkpoint at ``load`` as a DCP folder ``output`` (module docstring). ``dtype`` casts the weights
    (default: the best copy, the fp32 masters of a bf16/fp16 run); ``optimizer=False`` writes the weights alone.
    Returns ``{"folder", "tensors", "optimizer": bool, "note"}``."""
    from torch.distributed.checkpoint import save

    reader = CheckpointReader(load)
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"--output {out} is not empty; DCP files of another checkpoint would mix with these: "
                              f"give a new folder")
    cast = DTYPES[dtype] if dtype else None
    if dtype and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    state: Dict[str, Any] = {}
    note = None
    with CheckpointSource(reader) as src:
        bar = open_bar(progress, "to-dcp weights", sum(nbytes_of(t.full_shape, cast or torch.float32)
                                                      for t in src.tensors.values()))
        try:
            for name in src.tensors:
                state[name] = src.read_weight(name, dtype=cast)
                bar.update(nbytes_of(state[name].shape, state[name].dtype))
            header = src.optimizer_header() if src.has_optimizer_state else {}
            settings = header.get("optimizer") or {}
            if optimizer and src.has_optimizer_state and settings.get("type") in ADAM_TYPES \
                    and set(MOMENTS) <= set(src.state_keys()):
                state[OPTIMIZER] = _optimizer_state(src, header)
            elif optimizer:
                note = ("weights only: " + ("the checkpoint holds no optimizer state" if not src.has_optimizer_state
                                            else f"its optimizer {settings.get('type')!r} has no Adam moments to "
                                                 f"map onto torch.optim.AdamW's"))
        finally:
            bar.close()
    state[TRAIN_STATE] = {"step": torch.tensor(reader.iteration, dtype=torch.int32),
                          # hybrid's, beside torchtitan's step: where the data continues
                          "consumed_samples": torch.tensor(reader.consumed_samples, dtype=torch.int64)}
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save(state, checkpoint_id=str(out), no_dist=True)
    (out / MODEL_CONFIG_FILE).write_text(json.dumps(reader.model_config, indent=2) + "\n")
    return {"folder": out, "tensors": len(src.tensors), "optimizer": OPTIMIZER in state, "note": note}


def _optimizer_state(src: CheckpointSource, header: dict) -> Dict[str, Any]:
    """The flat optimizer state (module docstring) of every parameter with optimizer state."""
    settings = adamw_group_settings(header["optimizer"])
    step = torch.tensor(float(header["step"]), dtype=torch.float32)
    out: Dict[str, Any] = {}
    for name in src.tensors:
        if not src.has_state(name):
            continue
        for key in MOMENTS:
            out[f"state.{name}.{key}"] = src.read(name, key, dtype=torch.float32)
        out[f"state.{name}.step"] = step.clone()
        decays = src.tensors[name].record.get("weight_decay", True)
        for key, value in settings.items():
            out[f"param_groups.{name}.{key}"] = value if key != "weight_decay" or decays else 0.0
    return out


# ---- import ---------------------------------------------------------------------------------------------------
def import_from_dcp(input_dir, save, *, model_config=None, dtype: Optional[str] = None, force: bool = False,
                    progress: Optional[ProgressFactory] = None) -> Path:
    """Write the DCP folder ``input_dir`` as a hybrid checkpoint in ``save`` (TP=1, DP=1): the weights, and the
    Adam moments and step where the folder holds them in the layout of the module docstring.

    ``model_config``: a JSON file of the model's settings (``model_config`` of a hybrid ``metadata.json``); default
    the folder's own ``hybrid_model_config.json`` (``to-dcp`` writes it). ``dtype``: the run's precision (default:
    the weights' dtype); with optimizer state a bf16/fp16 run's masters are the folder's fp32 weights.
    """
    from hybrid.convert.hf import gpt_buffer_layout, gpt_param_layout
    from model_zoo.config import GPTConfig

    folder = Path(input_dir)
    metadata = read_metadata(folder)
    config_path = Path(model_config) if model_config else folder / MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise ConversionError(f"{folder} has no {MODEL_CONFIG_FILE} (to-dcp writes one); pass --model-config "
                              f"FILE.json with the model's settings (the model_config of a hybrid metadata.json)")
    try:
        cfg = GPTConfig.from_dict(json.loads(config_path.read_text()))
        cfg.validate(1)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{config_path}: not a model hybrid can build: {e}") from None
    keys = set(metadata.state_dict_metadata)
    params, buffers = gpt_param_layout(cfg), gpt_buffer_layout(cfg)
    prefix = MODEL_PREFIX if all(MODEL_PREFIX + n in keys for n in params) else ""
    missing = sorted(n for n in params if prefix + n not in keys)
    if missing:
        raise ConversionError(f"{folder} lacks {len(missing)} weight(s) of the model {config_path} describes: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (it holds "
                              f"{', '.join(sorted(keys)[:5])} ...)")
    for name, (shape, _) in params.items():
        saved = tuple(metadata.state_dict_metadata[prefix + name].size)
        if saved != tuple(shape):
            raise ConversionError(f"{folder}: {prefix + name} has shape {list(saved)}, the model {config_path} "
                                  f"describes {list(shape)}")
    state_key = f"{OPTIMIZER}.state.{{}}.{{}}"
    with_optimizer = all(state_key.format(n, m) in keys for n in params for m in MOMENTS)
    wanted = [prefix + n for n in params] + [prefix + n for n in buffers if prefix + n in keys]
    if with_optimizer:
        wanted += [state_key.format(n, m) for n in params for m in MOMENTS + ("step",) if
                   state_key.format(n, m) in keys]
        wanted += [k for k in keys if k.startswith(f"{OPTIMIZER}.param_groups.")]
    wanted += [k for k in (f"{TRAIN_STATE}.step", f"{TRAIN_STATE}.consumed_samples") if k in keys]
    total = sum(nbytes_of(m.size, m.properties.dtype) for m in map(metadata.state_dict_metadata.get, wanted)
                if hasattr(m, "properties"))  # the tensors' bytes (the settings are a few bytes each)
    bar = open_bar(progress, "from-dcp", total)
    try:
        values = load_dcp(folder, wanted)  # one DCP load: its planner reads each file once
        bar.update(total)
    finally:
        bar.close()
    weights = {n: values[prefix + n] for n in params}
    weight_dtype = next(iter(weights.values())).dtype
    run_dtype = DTYPES[dtype] if dtype else weight_dtype
    if dtype and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if run_dtype not in PRECISION_OF_DTYPE:
        raise ConversionError(f"{folder} holds {weight_dtype} weights; pass --dtype fp32, bf16 or fp16")
    iteration, consumed = (int(values.get(f"{TRAIN_STATE}.{key}", 0)) for key in ("step", "consumed_samples"))
    source = {"format": "torch.distributed.checkpoint", "path": str(folder.resolve())}
    with new_checkpoint_in(save, iteration, force=force):
        if not with_optimizer:
            return _write_weights(save, iteration, cfg, weights, {n: values[prefix + n] for n in buffers
                                                                  if prefix + n in values}, run_dtype, source)
        step = _one_step(values, params, state_key)
        moments = {n: {m: values[state_key.format(n, m)] for m in MOMENTS} for n in params}
        return _write_with_optimizer(save, iteration, consumed, cfg, weights, moments, step,
                                     _group_settings(values, params), run_dtype, source,
                                     {n: values[prefix + n] for n in buffers if prefix + n in values})


def _one_step(values: Dict[str, Any], params, state_key: str) -> int:
    steps = {float(values[state_key.format(n, "step")]) for n in params if state_key.format(n, "step") in values}
    if len(steps) > 1:
        raise ConversionError(f"the parameters' optimizer steps differ ({sorted(steps)[:4]}); hybrid keeps one step "
                              f"count for all")
    return int(steps.pop()) if steps else 0


def _group_settings(values: Dict[str, Any], params) -> Dict[str, Any]:
    """lr, betas, eps and the weight decay of the parameters that decay (the largest found)."""
    def setting(name: str, key: str):
        return values.get(f"{OPTIMIZER}.param_groups.{name}.{key}")

    first = next(iter(params))
    decay = max((float(setting(n, "weight_decay") or 0.0) for n in params), default=0.0)
    out = {"type": "adamw", "weight_decay": decay}
    for key, default in (("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8)):
        value = setting(first, key)
        out[key] = list(value) if isinstance(value, tuple) else (value if value is not None else default)
    return out


def _write_weights(save, iteration: int, cfg, weights, buffers, dtype: torch.dtype, source: dict) -> Path:
    """A weights-only checkpoint (TP=1, DP=1, no ZeRO), as ``from-hf`` writes one."""
    from hybrid import param_meta
    from hybrid.checkpoint import CheckpointWriter
    from hybrid.convert.hf import gpt_param_layout
    from hybrid.dtypes import HF_DTYPE_NAMES
    from hybrid.layout import ParallelLayout

    layout = gpt_param_layout(cfg)
    writer = CheckpointWriter(save, iteration, ParallelLayout(tp=1, dp=1, precision=PRECISION_OF_DTYPE[dtype]))
    writer.prepare()
    pieces = {n: param_meta.shard(weights[n].to(dtype), meta, 1, 0) for n, (_, meta) in layout.items()}
    index = [{"name": n, "shape": list(p.shape), "dtype": HF_DTYPE_NAMES[dtype], "tp_meta": layout[n][1].to_json()}
             for n, p in pieces.items()]
    record = writer.write_model_shard({**pieces, **buffers}, 0)
    writer.commit([record], model_config=cfg.to_dict(), param_index=index, trainer_state={"imported_from": source})
    return writer.iter_dir


def _write_with_optimizer(save, iteration: int, consumed: int, cfg, weights, moments, step: int, settings: dict,
                          dtype: torch.dtype, source: dict, buffers) -> Path:
    """A TP=1, DP=1, ZeRO-1 checkpoint with the Adam state, saved by a one-process engine over the model: the
    optimizer's own flat layout, filled at the offsets its parameter index records."""
    import hybrid
    from hybrid import param_meta
    from hybrid.topology import Topology
    from model_zoo import GPTModel

    topo = Topology.local()
    model = GPTModel(cfg, topo, device="cpu")
    engine = hybrid.initialize(model, {"precision": PRECISION_OF_DTYPE[dtype], "zero": {"stage": 1},
                                       "optimizer": settings, "micro_batch_size": 1, "global_batch_size": 1,
                                       "steps_per_print": 0}, topology=topo)
    with torch.no_grad():
        for name, value in buffers.items():  # the MoE routers' expert bias: no optimizer state
            engine.module.get_buffer(name).copy_(value)
    sd = engine.optimizer.state_dict()
    metas = {n: param_meta.get_tp_meta(p) for n, p in engine.module.named_parameters()}
    for entry in sd["param_index"]:
        name, group = entry["name"], sd["groups"][entry["group"]]
        for key, full in ((MASTER, weights[name]),) + tuple((m, moments[name][m]) for m in MOMENTS):
            piece = param_meta.shard(full.to(torch.float32), metas[name], 1, 0).reshape(-1)
            for part in entry["parts"]:
                n = part["param_end"] - part["param_start"]
                group[key][part["partition_offset"]: part["partition_offset"] + n] = \
                    piece[part["param_start"]: part["param_end"]]
    sd["step"] = step
    engine.optimizer.load_state_dict(sd)  # writes the masters into the parameters
    return engine.save_checkpoint(save, iteration, consumed_samples=consumed, client_state={"imported_from": source})
