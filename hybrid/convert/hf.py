"""``to-hf`` and ``from-hf``: hybrid checkpoints <-> Hugging Face ``transformers`` directories.

Export (:func:`export_to_hf`) picks the architecture from the model's
switches (GPT-2 switches -> ``GPT2LMHeadModel``, Llama switches ->
``LlamaForCausalLM`` or, when asked or imported from one,
``MistralForCausalLM``; with a q/k/v bias -> ``Qwen2ForCausalLM``; with query/key norms ->
``Qwen3ForCausalLM``; with experts -> ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or
``Qwen3MoeForCausalLM``, :mod:`hybrid.convert.hf_moe`), streams every HF tensor out of the checkpoint (fused
``[q; k; v]`` and ``[gate; up]`` are read chunk by chunk, straight from the
TP pieces), writes ``model.safetensors`` (sharded with the standard index
past ``max_shard_bytes``), ``config.json`` and ``generation_config.json``, and
the run's tokenizer named on the command line, in the files ``AutoTokenizer``
reads (:mod:`hybrid.convert.hf_tokenizer_files`), its BOS / EOS / pad ids in
both configs. The tokenizer path the run
recorded in ``metadata.json`` is never opened: it is an unverified string in
a file anyone may edit, and copying whatever it names would export any local
file.

Import (:func:`import_from_hf`) reads ``config.json`` and the weights
(safetensors or ``pytorch_model.bin`` via ``weights_only``), checks every
tensor's name and shape against the model the config describes, and writes
a weights-only hybrid checkpoint at any TP size: load it with ``--load DIR
--finetune`` (new optimizer). Both directions move exact values: fp32 in,
fp32 out is bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from hybrid import param_meta
from hybrid.checkpoint import CheckpointReader, CheckpointWriter
from hybrid.checkpoint.atomic import write_bytes_atomic
from hybrid.convert import hf_gpt2, hf_llama, hf_moe
from hybrid.convert.consolidate import WEIGHT, CheckpointSource, ConversionError
from hybrid.convert.hf_common import Link
from hybrid.convert.hf_io import DEFAULT_MAX_SHARD_BYTES, HFDirectory, read_json, write_sharded
from hybrid.convert.hf_tokenizer_files import SENTENCEPIECE_FILE, TOKEN_ID_KEYS, tokenizer_files
from hybrid.convert.output import ProgressFactory, nbytes_of, new_checkpoint_in, open_bar, read_ahead, tracked
from hybrid.convert.ranges import piece_runs, piece_size
from hybrid.dtypes import DTYPES, HF_DTYPE_NAMES, PRECISION_OF_DTYPE
from hybrid.layout import ParallelLayout
from hybrid.topology import Topology
from hybrid.tokenizer_files import TokenizerSpec
from model_zoo.config import GPTConfig

MAPS = (hf_gpt2,) + hf_llama.FAMILIES + hf_moe.FAMILIES


@dataclasses.dataclass
class ExportResult:
    directory: Path
    architecture: str
    files: list
    tokenizer_files: Tuple[Path, ...] = ()
    note: Optional[str] = None  # something the user should act on (a tokenizer that could not be copied)


# ---- architecture choice ------------------------------------------------------------------------------
def map_for_config(cfg: GPTConfig, architecture: Optional[str] = None):
    """The architecture map whose switches ``cfg`` has (``architecture`` when named: Llama, Mistral and
    Qwen2 without its bias share their switches), or an error saying why none fits."""
    reasons = []
    if architecture is not None:
        named = [m for m in MAPS if m.ARCHITECTURE == architecture]
        if not named:
            raise ConversionError(f"--architecture {architecture!r} is not one of "
                                  f"{', '.join(m.ARCHITECTURE for m in MAPS)}")
    for m in named if architecture is not None else MAPS:
        bad = m.mismatches(cfg)
        if not bad:
            return m
        reasons.append(f"not {m.ARCHITECTURE}: {', '.join(bad)}")
    raise ConversionError("the model matches no Hugging Face architecture hybrid can export (" + "; ".join(reasons)
                          + ")")


def map_for_hf(config: dict, where) -> object:
    """The architecture map named by an HF ``config.json``."""
    archs = config.get("architectures") or []
    by_arch = {m.ARCHITECTURE: m for m in MAPS}
    for a in archs:
        if a in by_arch:
            return by_arch[a]
    by_type = {m.MODEL_TYPE: m for m in MAPS}
    if not archs and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    named = archs or config.get("model_type")
    supported = ", ".join(f"{m.ARCHITECTURE} (model_type {m.MODEL_TYPE!r})" for m in MAPS)
    raise ConversionError(f"unknown architecture {named!r} in {where}; hybrid converts {supported}")


def gpt_param_layout(cfg: GPTConfig) -> Dict[str, Tuple[Tuple[int, ...], param_meta.TPMeta]]:
    """Every parameter of ``GPTModel(cfg)``: its logical full shape and TP metadata (no memory: meta device)."""
    from model_zoo import GPTModel

    model = GPTModel(cfg, Topology.local(), device="meta")
    return {name: (tuple(param_meta.full_shape(p.shape, param_meta.get_tp_meta(p), 1)), param_meta.get_tp_meta(p))
            for name, p in model.named_parameters()}


def gpt_buffer_layout(cfg: GPTConfig) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """The persistent buffers ``GPTModel(cfg)`` saves beside its parameters (the MoE routers' ``expert_bias``):
    their shapes and dtypes (meta device)."""
    from model_zoo import GPTModel

    model = GPTModel(cfg, Topology.local(), device="meta")
    params = {name for name, _ in model.named_parameters()}
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
            if name not in params and isinstance(t, torch.Tensor)}


def _hf_shape(link: Link, index: int, full_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    lo, hi = link.row_range(index, full_shape[0])
    shape = (hi - lo,) + tuple(full_shape[1:])
    return shape[::-1] if link.transpose else shape


# ---- export ---------------------------------------------------------------------------------------------
def export_to_hf(load, output, *, dtype: Optional[str] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 tokenizer_model=None, architecture: Optional[str] = None,
                 progress: Optional[ProgressFactory] = None, tokenizer: Optional[TokenizerSpec] = None) -> ExportResult:
    """Write the checkpoint at ``load`` as a Hugging Face directory ``output``.

    ``dtype`` (``fp32``/``bf16``/``fp16``) defaults to the run's precision.
    For a bf16/fp16 run exported in fp32, the values are the fp32 master
    weights when the checkpoint holds them. ``tokenizer`` names the run's
    tokenizer, exported beside the weights (:mod:`hybrid.convert.hf_tokenizer_files`;
    ``tokenizer_model`` alone is a SentencePiece ``.model``); without one no
    tokenizer is exported and ``note`` says so. ``architecture``
    (``--architecture``) picks among the HF classes the model's switches fit
    (default: the one it was imported from, when the checkpoint records it,
    else the first that fits: GPT-2, Llama, Mistral, Qwen2).
    """
    reader = CheckpointReader(load)
    if not reader.model_config:
        raise ConversionError(f"{reader.path / 'metadata.json'} has no model_config; to-hf needs the model settings "
                              f"(checkpoints written by hybrid's trainer and engine record them)")
    try:
        cfg = GPTConfig.from_dict(reader.model_config)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{reader.path / 'metadata.json'}: model_config is not a model_zoo GPTConfig: {e}") \
            from None
    imported = (reader.trainer_state.get("imported_from") or {}).get("architecture")
    by_name = {m.ARCHITECTURE: m for m in MAPS}
    if architecture is None and imported in by_name and not by_name[imported].mismatches(cfg):
        architecture = imported
    arch = map_for_config(cfg, architecture)
    out_dtype = DTYPES[_check_dtype(dtype or reader.layout.precision)]
    # Checked before any weight is written: a wrong file fails in a second, not after the export.
    if tokenizer is None and tokenizer_model is not None:
        tokenizer = TokenizerSpec(tokenizer_model=str(tokenizer_model))
    exported = tokenizer_files(tokenizer, cfg.vocab_size, cfg.seq_length) if tokenizer is not None else None
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    with CheckpointSource(reader) as src:
        links = arch.links(cfg)
        # Saved tensors that carry nothing the HF model computes with (the MoE router's unused expert bias)
        unexported = getattr(arch, "unexported", lambda name, cfg: False)
        _check_same_names({n for n in src.tensors if not unexported(n, cfg)}, {link.hybrid for link in links},
                          reader.path)
        total = sum(nbytes_of(src.tensors[link.hybrid].full_shape, out_dtype) for link in links)
        bar = open_bar(progress, f"to-hf {arch.ARCHITECTURE}", total)
        try:
            tensors = {}
            for link in links:
                t = src.tensors[link.hybrid]
                # Same dtype as saved: the saved weights are exact (masters rounded); else the best copy.
                what = WEIGHT if t.dtype == out_dtype else src.best_weight(link.hybrid)
                for i, hf_name in enumerate(link.hf):
                    tensors[hf_name] = tracked(_hf_shape(link, i, t.full_shape), out_dtype,
                                               lambda link=link, i=i, what=what: _export_tensor(
                                                   src, link, i, what, out_dtype), bar)
            files = write_sharded(out, tensors, max_shard_bytes)
        finally:
            bar.close()
    config = arch.hf_config(cfg, HF_DTYPE_NAMES[out_dtype])
    # The tokenizer's BOS / EOS (end of document) / pad ids: generate stops at EOS only when config.json and
    # generation_config.json name it. Without a tokenizer they stay null (and the note says so).
    token_ids = exported.token_ids if exported is not None else dict.fromkeys(TOKEN_ID_KEYS)
    config.update(token_ids)
    write_bytes_atomic(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    write_bytes_atomic(out / "generation_config.json", (json.dumps(token_ids, indent=2) + "\n").encode())
    result = ExportResult(out, arch.ARCHITECTURE, files)
    tokenizer_data = exported.files if exported is not None else {}
    for name, data in tokenizer_data.items():
        write_bytes_atomic(out / name, data)  # the very bytes that were checked
    result.tokenizer_files = tuple(out / name for name in tokenizer_data)
    if not tokenizer_data:
        result.note = _no_tokenizer_note(reader, out)
    return result


def _export_tensor(src: CheckpointSource, link: Link, index: int, what: str, dtype: torch.dtype) -> torch.Tensor:
    # A transposed HF tensor is filled through its transpose view: one strided pass, no second copy.
    hf = torch.empty(_hf_shape(link, index, src.tensors[link.hybrid].full_shape), dtype=dtype)
    view = hf.t() if link.transpose else hf
    if link.offset:  # a zero-centred norm weight (gamma - 1, one HF tensor): HF stores gamma; add in fp32, round once
        exact = torch.empty(view.shape, dtype=torch.float32)
        src.read(link.hybrid, what, out=exact)
        view.copy_(exact + link.offset)
    elif len(link.hf) == 1:
        src.read(link.hybrid, what, out=view)
    else:
        src.read_rows(link.hybrid, *link.row_range(index, src.tensors[link.hybrid].full_shape[0]), what, out=view)
    return hf


def _check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ConversionError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return name


def _check_same_names(saved: set, expected: set, path) -> None:
    if saved != expected:
        missing, extra = sorted(expected - saved), sorted(saved - expected)
        raise ConversionError(f"{path} does not hold the tensors its model_config describes: missing "
                              f"{missing[:5]}, unexpected {extra[:5]}")


def _no_tokenizer_note(reader: CheckpointReader, out: Path) -> str:
    from hybrid.config import saved_setting  # reads the trainer's stored settings, nested or (older) flat

    args = (reader.trainer_state.get("client") or {}).get("args") or {}
    recorded = saved_setting(args, "data.tokenizer_model")
    # The recorded path is named as a hint only; it is never opened.
    hint = f" (the run recorded {str(recorded)[:200]!r})" if isinstance(recorded, str) and recorded else ""
    left = f"; the {SENTENCEPIECE_FILE} already there is from before and was left as it is" \
        if (out / SENTENCEPIECE_FILE).exists() else ""
    return (f"no tokenizer exported: pass --tokenizer-model PATH to add the run's SentencePiece model as "
            f"{out / SENTENCEPIECE_FILE}{hint}{left} (GPT-2's: --tokenizer-type GPT2BPETokenizer --vocab-file "
            f"--merge-file; a model folder's: --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)")


# ---- import ---------------------------------------------------------------------------------------------
def import_from_hf(input_dir, save, *, tp: int = 1, dtype: Optional[str] = None,
                   progress: Optional[ProgressFactory] = None, force: bool = False) -> Path:
    """Write the HF model directory ``input_dir`` as a weights-only hybrid checkpoint in ``save`` at ``tp``.

    ``dtype`` defaults to the HF weights' dtype. Returns the iteration directory
    (iteration 0; ``save/latest`` points at it). A ``save`` that already holds
    checkpoints is refused unless ``force`` (``--force``): see
    :func:`hybrid.convert.output.new_checkpoint_in`.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ConversionError(f"--tp must be an integer >= 1, got {tp!r}")
    where = Path(input_dir) / "config.json"
    if not Path(input_dir).is_dir():
        raise ConversionError(f"--input {input_dir} is not a directory (expected a Hugging Face model directory)")
    hf_config = read_json(where)
    arch = map_for_hf(hf_config, where)  # the model first: no point reading weights of an unknown one
    cfg = arch.config_from_hf(hf_config, where)
    if cfg.is_moe and tp > 1:  # an MoE model splits over TP only with sequence parallelism (model_zoo.config)
        cfg = cfg.replace(sequence_parallel=True)
    try:  # first on its own, so that a model no layout can build is not blamed on --tp
        cfg.validate(1)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{where} describes a model hybrid cannot build: {e}") from None
    try:
        cfg.validate(tp)
    except ValueError as e:
        raise ConversionError(f"{where} describes a model that cannot be split over --tp {tp}: {e}") from None
    hf = HFDirectory(input_dir)
    if hasattr(arch, "adapt"):  # other namings of the same tensors (hybrid.convert.hf_moe: fused experts)
        arch.adapt(hf, cfg)
    layout = gpt_param_layout(cfg)
    links = arch.links(cfg)
    _check_hf_tensors(hf, arch, cfg, links, layout)
    buffers = _fresh_buffers(arch, cfg)
    out_dtype = DTYPES[_check_dtype(dtype)] if dtype else hf.dtype(links[0].hf[0])
    if out_dtype not in PRECISION_OF_DTYPE:
        raise ConversionError(f"{hf.path} holds {out_dtype} weights; pass --dtype fp32, bf16 or fp16")
    # Weights only, as one data-parallel rank without ZeRO would hold them: any layout can load that.
    # as a job's save: a job saving into the same folder would delete this import's files as leftovers
    with new_checkpoint_in(save, 0, force=force):
        writer = CheckpointWriter(save, 0, ParallelLayout(tp=tp, dp=1, precision=PRECISION_OF_DTYPE[out_dtype]))
        total = tp * (sum(nbytes_of(layout[link.hybrid][0], out_dtype) for link in links)
                      + sum(nbytes_of(t.shape, t.dtype) for t in buffers.values()))
        bar = open_bar(progress, f"from-hf {arch.ARCHITECTURE} to tp={tp}", total)
        index = []
        try:
            writer.prepare()
            records = []
            for rank in range(tp):
                sources = {}
                for link in links:
                    full, meta = layout[link.hybrid]
                    local = _local_shape(full, meta, tp)
                    sources[link.hybrid] = tracked(
                        local, out_dtype,
                        lambda link=link, full=full, meta=meta, rank=rank: _hybrid_piece(
                            hf, link, full, meta, tp, rank, out_dtype), bar)
                    if rank == 0:
                        index.append({"name": link.hybrid, "shape": list(local), "dtype": HF_DTYPE_NAMES[out_dtype],
                                      "tp_meta": meta.to_json()})
                for name, value in buffers.items():  # whole on every TP rank and, as the engine saves them,
                    # not in the parameter index (which lists what the optimizer holds)
                    sources[name] = tracked(value.shape, value.dtype, value.clone, bar)
                with read_ahead(sources) as ahead:
                    records.append(writer.write_model_shard(ahead, rank))
            writer.commit(records, model_config=cfg.to_dict(), param_index=index,
                          trainer_state={"imported_from": {"format": "huggingface", "architecture": arch.ARCHITECTURE,
                                                           "path": str(hf.path.resolve())}})
        finally:
            bar.close()
            hf.close()
    return writer.iter_dir


def _local_shape(full, meta: param_meta.TPMeta, tp: int) -> Tuple[int, ...]:
    if not meta.partitioned:
        return tuple(full)
    shape = list(full)
    shape[meta.dim] = piece_size(meta, full[meta.dim], tp)
    return tuple(shape)


def _hybrid_piece(hf: HFDirectory, link: Link, full_shape: Tuple[int, ...], meta: param_meta.TPMeta, tp: int,
                  rank: int, dtype: torch.dtype) -> torch.Tensor:
    """TP rank ``rank``'s piece of ``link``'s full hybrid tensor (what ``param_meta.shard`` cuts from it).

    Where the pieces are rows (dim 0) of untransposed HF tensors (embeddings, heads, column-parallel
    projections), only the piece's rows are read, straight into it: the largest tensors then cost their piece,
    not the full tensor and a copy. Otherwise the full tensor is read and cut.
    """
    if not meta.partitioned:
        return _hybrid_full(hf, link, full_shape, dtype)
    if meta.dim != 0 or link.transpose:
        return param_meta.shard(_hybrid_full(hf, link, full_shape, dtype), meta, tp, rank)
    piece = torch.empty(_local_shape(full_shape, meta, tp), dtype=dtype)
    for run in piece_runs(meta, full_shape[0], tp, rank):
        rows = piece[run.local_start: run.local_start + run.length]
        if run.full_start is None:  # padding past the logical size
            rows.zero_()
            continue
        lo, hi = run.full_start, run.full_start + run.length
        for i, name in enumerate(link.hf):  # the HF tensors whose rows [a, b) of the full tensor meet [lo, hi)
            a, b = link.row_range(i, full_shape[0])
            if max(lo, a) < min(hi, b):
                hf.read_rows_into(name, max(lo, a) - a, min(hi, b) - a, rows[max(lo, a) - lo: min(hi, b) - lo])
    return piece


def _hybrid_full(hf: HFDirectory, link: Link, full_shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The full hybrid tensor ``full_shape`` of ``link``, each HF tensor read straight into its rows (a transposed
    one through its transpose view): no concatenation or conversion copy, so a tensor read in its own dtype
    peaks at the one copy."""
    full = torch.empty(full_shape, dtype=dtype)
    for i, name in enumerate(link.hf):
        rows = full[slice(*link.row_range(i, full_shape[0]))]
        hf.read_into(name, rows.t() if link.transpose else rows)
    if link.offset:
        full -= link.offset
    return full


def _fresh_buffers(arch, cfg: GPTConfig) -> Dict[str, torch.Tensor]:
    """The values the map gives the model's persistent buffers (those of a fresh model: HF has none of them),
    checked against the buffers ``GPTModel(cfg)`` saves."""
    buffers = getattr(arch, "buffers", lambda cfg: {})(cfg)
    expected = gpt_buffer_layout(cfg)
    if {n: (tuple(t.shape), t.dtype) for n, t in buffers.items()} != expected:  # a bug, not a user error
        raise ConversionError(f"internal: {arch.ARCHITECTURE} gives the buffers {sorted(buffers)[:5]}, "
                              f"model_zoo.GPTModel saves {sorted(expected)[:5]}")
    return buffers


def _check_hf_tensors(hf: HFDirectory, arch, cfg: GPTConfig, links, layout) -> None:
    wanted = {link.hybrid for link in links}
    if wanted != set(layout):  # the map and model_zoo disagree: a bug, not a user error
        raise ConversionError(f"internal: {arch.ARCHITECTURE} maps {sorted(wanted ^ set(layout))[:5]} differently "
                              f"from model_zoo.GPTModel")
    used = {name for link in links for name in link.hf}
    missing = sorted(n for n in used if n not in hf.files)
    if missing:
        raise ConversionError(f"{hf.path} lacks {len(missing)} tensor(s) its config.json implies: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unknown = sorted(n for n in hf.names() if n not in used and not arch.ignored(n, cfg))
    if unknown:
        raise ConversionError(f"{hf.path} holds tensor(s) the {arch.ARCHITECTURE} described by its config.json has "
                              f"no place for: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    for link in links:
        full = layout[link.hybrid][0]
        for i, name in enumerate(link.hf):
            want = _hf_shape(link, i, full)
            if hf.shape(name) != want:
                raise ConversionError(f"{hf.path}: tensor {name} has shape {list(hf.shape(name))}, but config.json "
                                      f"implies {list(want)}")
