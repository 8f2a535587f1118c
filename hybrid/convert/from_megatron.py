"""``from-megatron``: a Megatron-LM (Megatron-Core GPT) checkpoint as a hybrid checkpoint that training continues.

The two formats Megatron-LM saves (``--ckpt-format``), found through ``DIR/latest_checkpointed_iteration.txt``
or given as one ``DIR/iter_XXXXXXX``:

* **torch** (the legacy format)::

      iter_XXXXXXX/mp_rank_TT/model_optim_rng.pt            TP rank TT (no pipeline parallelism)
      iter_XXXXXXX/mp_rank_TT_PPP/model_optim_rng.pt        TP rank TT of pipeline stage PPP

  each a pickle of ``args`` (an ``argparse.Namespace``), ``iteration``, ``checkpoint_version``, ``model`` (the
  rank's piece of every weight, the stage's layers numbered from 0), ``optimizer`` (the rank's torch optimizer
  state: Adam's ``exp_avg`` / ``exp_avg_sq`` by parameter position, and ``fp32_from_fp16_params`` for a bf16 or
  fp16 run), ``opt_param_scheduler`` and random state; a ``--use-distributed-optimizer`` run keeps its masters
  and moments in ``distrib_optim.pt`` beside it (:func:`_distributed_optimizer`);
* **torch_dist** (``megatron.core.dist_checkpointing``): a ``torch.distributed.checkpoint`` folder whose tensors
  are whole (the TP pieces are chunks of one global tensor; the layers stacked on a leading dim), plus
  ``common.pt`` (``args``, ``iteration``, the optimizer's step and groups). The optimizer's moments are
  ``optimizer.state.exp_avg.<name>`` / ``exp_avg_sq``, the fp32 masters of a bf16 run ``optimizer.state.fp32_param``.

Every pickle is read with :mod:`hybrid.convert.safe_pickle` (``model_optim_rng.pt``, ``common.pt``) or the DCP
metadata reader of :mod:`hybrid.convert.dcp` (``.metadata``): nothing in the files runs.

**Merging the TP pieces** (legacy): column-parallel weights (``linear_qkv``, ``linear_fc1``, the embedding and
the output layer) are the pieces stacked on dim 0, row-parallel ones (``linear_proj``, ``linear_fc2``) on dim 1;
norms and row-parallel biases are the same on every rank. Two fused layouts differ from hybrid's:

* ``linear_qkv`` holds, for each of the ``g`` query groups, that group's ``nh / g`` query heads, then its key
  head, then its value head (``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``, each head ``d`` rows); a TP rank holds ``g / tp``
  whole groups, so the stacked pieces have the same layout. Hybrid's ``qkv_proj`` is every query head, then every
  key head, then every value head (:mod:`model_zoo.qkv_layout`): rows are regrouped;
* SwiGLU's ``linear_fc1`` holds ``[gate; up]`` *per TP rank*, so the stacked legacy pieces are
  ``[gate_0; up_0; gate_1; up_1 ...]``; hybrid's ``in_proj`` (and torch_dist's global tensor) is ``[gate; up]``.

The optimizer's moments and masters get the same moves as their weights (each is an element permutation).

**The optimizer's parameter order** (legacy files): Megatron's torch optimizer numbers the parameters group by
group, and its groups are its default weight-decay rule's: the parameters that decay (``wd_mult`` 1), then the
biases and other 1-D parameters (``wd_mult`` 0), each in the model's order. That order is rebuilt from the
model's own state dict and checked against every saved moment's shape.

The result (weights, fp32 masters, Adam moments, the step) is written in the target layout by the offline
reshard's writer (:func:`hybrid.convert.reshard.write_shares`), with Megatron's iteration, consumed samples
and learning-rate schedule. Megatron's random state is CUDA's and is not carried over: the loading job starts
its generators from its seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from hybrid.convert import safe_pickle
from hybrid.convert.consolidate import MASTER, ZERO_STATE_FORMAT, ConversionError
from hybrid.convert.converted_writer import MOMENTS, MemorySource, target_layout, write_converted
from hybrid.convert.output import ProgressFactory
from hybrid.convert.reshard import DEFAULT_BUCKET_SIZE, OFFLINE_STAGES
from model_zoo.config import GPTConfig

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's name for its "latest"
LEGACY_FILE = "model_optim_rng.pt"
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"  # a legacy --use-distributed-optimizer run's flat state
COMMON_FILE = "common.pt"  # torch_dist: what every rank shares
_RANK_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")

# Megatron-Core's per-layer names (local and TransformerEngine specs) -> hybrid's, below ``layers.i.``
_LAYER_NAMES = {
    "input_layernorm": "input_norm", "self_attention.linear_qkv.layer_norm": "input_norm",
    "self_attention.linear_qkv": "attention.qkv_proj", "self_attention.linear_proj": "attention.out_proj",
    "self_attention.q_layernorm": "attention.q_norm", "self_attention.k_layernorm": "attention.k_norm",
    "pre_mlp_layernorm": "post_attention_norm", "mlp.linear_fc1.layer_norm": "post_attention_norm",
    "mlp.linear_fc1": "mlp.in_proj", "mlp.linear_fc2": "mlp.out_proj",
}
_TOP_NAMES = {"embedding.word_embeddings": "embedding.word_embeddings",
              "embedding.position_embeddings": "embedding.position_embeddings",
              "decoder.final_layernorm": "final_norm", "output_layer": "lm_head"}
# How Megatron splits a layer's tensor over TP (legacy files): the dim its pieces stack on, None: replicated
_COLUMN, _ROW = ("self_attention.linear_qkv", "mlp.linear_fc1"), ("self_attention.linear_proj", "mlp.linear_fc2")


@dataclasses.dataclass
class MegatronState:
    """A Megatron-LM checkpoint, TP-merged, in Megatron's names with global layer numbers (``decoder.layers.i.``).

    ``tensors[key][name]``: ``key`` is ``"weight"`` (as saved), ``"master"`` (the fp32 masters of a bf16 run or of
    the distributed optimizer) or a moment; ``linear_fc1`` is already ``[gate; up]`` (the legacy per-rank interleave undone)."""

    path: Path
    format: str  # "torch" or "torch_dist"
    args: Dict[str, Any]
    iteration: int
    tensors: Dict[str, Dict[str, torch.Tensor]]
    step: Optional[int]  # Adam's step; None: no optimizer state
    groups: List[Mapping[str, Any]]  # the optimizer's torch param groups (settings only)
    scheduler: Mapping[str, Any]

    @property
    def has_optimizer_state(self) -> bool:
        return self.step is not None and all(k in self.tensors for k in MOMENTS)


# ---- finding and reading the files ------------------------------------------------------------------------------
def find_iteration_dir(path, iteration: Optional[int] = None) -> Path:
    """``path`` itself when it is one ``iter_XXXXXXX`` (or ``release``) folder, else the one its
    ``latest_checkpointed_iteration.txt`` (or ``iteration``) names."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"--load {path} is not a directory (expected a Megatron-LM save folder or its "
                              f"iter_XXXXXXX)")
    if _format_of(path) is not None:
        return path
    if iteration is None:
        tracker = path / TRACKER_FILE
        if not tracker.is_file():
            raise ConversionError(f"--load {path} holds neither {TRACKER_FILE} nor Megatron checkpoint files "
                                  f"(mp_rank_XX/{LEGACY_FILE} or torch_dist's .metadata); give the save folder "
                                  f"or one iter_XXXXXXX")
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise ConversionError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
        found = path / (text if text == "release" else f"iter_{int(text):07d}")
    else:
        found = path / f"iter_{iteration:07d}"
    if not found.is_dir() or _format_of(found) is None:
        raise ConversionError(f"{found} is missing or holds no Megatron checkpoint files")
    return found


def _format_of(folder: Path) -> Optional[str]:
    if (folder / ".metadata").is_file() and (folder / COMMON_FILE).is_file():
        return "torch_dist"
    if any(_RANK_DIR.match(p.name) and (p / LEGACY_FILE).is_file() for p in folder.iterdir() if p.is_dir()):
        return "torch"
    return None


def read_megatron(path, *, iteration: Optional[int] = None, optimizer: bool = True) -> MegatronState:
    """The checkpoint at ``path`` (a save folder or one ``iter_XXXXXXX``), merged (module docstring).
    ``optimizer=False`` (``--no-load-optim``) reads the weights alone."""
    folder = find_iteration_dir(path, iteration)
    if _format_of(folder) == "torch_dist":
        return _read_torch_dist(folder, optimizer)
    return _read_legacy(folder, optimizer)


def _plain_args(args: Any, where: Path) -> Dict[str, Any]:
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    raise ConversionError(f"{where} holds no Megatron-LM 'args' (found {type(args).__name__}); from-megatron builds "
                          f"the model from the arguments the run saved")


# ---- legacy (--ckpt-format torch) --------------------------------------------------------------------------------
def _read_legacy(folder: Path, with_optimizer: bool) -> MegatronState:
    ranks: Dict[Tuple[int, int], Path] = {}
    for sub in sorted(folder.iterdir()):
        m = _RANK_DIR.match(sub.name)
        if m and (sub / LEGACY_FILE).is_file():
            if m.group(3) is not None:
                raise ConversionError(f"{sub}: an expert-parallel rank folder; from-megatron converts dense models")
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = sub / LEGACY_FILE
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)
               if (t, p) not in ranks]
    if missing:
        raise ConversionError(f"{folder} lacks {', '.join(missing[:4])}: a TP x PP = {tp} x {pp} checkpoint needs "
                              f"every rank's {LEGACY_FILE}")
    first = safe_pickle.load(ranks[(0, 0)])
    args = _plain_args(first.get("args"), ranks[(0, 0)])
    if any(k.startswith("model") and k != "model" for k in first):
        raise ConversionError(f"{ranks[(0, 0)]} holds several model chunks (virtual pipeline stages, "
                              f"--num-layers-per-virtual-pipeline-stage); from-megatron reads one chunk per stage")
    weights: Dict[str, torch.Tensor] = {}
    states: Dict[str, Dict[str, torch.Tensor]] = {}
    step, groups = None, []
    offset = 0
    for p in range(pp):
        per_rank = [first if (t, p) == (0, 0) else safe_pickle.load(ranks[(t, p)]) for t in range(tp)]
        models = [_model_of(sd, ranks[(t, p)]) for t, sd in enumerate(per_rank)]
        names = _parameter_names(models[0])
        layers = 1 + max((int(m.group(1)) for n in names for m in [_LAYER.match(n)] if m), default=-1)
        stage_weights = _merge_tp(models, names, args, ranks[(0, p)])
        opt = [sd.get("optimizer") for sd in per_rank] if with_optimizer else [None]
        if all(o is not None for o in opt):
            by_rank = [_distributed_optimizer(o, models[t], names, ranks[(t, p)].parent / DISTRIBUTED_OPTIMIZER_FILE)
                       if (ranks[(t, p)].parent / DISTRIBUTED_OPTIMIZER_FILE).exists()
                       else _legacy_optimizer(o, models[t], names, ranks[(t, p)]) for t, o in enumerate(opt)]
            stage_step = {s for s, _, _ in by_rank}
            if step is not None:
                stage_step.add(step)
            if len(stage_step) != 1:
                raise ConversionError(f"{folder}: the ranks' Adam steps differ ({sorted(stage_step)}); hybrid keeps "
                                      f"one step count")
            step, groups = stage_step.pop(), by_rank[0][2]
            for key in by_rank[0][1]:
                merged = _merge_tp([r[1][key] for r in by_rank], [n for n in names if n in by_rank[0][1][key]],
                                   args, ranks[(0, p)])
                states.setdefault(key, {}).update(_renumber(merged, offset))
        weights.update(_renumber(stage_weights, offset))
        offset += layers
    tensors = {"weight": _drop_tied_copy(weights, args), **states}
    for key in states:
        tensors[key] = {n: t for n, t in states[key].items() if n in tensors["weight"]}
    return MegatronState(folder, "torch", args, int(first.get("iteration", args.get("iteration", 0)) or 0), tensors,
                         step if states else None, groups, first.get("opt_param_scheduler") or {})


def _model_of(sd: Any, path: Path) -> Dict[str, torch.Tensor]:
    model = sd.get("model") if isinstance(sd, dict) else None
    if not isinstance(model, dict):
        found = sorted(sd)[:6] if isinstance(sd, dict) else type(sd).__name__
        raise ConversionError(f"{path} holds no 'model' state dict (found {found})")
    if any(k.startswith("language_model.") for k in model):
        raise ConversionError(f"{path} is a pre-Megatron-Core (legacy 'language_model.*') model; from-megatron "
                              f"reads Megatron-Core GPT models (--use-mcore-models)")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")}


def _parameter_names(model: Mapping[str, torch.Tensor]) -> List[str]:
    """The state dict's parameters in its (the model's registration) order; rotary frequencies are buffers."""
    return [n for n in model if not n.endswith("inv_freq")]


def _tp_dim(name: str) -> Optional[int]:
    """The dim Megatron stacks ``name``'s TP pieces on (None: every rank holds all of it)."""
    if name.startswith(("embedding.word_embeddings.", "output_layer.")):
        return 0
    inner = _LAYER.match(name)
    if inner is None:
        return None
    rest = inner.group(2)
    if rest.endswith(".layer_norm_weight") or rest.endswith(".layer_norm_bias"):
        return None
    if rest.startswith(_COLUMN):
        return 0
    if rest.startswith(_ROW):
        return 1 if rest.endswith(".weight") else None
    return None


def _merge_tp(pieces: List[Mapping[str, torch.Tensor]], names: List[str], args: Mapping[str, Any],
              where: Path) -> Dict[str, torch.Tensor]:
    """Each of ``names`` whole: the TP pieces stacked on their dim, SwiGLU's per-rank ``[gate; up]`` undone."""
    out = {}
    for name in names:
        dim = _tp_dim(name)
        parts = [p[name] for p in pieces]
        if dim is None or len(parts) == 1:
            out[name] = parts[0]
            continue
        if args.get("swiglu") and ".mlp.linear_fc1." in name:  # its weight and bias (the norm is replicated)
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out


def _renumber(tensors: Mapping[str, torch.Tensor], offset: int) -> Dict[str, torch.Tensor]:
    """A pipeline stage's names with global layer numbers (its layers follow the earlier stages')."""
    out = {}
    for name, t in tensors.items():
        m = _LAYER.match(name)
        out[f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name] = t
    return out


def _drop_tied_copy(weights: Dict[str, torch.Tensor], args: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """A tied model's last stage keeps a copy of the embedding as ``output_layer.weight``: the first stage's wins."""
    if not args.get("untie_embeddings_and_output_weights") and "embedding.word_embeddings.weight" in weights:
        weights.pop("output_layer.weight", None)
    return weights


def _legacy_optimizer(opt: Any, model: Mapping[str, torch.Tensor], names: List[str], where: Path):
    """``(step, {key: {name: local tensor}}, groups)`` of one rank's ``optimizer`` entry."""
    if isinstance(opt, list):  # a ChainedOptimizer of one (dense) optimizer
        if len(opt) != 1:
            raise ConversionError(f"{where}: {len(opt)} chained optimizers (expert parameters?); from-megatron "
                                  f"converts one")
        opt = opt[0]
    masters = opt.get("fp32_from_fp16_params") if "optimizer" in opt else None
    inner = opt["optimizer"] if "optimizer" in opt else opt
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        raise ConversionError(f"{where}: its 'optimizer' entry is not a torch optimizer state (keys "
                              f"{sorted(opt)[:6]}), and no {DISTRIBUTED_OPTIMIZER_FILE} (a --use-distributed-optimizer "
                              f"run's state) is beside it; convert the weights with --no-load-optim")
    groups = inner["param_groups"]
    order = _group_order(groups, model, names, where)
    state = inner["state"]
    out: Dict[str, Dict[str, torch.Tensor]] = {k: {} for k in MOMENTS}
    steps = set()
    for index, name in order.items():
        s = state.get(index)
        if not s or any(k not in s for k in MOMENTS):
            raise ConversionError(f"{where}: the optimizer holds no Adam moments for parameter {index} ({name}); "
                                  f"from-megatron continues Adam runs (else convert with --no-load-optim)")
        for k in MOMENTS:
            if tuple(s[k].shape) != tuple(model[name].shape):
                raise ConversionError(f"{where}: optimizer parameter {index} has shape {list(s[k].shape)}, but the "
                                      f"model's parameter {name} in that position {list(model[name].shape)}: the "
                                      f"groups do not follow Megatron's default weight-decay rule")
            out[k][name] = s[k].float()
        steps.add(int(s["step"]) if "step" in s else None)
    if masters is not None:
        flat = [t for group in masters for t in group]
        out[MASTER] = {name: flat[i].float() for i, name in enumerate(order.values())}
    if len(steps) != 1 or None in steps:
        raise ConversionError(f"{where}: the parameters' Adam steps differ or are missing ({sorted(map(str, steps))})")
    return steps.pop(), out, [{k: v for k, v in g.items() if k != "params"} for g in groups]


# megatron-core's grad buffer (distributed.param_and_grad_buffer) starts every parameter at a multiple of this
_PARAM_ALIGNMENT = 64


def _distributed_optimizer(opt: Any, model: Mapping[str, torch.Tensor], names: List[str], path: Path):
    """``(step, {key: {name: local tensor}}, groups)`` of one (TP, PP) rank's legacy ``distrib_optim.pt``: the
    distributed optimizer's fp32 masters and moments gathered over DP into one flat buffer.

    The buffer holds the rank's parameters in reverse registration order (the order of backprop), each
    starting at a multiple of 64 elements; ``buckets_coalesced`` files leave the buckets' end padding out. Bucket
    boundaries are not recorded, so each parameter's place is checked: its master must round to its weight.
    """
    state = safe_pickle.load(path)
    buffers = [v for k, v in state.items() if isinstance(k, int)] if isinstance(state, dict) else []
    if not state.get("buckets_coalesced") or len(buffers) != 1 or len(buffers[0]) != 1:
        raise ConversionError(f"{path}: not one coalesced grad buffer of one dtype (found {len(buffers)} buffers); "
                              f"from-megatron reads the dense model's; convert with --no-load-optim")
    flat = next(iter(buffers[0].values()))
    out: Dict[str, Dict[str, torch.Tensor]] = {MASTER: {}, **{k: {} for k in MOMENTS}}
    offset = 0
    for name in reversed(names):
        offset = -(-offset // _PARAM_ALIGNMENT) * _PARAM_ALIGNMENT
        weight = model[name]
        for key, saved in ((MASTER, "param"),) + tuple((k, k) for k in MOMENTS):
            out[key][name] = flat[saved][offset: offset + weight.numel()].view(weight.shape)
        if out[MASTER][name].numel() != weight.numel() or \
                not torch.equal(out[MASTER][name].to(weight.dtype), weight):
            raise ConversionError(f"{path}: the master of {name} is not where megatron-core's buffer layout puts it "
                                  f"(element {offset}: several buckets, --ddp-bucket-size?); convert with "
                                  f"--no-load-optim")
        offset += weight.numel()
    if offset != int(flat["numel_unpadded"]):
        raise ConversionError(f"{path} holds {flat['numel_unpadded']} elements, the parameters {offset}; convert "
                              f"with --no-load-optim")
    inner = opt.get("optimizer") or {}
    groups = inner.get("param_groups") or []
    steps = {float(g["step"]) for g in groups if "step" in g}
    if len(steps) != 1:
        raise ConversionError(f"{path.parent / LEGACY_FILE}: the distributed optimizer's step is "
                              f"{sorted(steps) or 'missing'}")
    return int(steps.pop()), out, [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _group_order(groups, model, names, where) -> Dict[int, str]:
    """``{optimizer index: parameter name}`` from Megatron's default grouping (module docstring)."""
    decays = [n for n in names if not (n.endswith(".bias") or model[n].dim() == 1)]
    others = [n for n in names if n not in set(decays)]
    out: Dict[int, str] = {}
    pools = {1.0: list(decays), 0.0: list(others)}
    for g in groups:
        pool = pools.get(float(g.get("wd_mult", 1.0)))
        if pool is None or len(g["params"]) > len(pool):
            raise ConversionError(f"{where}: an optimizer group of {len(g['params'])} parameters with wd_mult "
                                  f"{g.get('wd_mult')} does not match Megatron's default weight-decay groups; "
                                  f"convert with --no-load-optim")
        for index in g["params"]:
            out[int(index)] = pool.pop(0)
    if any(pools.values()):
        left = [n for pool in pools.values() for n in pool]
        raise ConversionError(f"{where}: the optimizer holds no state for {', '.join(left[:4])}; convert with "
                              f"--no-load-optim")
    return out


# ---- torch_dist ----------------------------------------------------------------------------------------------
def _read_torch_dist(folder: Path, with_optimizer: bool) -> MegatronState:
    from hybrid.convert.dcp import load_dcp, read_metadata

    common = safe_pickle.load(folder / COMMON_FILE)
    args = _plain_args(common.get("args"), folder / COMMON_FILE)
    metadata = read_metadata(folder)
    tensor_keys = [k for k, md in metadata.state_dict_metadata.items() if hasattr(md, "properties")]
    model_keys = [k for k in tensor_keys if not k.startswith("optimizer.")]
    values = load_dcp(folder, [k for k in tensor_keys if with_optimizer or not k.startswith("optimizer.")])
    layers = int(args["num_layers"])
    tensors: Dict[str, Dict[str, torch.Tensor]] = {"weight": _unstack({k: values[k] for k in model_keys}, layers)}
    # the fp32 masters: a bf16 run's plain optimizer (fp32_param), the distributed optimizer's (param)
    prefixes = {"exp_avg": ("optimizer.state.exp_avg.",), "exp_avg_sq": ("optimizer.state.exp_avg_sq.",),
                MASTER: ("optimizer.state.fp32_param.", "optimizer.state.param.")}
    for key, starts in prefixes.items():
        found = {k[len(p):]: values[k] for p in starts for k in values if k.startswith(p)}
        if found:
            tensors[key] = _unstack(found, layers)
    opt = common.get("optimizer") or {}
    sharding = opt.get("param_state_sharding_type")
    if with_optimizer and sharding not in (None, "fully_reshardable"):
        raise ConversionError(f"{folder}: the distributed optimizer's state was saved as {sharding!r} (flat buffers, "
                              f"laid out by megatron-core's internals); from-megatron reads it per parameter: save "
                              f"with --dist-ckpt-optim-fully-reshardable, or convert the weights with --no-load-optim")
    inner = opt.get("optimizer") or opt  # the bf16 and the distributed optimizers nest torch's state
    groups = inner.get("param_groups") or []
    steps = {float(g["step"]) for g in groups if "step" in g}  # the distributed optimizer's step is in its groups
    if (inner.get("state") or {}).get("common_step") is not None:
        steps.add(float(inner["state"]["common_step"]))
    has_state = with_optimizer and all(k in tensors for k in MOMENTS)
    if has_state and len(steps) != 1:
        raise ConversionError(f"{folder / COMMON_FILE}: the optimizer's step is {sorted(steps) or 'missing'}; hybrid "
                              f"keeps one step count")
    return MegatronState(folder, "torch_dist", args, int(common.get("iteration", 0) or 0), tensors,
                         int(steps.pop()) if has_state else None, groups, common.get("opt_param_scheduler") or {})


def _unstack(values: Mapping[str, torch.Tensor], layers: int) -> Dict[str, torch.Tensor]:
    """``decoder.layers.<rest>`` ``[L, ...]`` -> ``decoder.layers.i.<rest>`` for each layer ``i``."""
    out = {}
    for key, t in values.items():
        if key.startswith("decoder.layers.") and not _LAYER.match(key):
            if t.shape[0] != layers:
                raise ConversionError(f"{key} stacks {t.shape[0]} layers, the run's args say num_layers={layers}")
            for i in range(layers):
                out[f"decoder.layers.{i}.{key[len('decoder.layers.'):]}"] = t[i].clone()
        else:
            out[key] = t
    return out


# ---- Megatron's model -> hybrid's -----------------------------------------------------------------------------
def config_from_args(args: Mapping[str, Any], where) -> GPTConfig:
    """The :class:`GPTConfig` of the model Megatron-LM's saved ``args`` describe; what hybrid cannot compute
    the same way is refused, naming Megatron's flag."""
    def refuse(flag: str, why: str) -> ConversionError:
        return ConversionError(f"{where}: the run used {flag}, which hybrid does not compute the same way ({why})")

    if args.get("num_experts"):
        raise refuse("--num-experts", "from-megatron converts dense GPT models")
    if float(args.get("rotary_percent", 1.0) or 1.0) != 1.0:
        raise refuse(f"--rotary-percent {args['rotary_percent']}", "hybrid rotates every channel of a head")
    if args.get("rotary_interleaved"):
        raise refuse("--rotary-interleaved", "hybrid rotates halves, Megatron's default")
    if args.get("use_rope_scaling") or args.get("rope_scaling_factor", 1.0) not in (None, 1.0):
        raise refuse("--use-rope-scaling", "convert the weights and give hybrid's --rope-scaling settings yourself")
    if args.get("squared_relu"):
        raise refuse("--squared-relu", "hybrid's MLPs are GELU (tanh) and SwiGLU")
    mlp = {True: "swiglu", False: "gelu"}[bool(args.get("swiglu"))]  # Megatron's --swiglu, else its GELU
    if mlp == "gelu" and not args.get("openai_gelu"):
        raise refuse("GELU without --openai-gelu (the exact erf GELU)", "hybrid's GELU MLP is the tanh approximation, "
                     "Megatron's --openai-gelu")
    position = args.get("position_embedding_type", "learned_absolute")
    positions = {"learned_absolute": "learned", "rope": "rope"}
    if position not in positions:
        raise refuse(f"--position-embedding-type {position}", "hybrid has learned_absolute and rope")
    norms = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
    if args.get("normalization", "LayerNorm") not in norms:
        raise refuse(f"--normalization {args.get('normalization')}", "hybrid has LayerNorm and RMSNorm")
    heads, hidden = int(args["num_attention_heads"]), int(args["hidden_size"])
    kv = args.get("kv_channels")
    bias = bool(args.get("add_bias_linear", True))
    cfg = GPTConfig(
        vocab_size=int(args.get("padded_vocab_size") or args["vocab_size"]), hidden_size=hidden,
        num_layers=int(args["num_layers"]), num_heads=heads,
        num_query_groups=int(args["num_query_groups"]) if args.get("group_query_attention") else None,
        kv_channels=None if kv in (None, hidden // heads) else int(kv),
        ffn_hidden_size=int(args["ffn_hidden_size"]) if args.get("ffn_hidden_size") else None,
        seq_length=int(args.get("seq_length") or args.get("max_position_embeddings")),
        max_position_embeddings=int(args["max_position_embeddings"]) if args.get("max_position_embeddings") else None,
        position=positions[position], norm=norms[args.get("normalization", "LayerNorm")],
        apply_layernorm_1p=bool(args.get("apply_layernorm_1p")),  # every norm's weight stored as gamma - 1, as here
        norm_eps=float(args.get("norm_epsilon", 1e-5)), rope_theta=float(args.get("rotary_base", 10000) or 10000),
        mlp=mlp, bias=bias,
        qkv_bias=True if args.get("add_qkv_bias") and not bias else None, qk_norm=bool(args.get("qk_layernorm")),
        tie_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        hidden_dropout=float(args.get("hidden_dropout", 0.0)),
        attention_dropout=float(args.get("attention_dropout", 0.0)),
        init_std=float(args.get("init_method_std", 0.02)))
    try:
        cfg.validate(1)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where}: the saved args describe a model hybrid cannot build: {e}") from None
    return cfg


def hybrid_name(name: str) -> Optional[str]:
    """Hybrid's name for Megatron's parameter ``name`` (None: not a parameter hybrid's GPT has)."""
    m = _LAYER.match(name)
    if m:
        module, _, leaf = m.group(2).rpartition(".")
        if leaf.startswith("layer_norm_"):  # the TE spec's fused norms: linear_qkv.layer_norm_weight
            module, leaf = f"{module}.layer_norm", leaf[len("layer_norm_"):]
        mapped = _LAYER_NAMES.get(module)
        return f"layers.{m.group(1)}.{mapped}.{leaf}" if mapped else None
    module, _, leaf = name.rpartition(".")
    mapped = _TOP_NAMES.get(module)
    return f"{mapped}.{leaf}" if mapped else None


def to_hybrid(tensors: Mapping[str, torch.Tensor], cfg: GPTConfig, where) -> Dict[str, torch.Tensor]:
    """Megatron's whole tensors (global layer numbers, ``linear_fc1`` as ``[gate; up]``) under hybrid's names and
    in its layouts: ``linear_qkv``'s per-group rows regrouped to ``[q; k; v]``."""
    out = {}
    unknown = []
    for name, t in tensors.items():
        target = hybrid_name(name)
        if target is None:
            unknown.append(name)
            continue
        out[target] = _qkv_regrouped(t, cfg) if ".self_attention.linear_qkv." in name and \
            not name.rpartition(".")[2].startswith("layer_norm") else t
    if unknown:
        raise ConversionError(f"{where} holds tensor(s) hybrid's GPT has no place for: {', '.join(unknown[:5])}")
    return out


def _qkv_regrouped(t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Rows ``[q_0 k_0 v_0 q_1 k_1 v_1 ...]`` (per query group) -> ``[q; k; v]``."""
    groups, d = cfg.query_groups, cfg.head_dim
    per = cfg.num_heads // groups
    grouped = t.reshape(groups, (per + 2) * d, *t.shape[1:])
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)], dim=0).contiguous()


# ---- writing the hybrid checkpoint ----------------------------------------------------------------------------
def _precision(args: Mapping[str, Any], where) -> str:
    if args.get("fp16"):
        raise ConversionError(f"{where} is from an fp16 run (--fp16): from-megatron converts fp32 and bf16 runs (the "
                              f"fp16 loss scaler's state has no counterpart yet)")
    return "bf16" if args.get("bf16") else "fp32"


def _optimizer_settings(state: MegatronState) -> Dict[str, Any]:
    """Hybrid's optimizer header entry from Megatron's torch param groups (or, without them, its args)."""
    args, groups = state.args, state.groups
    kind = str(args.get("optimizer", "adam")).lower()
    if kind != "adam":
        raise ConversionError(f"{state.path}: the run used --optimizer {kind}; from-megatron continues Adam runs "
                              f"(convert the weights alone with --no-load-optim)")
    first = groups[0] if groups else {}
    # Megatron's "adam" is torch's AdamW (decoupled decay) unless --no-decoupled-weight-decay... as recorded
    decoupled = bool(first.get("decoupled_weight_decay", args.get("decoupled_weight_decay", True)))
    decays = sorted({float(g.get("weight_decay", 0.0)) * float(g.get("wd_mult", 1.0)) for g in groups} - {0.0})
    if len(decays) > 1:
        raise ConversionError(f"{state.path}: the parameter groups decay at {decays}; hybrid applies one weight decay "
                              f"(to every parameter but the 1-D ones)")
    betas = first.get("betas", (args.get("adam_beta1", 0.9), args.get("adam_beta2", 0.999)))
    return {"type": "adamw" if decoupled else "adam", "lr": float(first.get("lr", args.get("lr") or 0.0)),
            "betas": [float(b) for b in betas], "eps": float(first.get("eps", args.get("adam_eps", 1e-8))),
            "weight_decay": decays[0] if decays else float(args.get("weight_decay", 0.0) if not groups else 0.0),
            "momentum": 0.0}


# Megatron's --lr-decay-style -> hybrid's decay_style (the same names where both have one)
_DECAY_STYLES = {"constant": "constant", "linear": "linear", "cosine": "cosine",
                 "inverse-square-root": "inverse-square-root", "WSD": "wsd"}


def _lr_schedule(state: MegatronState) -> Dict[str, Any]:
    """The engine's schedule position and settings: Megatron's scheduler counts samples (``num_steps`` grows by
    the global batch each iteration)."""
    sched = state.scheduler
    style = _DECAY_STYLES.get(str(sched.get("lr_decay_style", "")))
    if not sched or style is None:
        return {"iteration": state.iteration}
    if style == "constant" and not sched.get("lr_warmup_steps"):
        # a constant rate counts nothing: recorded in steps, as a job configured in iterations counts
        return {"iteration": state.iteration, "settings": {"max_lr": float(sched["max_lr"]),
                                                           "decay_style": "constant", "warmup_iters": 0,
                                                           "unit": "steps"}}
    settings = {"max_lr": float(sched["max_lr"]), "min_lr": float(sched.get("min_lr", 0.0)), "decay_style": style,
                "warmup_iters": int(sched.get("lr_warmup_steps", 0)), "unit": "samples",
                "decay_iters": int(sched["lr_decay_steps"]) if style != "constant" else None}
    return {"iteration": int(sched.get("num_steps", 0)), "settings": settings}


def convert_from_megatron(load, save, *, tp: int = 1, dp: int = 1, target_zero_stage: int = 1, pp: int = 1,
                          bucket_size: int = DEFAULT_BUCKET_SIZE, iteration: Optional[int] = None,
                          load_optimizer: bool = True, progress: Optional[ProgressFactory] = None,
                          force: bool = False) -> Path:
    """Write the Megatron-LM checkpoint at ``load`` as a hybrid checkpoint in ``save`` for a job of ``tp`` x ``dp``
    x ``pp`` ranks at ZeRO ``target_zero_stage`` with ``bucket_size`` (its ``--zero-bucket-size``).

    ``iteration`` picks an ``iter_XXXXXXX`` of a save folder (default: its tracker file's); ``load_optimizer=False``
    (``--no-load-optim``) writes the weights alone (train from them with ``--finetune``). Returns the iteration
    directory (``save/latest`` points at it).
    """
    # in-memory tensors under hybrid's names, written by the offline writer as from-deepspeed writes them
    from hybrid.convert.hf import gpt_buffer_layout, gpt_param_layout
    from hybrid.dtypes import DTYPES

    target = target_layout(tp, dp, pp, target_zero_stage, bucket_size)
    if target.zero_stage not in OFFLINE_STAGES:
        raise ConversionError(f"--target-zero-stage {int(target.zero_stage)}: write stage "
                              f"{', '.join(str(int(s)) for s in OFFLINE_STAGES)} here; a stage-3 job loads it and "
                              f"reshards on load (its partition follows the model's modules)")
    state = read_megatron(load, iteration=iteration, optimizer=load_optimizer)
    if load_optimizer and not state.has_optimizer_state:
        raise ConversionError(f"{state.path} holds no Adam state (saved with --no-save-optim?); convert its weights "
                              f"with --no-load-optim and train from them with --finetune")
    cfg = config_from_args(state.args, state.path)
    try:
        cfg.validate(tp)
    except ValueError as e:
        raise ConversionError(f"the model in {state.path} cannot be split over --tp {tp}: {e}") from None
    precision = _precision(state.args, state.path)
    layout = gpt_param_layout(cfg)
    if gpt_buffer_layout(cfg):
        raise ConversionError(f"internal: hybrid's model for {state.path} has buffers from-megatron does not fill")
    weights = to_hybrid(state.tensors["weight"], cfg, state.path)
    _check_same(weights, layout, state.path)
    with_optimizer = load_optimizer
    # the model files hold the masters rounded to the run's precision (a bf16 run's fp32 masters, when saved)
    full = {MASTER: {n: t.float() for n, t in to_hybrid(state.tensors.get(MASTER) or state.tensors["weight"], cfg,
                                                          state.path).items()}}
    header = {"format": ZERO_STATE_FORMAT, "step": 0, "global_steps": state.iteration, "skipped_steps": 0,
              "loss_scaler": None}
    if with_optimizer:
        for key in MOMENTS:
            full[key] = to_hybrid(state.tensors[key], cfg, state.path)
            _check_same(full[key], layout, state.path, f"optimizer state {key}")
        header.update(optimizer=_optimizer_settings(state), step=int(state.step))
    consumed = int(state.args.get("consumed_train_samples") or 0)
    trainer_state = {"engine": {"global_step": state.iteration, "consumed_samples": consumed,
                                "lr_schedule": _lr_schedule(state)},
                     "client": {},
                     "imported_from": {"format": f"megatron-lm {state.format}", "path": str(state.path.resolve()),
                                       "optimizer": with_optimizer}}
    src = MemorySource(full, layout, DTYPES[precision], {}, header, cfg.to_dict(), state.path)
    return write_converted(src, save, target.replace(precision=precision), iteration=state.iteration,
                           consumed_samples=consumed, trainer_state=trainer_state, bucket_size=bucket_size,
                           description=f"from-megatron {state.format}", with_optimizer=with_optimizer,
                           progress=progress, force=force)


def _check_same(tensors: Mapping[str, torch.Tensor], layout: Mapping[str, Tuple[Tuple[int, ...], Any]], where,
                what: str = "weights") -> None:
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    if missing or extra:
        raise ConversionError(f"{where}: its {what} do not make the model its args describe: missing {missing[:4]}, "
                              f"unexpected {extra[:4]}")
    for name, (shape, _) in layout.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ConversionError(f"{where}: {name} ({what}) has shape {list(tensors[name].shape)}, the model its args "
                                  f"describe {list(shape)}")
