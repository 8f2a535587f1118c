"""Reading a saved checkpoint one parameter at a time, in any TP layout.

A checkpoint stores each parameter as TP pieces (one per ``model_tpNN``
file) and, with optimizer state, as slices of flat fp32 ZeRO partitions
(``optim_tpNN_dpNN.pt``; a parameter may straddle partitions). The
parameter index in ``metadata.json`` records where every piece lives: its TP
metadata (:class:`~hybrid.param_meta.TPMeta`), its flat group and offset,
and its ``parts`` in the DP partitions. A checkpoint saved with pipeline
parallelism has files per stage (``_ppNN``) and one parameter index per
stage; each parameter is read from the stage that holds it (a weight tied
across the first and last stage, from the first).

:class:`CheckpointSource` turns that back into tensors, one at a time:

* ``source.read(name)``: the logical full tensor (TP-merged, vocabulary
  padding removed) of the saved weights;
* ``source.read(name, "exp_avg")`` (or ``"master"``, ``"exp_avg_sq"``...):
  the same for an optimizer state, gathered from the flat partitions through
  the recorded offsets;
* ``source.read(name, what, target=Target(meta, tp, rank))``: directly the
  piece TP rank ``rank`` of a ``tp``-way layout holds, padding included,
  without building the full tensor (see :mod:`hybrid.convert.ranges`).

Memory: weights are read from the safetensors files row range by row range
(``get_slice``), so only the output tensor is ever resident. Optimizer files
are opened with ``torch.load(weights_only=True, mmap=True)``: only the pages
of the slices read are touched. Both kinds of memory maps are closed every
``map_budget_bytes`` (64 MB) read through them (and reopened on demand), since
the pages a map has touched count as resident until it is closed. Nothing
needs a process group.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hybrid.checkpoint import CheckpointError, CheckpointFormatError, CheckpointReader, model_file, optimizer_file
from hybrid.checkpoint.unreadable import load_checkpoint_torch_file, open_checkpoint_safetensors
from hybrid.dtypes import DTYPE_OF_SAFETENSORS_CODE
from hybrid.param_meta import REPLICATED, TPMeta, full_size_of
from hybrid.convert.ranges import assemble, check_same_layout, copy_rows, piece_size
from hybrid.zero.expert_split import STATE_FORMAT as EXPERT_STATE_FORMAT
from hybrid.zero.expert_split import EP_RANK_KEY, expert_file_dp_rank, expert_index_entries, is_expert_entry

WEIGHT = "weight"
MASTER = "master"
ZERO_STATE_FORMAT = "hybrid.zero/1"
# An expert-parallel run's optimizer files: {"format": EXPERT_STATE_FORMAT, "dense": <ZERO_STATE_FORMAT state>,
# "expert": <ZERO_STATE_FORMAT state>, ...} (hybrid.zero.expert_split.ExpertSplitOptimizer.state_dict)
STATE_FORMATS = (ZERO_STATE_FORMAT, EXPERT_STATE_FORMAT)
DENSE, EXPERT = "dense", "expert"  # the sub-states of an expert-parallel optimizer file


class ConversionError(CheckpointError):
    """A checkpoint cannot be converted or loaded into the requested layout or model."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A TP layout to cut a tensor for: rank ``rank`` of ``tp``, split as ``meta`` says."""

    meta: TPMeta
    tp: int
    rank: int


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One entry of the saved model files."""

    name: str
    local_shape: Tuple[int, ...]  # shape of each TP piece in the files
    dtype: torch.dtype  # dtype in the model files
    meta: TPMeta
    full_shape: Tuple[int, ...]  # logical TP=1 shape
    record: Optional[dict]  # the parameter-index entry, or None (not an optimizer parameter)
    stage: int = 0  # the pipeline stage whose files hold it

    @property
    def numel(self) -> int:
        n = 1
        for s in self.full_shape:
            n *= s
        return n

    def target_shape(self, target: Optional[Target]) -> Tuple[int, ...]:
        """Shape of the piece ``target`` holds (the full shape when ``target`` is None)."""
        if target is None or not target.meta.partitioned:
            return self.full_shape
        shape = list(self.full_shape)
        shape[target.meta.dim] = piece_size(target.meta, self.full_shape[target.meta.dim], target.tp)
        return tuple(shape)


def index_by_name(param_index: Any) -> Dict[str, dict]:
    """The parameter index of ``metadata.json`` as ``{name: entry}`` (empty when absent)."""
    if param_index is None:
        return {}
    if not isinstance(param_index, list) or not all(isinstance(e, dict) and "name" in e for e in param_index):
        raise CheckpointFormatError("metadata.json param_index must be a list of objects with a 'name'")
    return {e["name"]: e for e in param_index}


def verify_in_parallel(reader: CheckpointReader, names: List[str]) -> None:
    """Check the sha256 of ``names`` on several threads (hashing and reading release the GIL)."""
    workers = min(len(names), os.cpu_count() or 1)
    if workers <= 1:
        for name in names:
            reader.verify(name)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(reader.verify, names):  # re-raises the first error
            pass


class _PartitionFiles:
    """Memory-mapped optimizer files, dropped whenever more than ``budget`` bytes were read through them."""

    def __init__(self, reader: CheckpointReader, budget: int):
        self.reader = reader
        self.budget = budget
        self._open: Dict[Tuple[int, int, int], dict] = {}
        self._touched = 0
        self._verified = False

    def state(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> dict:
        key = (tp_rank, dp_rank, pp_rank)
        if not self._verified:  # a conversion reads (nearly) all of them: check them together
            layout = self.reader.layout
            verify_in_parallel(self.reader, [optimizer_file(layout, t, d, p) for p in range(layout.pp)
                                             for t in range(layout.tp) for d in range(layout.dp)])
            self._verified = True
        if key not in self._open:
            name = optimizer_file(self.reader.layout, tp_rank, dp_rank, pp_rank)
            path = self.reader.verify(name)
            sd = load_checkpoint_torch_file(path, mmap=True)
            if not isinstance(sd, dict) or sd.get("format") not in STATE_FORMATS:
                raise CheckpointFormatError(f"{path} is not a ZeRO optimizer state (format "
                                            f"{sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r}, "
                                            f"expected one of {list(STATE_FORMATS)})")
            self._open[key] = sd
        return self._open[key]

    def half(self, tp_rank: int, dp_rank: int, pp_rank: int = 0, half: str = DENSE) -> dict:
        """One rank's flat state: the file's own (a plain ZeRO state), or its ``half`` sub-state (an
        expert-parallel run's: ``"dense"`` or ``"expert"``)."""
        sd = self.state(tp_rank, dp_rank, pp_rank)
        return sd[half] if sd.get("format") == EXPERT_STATE_FORMAT else sd

    def flat(self, tp_rank: int, dp_rank: int, group: int, key: str, pp_rank: int = 0,
             half: str = DENSE) -> torch.Tensor:
        sd = self.half(tp_rank, dp_rank, pp_rank, half)
        groups = sd["groups"]
        if not 0 <= group < len(groups) or key not in groups[group]:
            have = sorted(k for k, v in groups[group].items() if isinstance(v, torch.Tensor)) \
                if 0 <= group < len(groups) else []
            raise ConversionError(
                f"{self.reader.path / optimizer_file(self.reader.layout, tp_rank, dp_rank, pp_rank)} has no optimizer "
                f"state {key!r} for flat group {group} (it holds {have}); the run that saved it used optimizer "
                f"{sd.get('optimizer', {}).get('type')!r}")
        return groups[group][key]

    def touched(self, nbytes: int) -> None:
        self._touched += nbytes
        if self._touched > self.budget:
            self.release()

    def release(self) -> None:
        self._open.clear()  # the last references to the mappings: they are unmapped here
        self._touched = 0


class CheckpointSource:
    """Per-parameter access to a saved checkpoint (see the module docstring).

    ``meta_fallback(name)`` gives the TP metadata of entries the parameter
    index does not describe (frozen parameters, buffers); without it such
    entries count as replicated (TP rank 0's copy is read).
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, reader: CheckpointReader, *, meta_fallback: Optional[Callable[[str], TPMeta]] = None,
                 map_budget_bytes: int = 64 << 20):
        layout = reader.layout
        self.reader = reader
        self.layout = layout
        self._handles: Dict[Tuple[int, int], Any] = {}
        self._mapped_bytes = 0
        self._budget = map_budget_bytes
        self._partitions = _PartitionFiles(reader, map_budget_bytes)
        verify_in_parallel(reader, [model_file(layout, t, p) for p in range(layout.pp) for t in range(layout.tp)])
        self.index: Dict[str, dict] = {}  # name -> index entry, from the stage the name is read from
        self.tensors: Dict[str, SavedTensor] = {}
        for stage in range(layout.pp):
            index = index_by_name(self._stage_index(stage))
            headers = [reader.model_shard_header(t, stage) for t in range(layout.tp)]
            for name in self._ordered_names(headers[0], index):
                if name in self.tensors:  # a tied weight's copy on the last stage: the first stage's is read
                    continue
                if name in index:
                    self.index[name] = index[name]
                self.tensors[name] = self._describe(name, headers, meta_fallback, stage)

    # ---- description ----------------------------------------------------------------------------
    def _stage_index(self, stage: int) -> Any:
        """Pipeline stage ``stage``'s parameter index from metadata.json. An expert-parallel checkpoint saved
        before metadata.json indexed its experts holds the dense half's records alone: each ep rank's expert
        records are then taken from that rank's optimizer file (TP rank 0, DP rank ``ep_rank``), whose expert
        sub-state keeps them."""
        index = self.reader.stage_param_index(stage)
        layout = self.layout
        if layout.ep == 1 or not isinstance(index, list) or any(is_expert_entry(e) for e in index) \
                or not self.reader.has_optimizer_state:
            return index
        if self._partitions.state(0, 0, stage).get("format") != EXPERT_STATE_FORMAT:
            return index
        experts = [e for r in range(layout.ep)
                   for e in expert_index_entries(self._partitions.half(0, r, stage, EXPERT)["param_index"], r)]
        return list(index) + experts

    @staticmethod
    def _ordered_names(header: dict, index: Dict[str, dict]) -> List[str]:
        # dense records in their order, then the experts of each ep rank in theirs (positions count within
        # each half of an expert-parallel run)
        def order(n: str):
            e = index[n]
            return (e.get(EP_RANK_KEY, -1), e.get("position", 0))
        indexed = sorted((n for n in header if n in index), key=order)
        return indexed + sorted(n for n in header if n not in index)

    def _describe(self, name: str, headers: List[dict], meta_fallback, stage: int) -> SavedTensor:
        tp = self.layout.tp
        shape, code = headers[0][name]
        for t, h in enumerate(headers[1:], start=1):
            if h.get(name, (None,))[0] != shape:
                got = "no such tensor" if name not in h else f"shape {list(h[name][0])}"
                raise CheckpointFormatError(f"{self.reader.path / model_file(self.layout, t, stage)}: {name!r} "
                                            f"has {got}, but {model_file(self.layout, 0, stage)} holds shape "
                                            f"{list(shape)}")
        record = self.index.get(name)
        if record is not None and "tp_meta" in record:
            meta = TPMeta.from_json(record["tp_meta"])
        elif meta_fallback is not None:
            meta = meta_fallback(name)
        else:
            meta = REPLICATED
        if meta.partitioned:
            full = list(shape)
            full[meta.dim] = full_size_of(meta, shape[meta.dim], tp)
            expected = piece_size(meta, full[meta.dim], tp)
            if expected != shape[meta.dim]:
                raise CheckpointFormatError(f"{self.reader.path}: {name!r} has {shape[meta.dim]} entries along dim "
                                            f"{meta.dim} per TP rank, but its metadata {meta} at tp={tp} gives "
                                            f"{expected}; metadata.json does not match the files")
        else:
            full = list(shape)
        if record is not None and list(record.get("shape", shape)) != list(shape):
            raise CheckpointFormatError(f"{self.reader.path}: {name!r} has shape {list(shape)} in the model files "
                                        f"but {record['shape']} in the parameter index")
        if code not in DTYPE_OF_SAFETENSORS_CODE:
            raise CheckpointFormatError(f"{self.reader.path}: {name!r} has unsupported dtype {code}")
        return SavedTensor(name, tuple(shape), DTYPE_OF_SAFETENSORS_CODE[code], meta, tuple(full), record, stage)

    @property
    def has_optimizer_state(self) -> bool:
        """Whether fp32 master weights and optimizer moments were saved (and can be located)."""
        return self.reader.has_optimizer_state and any("parts" in e for e in self.index.values())

    def has_state(self, name: str) -> bool:
        record = self.tensors[name].record
        return self.has_optimizer_state and record is not None and "parts" in record

    @property
    def weights_from_master(self) -> bool:
        """Whether the best weights are the fp32 masters (a bf16/fp16 run with optimizer state)."""
        return self.has_optimizer_state and self.layout.precision != "fp32"

    def optimizer_header(self) -> dict:
        """Everything but the tensors of the (TP 0, DP 0) optimizer file: counters, hyperparameters, scaler.
        For an expert-parallel run's file: its dense half's header with the run's counters and loss scaler
        (kept at the top level: the halves run no step of their own)."""
        sd = self._partitions.state(0, 0)
        if sd.get("format") == EXPERT_STATE_FORMAT:
            top = {k: sd[k] for k in ("global_steps", "skipped_steps", "loss_scaler")}
            sd = dict(sd[DENSE], **top)
        return {k: v for k, v in sd.items() if k not in ("groups", "param_index")}

    def state_keys(self) -> List[str]:
        """The per-parameter optimizer tensors saved: ``master`` first, then the moments."""
        groups = self._partitions.half(0, 0, 0, DENSE)["groups"] or self._partitions.half(0, 0, 0, EXPERT)["groups"]
        keys = [k for k, v in groups[0].items() if isinstance(v, torch.Tensor)]
        return [MASTER] + sorted(k for k in keys if k != MASTER)

    # ---- reading ---------------------------------------------------------------------------------
    def best_weight(self, name: str) -> str:
        """What to read for the best copy of a weight: ``"master"`` (fp32) when
        :attr:`weights_from_master` and the parameter has one, else ``"weight"`` (as saved)."""
        return MASTER if self.weights_from_master and self.has_state(name) else WEIGHT

    def read_weight(self, name: str, target: Optional[Target] = None,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The best copy of a weight (see :meth:`best_weight`), full or ``target``'s piece."""
        return self.read(name, self.best_weight(name), target=target, dtype=dtype)

    def read_rows(self, name: str, start: int, stop: int, what: str = WEIGHT,
                  dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``[start, stop)`` (dim 0) of the full tensor (e.g. k of a fused [q; k; v]); reads only
        those rows when the tensor is TP-split along dim 0."""
        t = self._entry(name)
        if not 0 <= start <= stop <= t.full_shape[0]:
            raise ConversionError(f"{name}: rows [{start}, {stop}) lie outside its {t.full_shape[0]} rows")
        if not (t.meta.partitioned and t.meta.dim == 0):
            rows = self.read(name, what, dtype=dtype)[start:stop]
            return rows.clone() if out is None else out.copy_(rows)
        read_piece, out_dtype = self._piece_reader(t, what)
        if out is None:
            out = torch.empty((stop - start,) + tuple(t.full_shape[1:]), dtype=dtype or out_dtype)
        return copy_rows(read_piece, out, t.meta, self.layout.tp, t.full_shape[0], start, self._max_rows(t))

    def read(self, name: str, what: str = WEIGHT, *, target: Optional[Target] = None,
             dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``what`` (``"weight"`` or an optimizer key) of parameter ``name``: the logical full tensor,
        or ``target``'s piece of it. A new CPU tensor of ``dtype`` (default: as saved), or ``out``
        filled (any strides: a transposed view saves exporters a second pass)."""
        t = self._entry(name)
        if target is not None:
            check_same_layout(name, t.meta, target.meta)
        return self._read(t, what, target, dtype, out)

    def _entry(self, name: str) -> SavedTensor:
        if name not in self.tensors:
            raise ConversionError(f"{self.reader.path} holds no tensor {name!r}")
        return self.tensors[name]

    def _read(self, t: SavedTensor, what: str, target: Optional[Target], dtype: Optional[torch.dtype],
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        read_piece, out_dtype = self._piece_reader(t, what)
        dtype = out.dtype if out is not None else dtype or out_dtype
        if not t.meta.partitioned:
            piece = read_piece(0, 0, 0)  # a fresh tensor here
            if out is None:
                return piece.to(dtype=dtype)
            if tuple(out.shape) != t.full_shape:
                raise ValueError(f"{t.name}: out has shape {list(out.shape)}, the tensor {list(t.full_shape)}")
            return out.copy_(piece)
        if target is None:  # the logical full tensor: one unpadded rank
            target = Target(dataclasses.replace(t.meta, pad_multiple=1), 1, 0)
        return assemble(read_piece, t.target_shape(target), dtype, t.meta, self.layout.tp,
                        t.full_shape[t.meta.dim], target.meta, target.tp, target.rank,
                        max_rows=self._max_rows(t), out=out)

    def _piece_reader(self, t: SavedTensor, what: str):
        """``(read(rank, start, stop), dtype)`` of ``what`` for ``t``'s saved pieces."""
        if what == WEIGHT:
            return self._weight_pieces(t), t.dtype
        if not self.has_state(t.name):
            raise ConversionError(f"{self.reader.path} holds no optimizer state for {t.name!r}")
        return self._state_pieces(t, what), torch.float32

    def _max_rows(self, t: SavedTensor) -> int:
        """Entries along the dim read at once: a quarter of the map budget."""
        row_bytes = max(1, t.numel // t.full_shape[t.meta.dim]) * torch.empty((), dtype=t.dtype).element_size()
        return max(1, self._budget // 4 // row_bytes)

    def _handle(self, tp_rank: int, stage: int):
        if (tp_rank, stage) not in self._handles:
            self._handles[(tp_rank, stage)] = open_checkpoint_safetensors(
                self.reader.verify(model_file(self.layout, tp_rank, stage)))
        return self._handles[(tp_rank, stage)]

    def _weight_pieces(self, t: SavedTensor):
        # safe_open hands out views of its memory map, whose touched pages stay resident until the
        # map is closed: close the maps every `budget` bytes. assemble copies each view at once (and
        # asks for a quarter budget at most); a whole replicated tensor is returned as is, so cloned.
        def read(rank: int, start: int, stop: int) -> torch.Tensor:
            if not t.meta.partitioned:
                nbytes = t.numel * torch.empty((), dtype=t.dtype).element_size()
            else:
                nbytes = t.numel // t.full_shape[t.meta.dim] * (stop - start) * \
                    torch.empty((), dtype=t.dtype).element_size()
            if self._mapped_bytes + nbytes > self._budget:
                self._handles.clear()
                self._mapped_bytes = 0
            self._mapped_bytes += nbytes
            if not t.meta.partitioned:
                return self._handle(rank, t.stage).get_tensor(t.name).clone()
            index = (slice(None),) * t.meta.dim + (slice(start, stop),)
            return self._handle(rank, t.stage).get_slice(t.name)[index]
        return read

    def _state_pieces(self, t: SavedTensor, key: str):
        # Along dim 0 a row range of the piece is a flat range: read just that. Along another dim the
        # whole piece is needed; keep the last one (assemble asks for one rank's runs in a row).
        cached: Dict[int, torch.Tensor] = {}
        rows_contiguous = not t.meta.partitioned or t.meta.dim == 0
        inner = t.numel // t.full_shape[0] if t.full_shape and rows_contiguous else 0

        def read(rank: int, start: int, stop: int) -> torch.Tensor:
            if not t.meta.partitioned:
                return self._local_state(t, key, rank, 0, t.record["numel"]).view(t.local_shape)
            if rows_contiguous:
                shape = (stop - start,) + tuple(t.local_shape[1:])
                return self._local_state(t, key, rank, start * inner, stop * inner).view(shape)
            if rank not in cached:
                cached.clear()
                cached[rank] = self._local_state(t, key, rank, 0, t.record["numel"]).view(t.local_shape)
            return cached[rank].narrow(t.meta.dim, start, stop - start)
        return read

    def _local_state(self, t: SavedTensor, key: str, tp_rank: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of TP rank ``tp_rank``'s flattened piece of ``key`` for ``t``,
        gathered from the flat partitions that hold them."""
        rec = t.record
        out = torch.empty(hi - lo, dtype=torch.float32)
        for part in rec["parts"]:
            a, b = max(lo, part["param_start"]), min(hi, part["param_end"])
            if a >= b:
                continue
            # Stage 0 saves one whole partition per rank (part 0): DP rank 0's file holds it (an expert's:
            # the first DP rank of its ep rank). An expert's part counts edp ranks.
            if is_expert_entry(rec):
                dp_rank = expert_file_dp_rank(part["part"], rec[EP_RANK_KEY], self.layout.ep)
                flat = self._partitions.flat(tp_rank, dp_rank, rec["group"], key, t.stage, EXPERT)
            else:
                flat = self._partitions.flat(tp_rank, part["part"], rec["group"], key, t.stage)
            start = part["partition_offset"] + a - part["param_start"]
            end = part["partition_offset"] + part["param_end"] - part["param_start"]
            if end > flat.numel():
                raise CheckpointFormatError(f"{self.reader.path}: {t.name!r} lies at [{part['partition_offset']}, "
                                            f"{end}) of partition {part['part']} of group {rec['group']}, which "
                                            f"holds only {flat.numel()} elements; metadata.json does not match "
                                            f"the files")
            out[a - lo: b - lo].copy_(flat[start: start + b - a])
            self._partitions.touched((b - a) * flat.element_size())
        return out

    # ---- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        self._handles.clear()
        self._partitions.release()

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
