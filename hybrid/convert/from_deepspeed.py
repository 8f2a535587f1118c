"""``from-deepspeed``: a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3) as a hybrid checkpoint that training continues.

What DeepSpeed saves (``engine.save_checkpoint(DIR)``; ``DIR/latest`` names the tag)::

    DIR/global_stepN/mp_rank_00_model_states.pt                   stages 1-2: module, param_shapes, counters
    DIR/global_stepN/zero_pp_rank_R_mp_rank_00_model_states.pt    stage 3: the same, one per DP rank
    DIR/global_stepN/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   DP rank R's flat fp32 partitions

Every file is read with :mod:`hybrid.convert.safe_pickle` (nothing in it runs).
How the flat partitions are laid out is DeepSpeed's own ``zero_to_fp32.py``'s
reconstruction (read for the facts; the code here is hybrid's):

* **stages 1 and 2**: per parameter group ``g``, the group's flat vector is
  the concatenation over DP ranks of ``single_partition_of_fp32_groups[g]``;
  the group's parameters (``param_shapes[g]``, in order) lie in it one after
  the other (plus ``param_alignment_paddings[g][i]`` elements after parameter
  ``i`` where a release records them); the tail is padding. The Adam moments
  (``base_optimizer_state["state"][g]["exp_avg"]`` / ``["exp_avg_sq"]``) are
  flat partitions of the same layout;
* **stage 3**: each parameter is split on its own: ``ceil(numel / world)``
  elements on every rank (the last rank padded), placed one after the other in
  each rank's groups (``fp32_flat_groups``, concatenated in group order); the
  full parameter is the ranks' slices concatenated, cut to ``numel``. The
  moments (``optimizer_state_dict["state"][g]``) follow the same layout.

The fp32 masters and both moments are then renamed and rearranged to hybrid's
parameters with a name map, the same element permutation applied to all three:
Megatron-DeepSpeed's GPT (:mod:`hybrid.convert.megatron_deepspeed_names`) when
the checkpoint's names are its ``language_model.encoder.layers.*``, the model's
shape from the ``args`` it saved (or ``--model-config``); otherwise the Hugging
Face maps (:mod:`hybrid.convert.hf_gpt2`, :mod:`hybrid.convert.hf_llama`: the
model's ``config.json`` says which). They are written in the target
layout by the offline reshard's writer (:func:`hybrid.convert.reshard.write_shares`):
model files, ZeRO partitions planned by the optimizer's own rules, and
``metadata.json`` with the iteration (DeepSpeed's ``global_steps``), consumed
samples (``global_samples``), Adam's step and the learning-rate schedule's
position. DeepSpeed saves no random state, so the checkpoint has no rank files:
the loading job starts its generators from its seed (``--no-load-rng``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from hybrid.convert import megatron_deepspeed_names, safe_pickle
from hybrid.convert.consolidate import MASTER, ZERO_STATE_FORMAT, ConversionError
from hybrid.convert.converted_writer import MOMENTS, MemorySource, target_layout, write_converted
from hybrid.convert.hf import _fresh_buffers, _hybrid_full, gpt_param_layout, map_for_hf
from hybrid.convert.hf_io import read_json
from hybrid.convert.output import ProgressFactory
from hybrid.convert.reshard import DEFAULT_BUCKET_SIZE
from hybrid.dtypes import DTYPES
from hybrid.layout import stage_traits

_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)")


@dataclasses.dataclass
class DeepSpeedState:
    """A DeepSpeed ZeRO checkpoint reassembled: every trainable parameter whole, under DeepSpeed's names."""

    path: Path  # the global_stepN folder
    stage: int
    world: int  # DP ranks that saved it
    precision: str  # fp32, bf16 or fp16 (the run's ds_config)
    state: Dict[str, Dict[str, torch.Tensor]]  # "master" / "exp_avg" / "exp_avg_sq" -> name -> fp32 tensor
    shared: Dict[str, str]  # tied names -> the name holding the tensor (lm_head.weight -> transformer.wte.weight)
    step: int  # Adam's step (its bias correction)
    global_steps: int
    global_samples: int
    skipped_steps: int
    optimizer: Dict[str, Any]  # hybrid's optimizer header entry: type, lr, betas, eps, weight_decay, momentum
    scheduled: bool  # whether the run had a DeepSpeed learning-rate scheduler
    saved_args: Dict[str, Any]  # the client state's "args" (Megatron-DeepSpeed's arguments); {} when none


# ---- reading ---------------------------------------------------------------------------------------------
def find_tag_dir(path, tag: Optional[str] = None) -> Path:
    """The ``global_stepN`` folder of a DeepSpeed save: ``path/tag``, ``path/<latest>``, or ``path`` itself."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"--input {path} is not a directory (expected a DeepSpeed checkpoint folder)")
    if tag is not None:
        found = path / tag
    elif any(path.glob("*model_states.pt")):
        return path
    elif (path / "latest").is_file():
        found = path / (path / "latest").read_text().strip()
    else:
        raise ConversionError(f"--input {path} holds neither a 'latest' file nor *_model_states.pt files; pass the "
                              f"folder DeepSpeed saved into (or its global_stepN folder), or --tag")
    if not found.is_dir():
        raise ConversionError(f"{found} does not exist (named by {'--tag' if tag else path / 'latest'})")
    return found


def _rank_of(file: Path) -> Tuple[int, int]:
    m = _RANK.search(file.name)
    if m is None:
        raise ConversionError(f"{file}: not a DeepSpeed ZeRO file name (zero_pp_rank_R_mp_rank_M_...)")
    return int(m.group(1)), int(m.group(2))


def _field(sd: Any, key: str, file: Path) -> Any:
    if not isinstance(sd, Mapping) or key not in sd:
        raise ConversionError(f"{file} holds no {key!r}: not a DeepSpeed ZeRO checkpoint file of the layout "
                              f"from-deepspeed reads (deepspeed 0.19's)")
    return sd[key]


def read_deepspeed(path, tag: Optional[str] = None) -> DeepSpeedState:
    """Read and reassemble the DeepSpeed ZeRO checkpoint at ``path`` (see the module docstring)."""
    folder = find_tag_dir(path, tag)
    if any(folder.glob("layer_*")):
        raise ConversionError(f"{folder} is a pipeline-parallel DeepSpeed checkpoint (layer_* files); from-deepspeed "
                              f"reads ZeRO checkpoints of models wrapped by deepspeed.initialize without pipeline "
                              f"stages")
    optim_files = sorted(folder.glob("*_optim_states.pt"), key=_rank_of)
    if not optim_files:
        raise ConversionError(f"{folder} holds no *_optim_states.pt files: it was saved without ZeRO optimizer state, "
                              f"which from-deepspeed needs to continue training")
    if any(_rank_of(f)[1] != 0 for f in optim_files):
        raise ConversionError(f"{folder} was saved with tensor (model) parallelism (mp_rank_01 files): from-deepspeed "
                              f"reads checkpoints of one model-parallel rank")
    model_files = sorted(folder.glob("*model_states.pt"))
    model = safe_pickle.load(model_files[0])
    optim = [_field(safe_pickle.load(f), "optimizer_state_dict", f) for f in optim_files]
    first = optim[0]
    stage = _stage(first, optim_files[0])
    counts = first.get("partition_count")
    world = max(counts) if isinstance(counts, list) else int(counts)
    if world != len(optim_files):
        raise ConversionError(f"{folder} holds {len(optim_files)} *_optim_states.pt files but was saved by {world} "
                              f"data-parallel ranks; a rank's file is missing (or an older save was overwritten)")
    if model.get("frozen_param_shapes"):
        frozen = list(model["frozen_param_shapes"])
        raise ConversionError(f"{model_files[0]} holds frozen parameters ({', '.join(frozen[:3])}); hybrid trains "
                              f"every parameter, so from-deepspeed converts models without frozen ones")
    shapes = [dict(group) for group in _field(model, "param_shapes", model_files[0])]
    if not stage_traits(stage).parameters:  # stages 1-2: whole fp32 partitions; stage 3 its own layout
        flats = [_field(sd, "single_partition_of_fp32_groups", f) for sd, f in zip(optim, optim_files)]
        moments = [_field(_field(sd, "base_optimizer_state", f), "state", f) for sd, f in zip(optim, optim_files)]
        merge = lambda per_rank, what: _merge_stage12(per_rank, shapes, first.get("param_alignment_paddings"),
                                                      folder, what)  # noqa: E731
        groups = first["base_optimizer_state"]["param_groups"]
    else:
        flats = [_field(sd, "fp32_flat_groups", f) for sd, f in zip(optim, optim_files)]
        moments = [_field(_field(sd, "optimizer_state_dict", f), "state", f) for sd, f in zip(optim, optim_files)]
        merge = lambda per_rank, what: _merge_stage3(per_rank, shapes, folder, what)  # noqa: E731
        groups = first["optimizer_state_dict"]["param_groups"]
    state = {MASTER: merge(flats, "the fp32 master weights")}
    for key in MOMENTS:
        try:
            per_rank = [[s[g][key] for g in range(len(shapes))] for s in moments]
        except (KeyError, IndexError, TypeError):
            raise ConversionError(f"{optim_files[0]} holds no {key} for every parameter group: from-deepspeed "
                                  f"continues Adam / AdamW runs") from None
        state[key] = merge(per_rank, key)
    steps = {int(s[g]["step"]) for s in moments for g in range(len(shapes)) if "step" in s[g]}
    if len(steps) != 1:
        raise ConversionError(f"{folder}: the parameter groups record Adam steps {sorted(steps)}, expected one")
    return DeepSpeedState(
        path=folder, stage=stage, world=world, precision=_precision(model.get("ds_config") or {}, model_files[0]),
        state=state, shared=dict(model.get("shared_params") or {}), step=steps.pop(),
        global_steps=int(_field(model, "global_steps", model_files[0])), global_samples=int(model.get("global_samples") or 0),
        skipped_steps=int(model.get("skipped_steps") or 0),
        optimizer=_optimizer_settings(groups, model.get("ds_config") or {}, optim_files[0]),
        scheduled=model.get("lr_scheduler") is not None,
        saved_args=megatron_deepspeed_names.checkpoint_args(model, model_files[0]))


def _stage(sd: Mapping[str, Any], file: Path) -> int:
    raw = sd.get("zero_stage")
    if raw is None:  # the bf16 optimizer (ZeRO-1 under bf16) records no stage
        if "single_partition_of_fp32_groups" in sd:
            return 1
        raise ConversionError(f"{file} is not a ZeRO optimizer state (no zero_stage)")
    value = raw.value if isinstance(raw, safe_pickle.EnumValue) else raw
    if value not in (1, 2, 3):
        raise ConversionError(f"{file} was saved at ZeRO stage {value}; from-deepspeed reads stages 1, 2 and 3")
    return int(value)


def _precision(ds_config: Mapping[str, Any], file: Path) -> str:
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ConversionError(f"{file} is from an fp16 run: from-deepspeed converts fp32 and bf16 runs (the fp16 "
                              f"loss scaler's state has no counterpart yet)")
    return "bf16" if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled") else "fp32"


def _optimizer_settings(groups: List[Mapping[str, Any]], ds_config: Mapping[str, Any], file: Path) -> Dict[str, Any]:
    """Hybrid's optimizer header entry from DeepSpeed's (torch-style) parameter groups.

    AdamW (decoupled decay) unless the groups or ds_config say plain Adam with L2 decay: torch's groups record
    ``decoupled_weight_decay``; DeepSpeed's own Adam takes ``adam_w_mode`` (default true) in ds_config."""
    first = groups[0]
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    kind = (ds_config.get("optimizer") or {}).get("type", "").lower()
    if "decoupled_weight_decay" in first:
        decoupled = bool(first["decoupled_weight_decay"])
    elif kind == "adam":
        decoupled = bool(params.get("adam_w_mode", True))
    else:
        decoupled = True
    if any(g.get("amsgrad") for g in groups):
        raise ConversionError(f"{file}: the run used AMSGrad, which hybrid's Adam has no state for")
    decays = sorted({float(g.get("weight_decay", 0.0)) for g in groups} - {0.0})
    if len(decays) > 1:
        raise ConversionError(f"{file}: the parameter groups decay at {decays}; hybrid applies one weight decay "
                              f"(to every parameter but the 1-D ones)")
    return {"type": "adamw" if decoupled else "adam", "lr": float(first["lr"]), "betas": list(first["betas"]),
            "eps": float(first["eps"]), "weight_decay": decays[0] if decays else 0.0, "momentum": 0.0}


def _merge_stage12(per_rank: List[List[torch.Tensor]], shapes: List[Dict[str, Any]], paddings, folder: Path,
                   what: str) -> Dict[str, torch.Tensor]:
    """Stages 1-2: ``per_rank[r][g]`` is rank r's flat partition of group g."""
    out = {}
    for g, group in enumerate(shapes):
        flat = torch.cat([rank[g].reshape(-1).float() for rank in per_rank])
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise ConversionError(f"{folder}: {what} of group {g} hold {flat.numel()} elements, fewer than its "
                                      f"parameters need ({name} ends at {offset + numel})")
            out[name] = flat[offset: offset + numel].view(tuple(shape)).clone()
            offset += numel + (paddings[g][i] if paddings else 0)
    return out


def _merge_stage3(per_rank: List[List[torch.Tensor]], shapes: List[Dict[str, Any]], folder: Path,
                  what: str) -> Dict[str, torch.Tensor]:
    """Stage 3: ``per_rank[r]`` is rank r's groups, each parameter ``ceil(numel / world)`` elements of them."""
    world = len(per_rank)
    flats = [torch.cat([t.reshape(-1).float() for t in rank]) for rank in per_rank]
    out, offset = {}, 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            piece = -(-numel // world)
            out[name] = torch.cat([f[offset: offset + piece] for f in flats])[:numel].view(tuple(shape)).clone()
            offset += piece
    if offset != flats[0].numel():
        raise ConversionError(f"{folder}: {what} hold {flats[0].numel()} elements per rank, the parameters "
                              f"{offset}; the model states and optimizer files do not belong together")
    return out


# ---- the hybrid side --------------------------------------------------------------------------------------
class _Tensors:
    """In-memory tensors under HF names, read the way :func:`hybrid.convert.hf._hybrid_full` reads a directory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def read_into(self, name: str, out: torch.Tensor) -> None:
        out.copy_(self.tensors[name])


def _names_check(ds: DeepSpeedState, links, arch, cfg, described_by: str) -> None:
    have = set(ds.state[MASTER])
    used = {n for link in links for n in link.hf}
    missing = sorted(n for n in used - have if ds.shared.get(n) not in have)
    unknown = sorted(n for n in have - used if not arch.ignored(n, cfg))
    if missing or unknown:
        parts = ([f"missing {', '.join(missing[:5])}"] if missing else []) + \
                ([f"without a place in hybrid's model: {', '.join(unknown[:5])}"] if unknown else [])
        raise ConversionError(f"{ds.path} does not hold the {arch.ARCHITECTURE} that {described_by} describes: "
                              f"{'; '.join(parts)}")


def hybrid_tensors(by_name: Mapping[str, torch.Tensor], shared: Mapping[str, str], arch, cfg, links,
                   layout) -> Dict[str, torch.Tensor]:
    """Whole tensors under the map's names as hybrid's: each link's tensors concatenated (and transposed), then
    the map's own row order where it has one (Megatron-DeepSpeed's per-head q/k/v)."""
    named = _Tensors({**{a: by_name[b] for a, b in shared.items() if b in by_name}, **by_name})
    rearrange = getattr(arch, "rearrange", lambda name, t, cfg: t)
    return {link.hybrid: rearrange(link.hybrid, _hybrid_full(named, link, layout[link.hybrid][0], torch.float32), cfg)
            for link in links}


def _hybrid_state(ds: DeepSpeedState, arch, cfg, links, layout) -> Dict[str, Dict[str, torch.Tensor]]:
    """Masters and moments under hybrid's names, one permutation of elements applied alike to all three."""
    return {key: hybrid_tensors(by_name, ds.shared, arch, cfg, links, layout) for key, by_name in ds.state.items()}


def model_map(ds: DeepSpeedState, hf_config=None, model_config=None):
    """The name map and :class:`GPTConfig` of ``ds``'s model, and what described it (for messages): Megatron-
    DeepSpeed's GPT when its names say so (shape from the saved args, else ``model_config``), else the HF map
    ``hf_config`` names."""
    if megatron_deepspeed_names.matches(ds.state[MASTER]):
        if ds.saved_args:
            where = f"the args saved in {ds.path}"
            args = ds.saved_args
        elif model_config is not None:
            where = f"--model-config {model_config}"
            args = read_json(Path(model_config))
        else:
            raise ConversionError(f"{ds.path} holds Megatron-DeepSpeed GPT names but no saved args: pass "
                                  f"--model-config JSON with its arguments (num_layers, hidden_size, "
                                  f"num_attention_heads, seq_length, padded_vocab_size, ...)")
        return megatron_deepspeed_names, megatron_deepspeed_names.config_from_saved_args(args, where), where
    if hf_config is None:
        raise ConversionError(f"{ds.path} holds Hugging Face names: pass --hf-config with the model's config.json")
    cfg_path = Path(hf_config)
    cfg_path = cfg_path / "config.json" if cfg_path.is_dir() else cfg_path
    hf = read_json(cfg_path)
    arch = map_for_hf(hf, cfg_path)
    return arch, arch.config_from_hf(hf, cfg_path), f"--hf-config {cfg_path}"


def convert_from_deepspeed(input_dir, save, *, hf_config=None, model_config=None, tp: int = 1, dp: int = 1, target_zero_stage: int = 1,
                           pp: int = 1, bucket_size: int = DEFAULT_BUCKET_SIZE, tag: Optional[str] = None,
                           progress: Optional[ProgressFactory] = None, force: bool = False) -> Path:
    """Write the DeepSpeed checkpoint ``input_dir`` as a hybrid checkpoint in ``save`` for a job of ``tp`` x
    ``dp`` x ``pp`` ranks at ZeRO ``target_zero_stage`` with ``bucket_size`` (its ``--zero-bucket-size``).

    ``hf_config``: a Hugging Face model's ``config.json`` (or the folder holding it): it names the
    architecture and shapes. ``model_config``: for Megatron-DeepSpeed's GPT saved without its args, a JSON of
    them. Returns the iteration directory (``save/latest`` points at it).
    """
    target = target_layout(tp, dp, pp, target_zero_stage, bucket_size)
    ds = read_deepspeed(input_dir, tag)
    arch, cfg, described_by = model_map(ds, hf_config, model_config)
    try:
        cfg.validate(tp)
    except ValueError as e:
        raise ConversionError(f"{described_by} describes a model that cannot be split over --tp {tp}: {e}") from None
    links = arch.links(cfg)
    layout = gpt_param_layout(cfg)
    _names_check(ds, links, arch, cfg, described_by)
    header = {"format": ZERO_STATE_FORMAT, "optimizer": ds.optimizer, "step": ds.step,
              "global_steps": ds.global_steps, "skipped_steps": ds.skipped_steps, "loss_scaler": None}
    src = MemorySource(_hybrid_state(ds, arch, cfg, links, layout), layout, DTYPES[ds.precision], _fresh_buffers(arch, cfg),
                        header, cfg.to_dict(), ds.path)
    schedule: Dict[str, Any] = {"iteration": ds.global_steps}
    if not ds.scheduled:  # a constant rate: the loading job's settings are checked against it
        schedule["settings"] = {"max_lr": ds.optimizer["lr"], "decay_style": "constant", "warmup_iters": 0,
                                "unit": "steps"}
    trainer_state = {"engine": {"global_step": ds.global_steps, "consumed_samples": ds.global_samples,
                                "lr_schedule": schedule},
                     "client": {},
                     "imported_from": {"format": "deepspeed", "zero_stage": ds.stage, "world_size": ds.world,
                                       "architecture": arch.ARCHITECTURE, "path": str(ds.path.resolve())}}
    return write_converted(src, save, target.replace(precision=ds.precision), iteration=ds.global_steps,
                           consumed_samples=ds.global_samples, trainer_state=trainer_state, bucket_size=bucket_size,
                           description=f"from-deepspeed ZeRO-{ds.stage}", progress=progress, force=force)
