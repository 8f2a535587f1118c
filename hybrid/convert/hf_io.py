"""Hugging Face model directories on disk: reading their weights, writing sharded safetensors.

Reading (:class:`HFDirectory`) accepts what ``save_pretrained`` writes:
``model.safetensors``, sharded ``model-0000K-of-0000N.safetensors`` with
``model.safetensors.index.json``, or the older ``pytorch_model.bin`` (also
sharded with its index), opened with ``torch.load(weights_only=True,
mmap=True)`` so that no pickled code runs and only the tensors read are
paged in. Tensors are read one at a time. A tensor may also be presented
under another name, or as a run of rows of a larger one (:meth:`HFDirectory.alias`):
the MoE maps read ``transformers`` 5's fused expert tensors
(``experts.gate_up_proj`` ``[E, 2f, h]``) as the per-expert tensors the Hub
checkpoints hold, each read straight from its rows of the file.

Writing (:func:`write_sharded`) follows the same convention: one
``model.safetensors`` up to ``max_shard_bytes`` (5 GB by default, like
``save_pretrained``), else numbered shards plus the index JSON mapping
every tensor to its file.
"""

from __future__ import annotations

import json
import math
import pickle
import struct
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import safetensors
import torch

from hybrid.checkpoint import TensorSource
from hybrid.checkpoint.atomic import write_bytes_atomic
from hybrid.checkpoint.unreadable import read_error_detail
from hybrid.config.load import DuplicateKeyError, parse_json
from hybrid.convert.consolidate import ConversionError
from hybrid.convert.output import nbytes_of, read_ahead, write_safetensors_file
from hybrid.dtypes import DTYPE_OF_SAFETENSORS_CODE

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9


def read_json(path: Path) -> dict:
    try:
        return parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON ({e})") from None
    except DuplicateKeyError as e:
        raise ConversionError(f"{path}: {e}") from None


class HFDirectory:
    """The config and the tensors of a Hugging Face model directory, read lazily.

    ``get(name)`` returns a new CPU tensor; ``read_into(name, out)`` fills one.
    Safetensors weights are read with plain reads (no memory map); the memory
    maps of ``.bin`` files are closed after ``mmap_budget`` bytes were read
    through them, so the resident set stays bounded however large the files are.
    """

    def __init__(self, path, *, mmap_budget: int = 64 << 20):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"--input {self.path} is not a directory (expected a Hugging Face model "
                                  f"directory with config.json)")
        self.config: dict = read_json(self.path / "config.json")
        self._budget, self._touched = mmap_budget, 0
        self._bins: Dict[Path, dict] = {}
        self._handles: Dict[Path, object] = {}
        self._offsets: Dict[Path, Dict[str, Tuple[int, int]]] = {}
        self.files: Dict[str, Path] = self._discover()
        self._shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        for name, file in self.files.items():
            self._shapes[name] = self._describe(name, file)
        # alias name -> (stored tensor, first row of it viewed as [-1, last dim]); the stored tensors aliased
        # are read only through their aliases, and no longer listed by names()
        self._aliases: Dict[str, Tuple[str, int]] = {}
        self._hidden: set = set()

    def _discover(self) -> Dict[str, Path]:
        for index_name, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if (self.path / single).is_file():
                return {name: self.path / single for name in self._names_in(self.path / single)}
            if (self.path / index_name).is_file():
                weight_map = read_json(self.path / index_name).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ConversionError(f"{self.path / index_name} has no 'weight_map' object")
                files = {name: self.path / f for name, f in weight_map.items()}
                for f in sorted(set(files.values())):
                    if not f.is_file():
                        raise ConversionError(f"{f} is missing: {self.path / index_name} maps tensors to it")
                return files
        raise ConversionError(f"{self.path} holds no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} "
                              f"or {BIN_INDEX}")

    def _names_in(self, file: Path) -> List[str]:
        if file.suffix == ".safetensors":
            return list(self._handle(file).keys())
        return list(self._bin(file).keys())

    def _describe(self, name: str, file: Path) -> Tuple[Tuple[int, ...], torch.dtype]:
        if file.suffix == ".safetensors":
            try:
                sl = self._handle(file).get_slice(name)
            except Exception:  # noqa: BLE001 - the library raises its own error types
                raise ConversionError(f"{file} has no tensor {name!r}, which its index maps to it") from None
            code = sl.get_dtype()
            if code not in DTYPE_OF_SAFETENSORS_CODE:
                raise ConversionError(f"{file}: tensor {name!r} has unsupported dtype {code}")
            return tuple(sl.get_shape()), DTYPE_OF_SAFETENSORS_CODE[code]
        tensor = self._bin(file).get(name)
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"{file} has no tensor {name!r}, which its index maps to it")
        return tuple(tensor.shape), tensor.dtype

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safetensors.safe_open(str(file), framework="pt")
            except Exception as e:  # noqa: BLE001 - the library raises its own error types
                raise ConversionError(f"{file} is not a readable safetensors file ({read_error_detail(e)}); it is "
                                      f"truncated or damaged: download or save it again") from None
        return self._handles[file]

    def _bin(self, file: Path) -> dict:
        if file not in self._bins:
            try:
                try:
                    sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    sd = torch.load(file, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise ConversionError(f"{file} holds pickled objects other than tensors ({read_error_detail(e)}); "
                                      f"refused: it is read with weights_only=True, which never unpickles code. "
                                      f"Use the model's safetensors weights, or save a plain state dict of "
                                      f"tensors") from None
            except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, ...
                raise ConversionError(f"{file} is not a readable PyTorch weights file ({read_error_detail(e)}); it "
                                      f"is truncated or damaged: download or save it again") from None
            if not isinstance(sd, dict):
                raise ConversionError(f"{file} does not hold a state dict (got {type(sd).__name__})")
            self._bins[file] = sd
        return self._bins[file]

    # ---- access --------------------------------------------------------------------------------
    def names(self) -> List[str]:
        """The tensors as presented: stored ones, less those read through aliases, plus the aliases."""
        return [n for n in self.files if n not in self._hidden]

    def alias(self, name: str, stored: str, first_row: int = 0, shape: Optional[Tuple[int, ...]] = None) -> None:
        """Present rows ``[first_row, first_row + prod(shape[:-1]))`` of the stored tensor ``stored``, viewed as
        ``[-1, stored's last dim]``, as tensor ``name`` of ``shape`` (default: ``stored``'s own shape: a new name).

        ``shape[-1]`` must be ``stored``'s last dim: the rows are then contiguous in the file, and reading a run
        of ``name``'s rows reads those bytes alone. ``stored`` leaves :meth:`names` (it is read through its
        aliases); it stays readable under its own name.
        """
        full = self.shape(stored)
        shape = tuple(full if shape is None else shape)
        if stored in self._aliases:  # an alias of an alias: rows of the same stored tensor
            stored, first_row = self._aliases[stored][0], self._aliases[stored][1] + first_row
            full = self.shape(stored)
        rows = math.prod(shape[:-1])
        if not full or not shape or shape[-1] != full[-1] or first_row < 0 or \
                (first_row + rows) * full[-1] > math.prod(full):
            raise ConversionError(f"internal: {name} {list(shape)} is not rows from {first_row} of {stored} "
                                  f"{list(full)}")
        if name in self.files:
            raise ConversionError(f"{self.path} holds both {name} and {stored}, which stand for the same weights; "
                                  f"keep one")
        self.files[name] = self.files[stored]
        self._shapes[name] = (shape, self.dtype(stored))
        self._aliases[name] = (stored, first_row)
        self._hidden.add(stored)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._shapes[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._shapes[name][1]

    def get(self, name: str) -> torch.Tensor:
        """A new CPU tensor holding tensor ``name`` as stored."""
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (the tensor's shape; any dtype and strides) with tensor ``name``.

        A safetensors tensor of ``out``'s dtype, into a contiguous ``out``, is read from the file straight into
        it with plain reads: no memory map, whose touched pages would count as resident beside the copy, so
        the peak is the one copy. Otherwise through a temporary in the stored dtype.
        """
        if name not in self.files:
            raise ConversionError(f"{self.path} has no tensor {name!r}")
        file = self.files[name]
        if tuple(out.shape) != self.shape(name):
            raise ConversionError(f"internal: {name} has shape {list(self.shape(name))}, not {list(out.shape)}")
        if name in self._aliases:
            self.read_rows_into(name, 0, out.shape[0] if out.dim() else 1, out)
            return
        if file.suffix == ".safetensors":
            if out.dtype == self.dtype(name) and out.is_contiguous():
                self._read_safetensors(file, name, out)
            else:
                out.copy_(self.get(name))
            return
        # The .bin reader hands out views of a memory map, whose touched pages stay resident until it is
        # closed: copy, and close the maps every `budget` bytes (reopened on the next read).
        tensor = self._bin(file)[name]
        out.copy_(tensor)
        self._touched += tensor.numel() * tensor.element_size()
        if self._touched > self._budget:
            self._bins.clear()
            self._touched = 0

    def read_rows_into(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill ``out`` with rows ``[lo, hi)`` (dim 0) of tensor ``name``, reading only those rows where the
        file allows (safetensors, ``out`` contiguous in the stored dtype)."""
        file = self.files.get(name)
        if name in self._aliases:
            self._read_alias_rows(name, lo, hi, out)
        elif file is not None and file.suffix == ".safetensors" and out.dtype == self.dtype(name) \
                and out.is_contiguous() and tuple(out.shape) == (hi - lo,) + self.shape(name)[1:]:
            self._read_safetensors(file, name, out, lo, hi)
        else:
            out.copy_(self.get(name)[lo:hi])

    def _read_alias_rows(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Rows ``[lo, hi)`` of the alias ``name``: rows of its stored tensor viewed as ``[-1, last dim]``."""
        stored, first = self._aliases[name]
        shape, file = self.shape(name), self.files[name]
        per_row = math.prod(shape[1:-1]) if len(shape) > 1 else 1  # stored rows in one row of the alias
        a, b = first + lo * per_row, first + hi * per_row
        if tuple(out.shape) != (hi - lo,) + tuple(shape[1:]):
            raise ConversionError(f"internal: rows {lo}:{hi} of {name} {list(shape)} do not fit {list(out.shape)}")
        if file.suffix != ".safetensors":
            rows = self._bin(file)[stored].reshape(-1, shape[-1])[a:b]  # a view of the memory map
            out.copy_(rows.reshape(out.shape))
            self._touched += rows.numel() * rows.element_size()
            if self._touched > self._budget:
                self._bins.clear()
                self._touched = 0
            return
        direct = out.dtype == self.dtype(name) and out.is_contiguous()
        into = out if direct else torch.empty(out.shape, dtype=self.dtype(name))
        self._read_safetensors(file, stored, into, a, b, row_elems=shape[-1])
        if not direct:
            out.copy_(into)

    def _read_safetensors(self, file: Path, name: str, out: torch.Tensor, lo: int = 0,
                          hi: Optional[int] = None, row_elems: Optional[int] = None) -> None:
        """Read rows ``[lo, hi)`` (default: all) of ``name`` into the contiguous ``out`` of its dtype.

        A row is ``row_elems`` elements (default: ``prod(shape[1:])``, the rows of dim 0)."""
        start, end = self._data_offsets(file)[name]
        shape = self.shape(name)
        if row_elems is None:
            row = math.prod(shape[1:]) * out.element_size() if shape else out.element_size()
            rows = shape[0] if shape else 1
        else:
            row, rows = row_elems * out.element_size(), math.prod(shape) // row_elems
        hi = rows if hi is None else hi
        mine = out.reshape(-1).view(torch.uint8).numpy()  # a byte view of out's memory: the read fills out
        if end - start != rows * row or mine.nbytes != (hi - lo) * row:
            raise ConversionError(f"{file}: tensor {name!r} spans {end - start} bytes, but its shape and dtype take "
                                  f"{rows * row}; the file is damaged: download or save it again")
        start += lo * row
        view = memoryview(mine)
        with open(file, "rb") as f:
            f.seek(start)
            done = 0
            while done < len(view):  # one read returns at most ~2 GiB on Linux
                n = f.readinto(view[done:])
                if not n:
                    raise ConversionError(f"{file} ends inside tensor {name!r}; it is truncated: download or save "
                                          f"it again")
                done += n

    def _data_offsets(self, file: Path) -> Dict[str, Tuple[int, int]]:
        """Where each tensor's bytes lie in ``file`` (absolute offsets), from the safetensors header (already
        validated by ``safetensors.safe_open`` when the directory was opened)."""
        if file not in self._offsets:
            with open(file, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
            base = 8 + size
            self._offsets[file] = {k: (base + v["data_offsets"][0], base + v["data_offsets"][1])
                                   for k, v in header.items() if k != "__metadata__"}
        return self._offsets[file]

    def close(self) -> None:
        self._handles.clear()
        self._bins.clear()


def plan_shards(sizes: Sequence[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Cut tensors (in order) into files of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    if max_shard_bytes < 1:
        raise ConversionError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    shards: List[List[str]] = [[]]
    used = 0
    for name, n in sizes:
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def write_sharded(out_dir: Path, tensors: Mapping[str, TensorSource], max_shard_bytes: int) -> List[Path]:
    """Write ``tensors`` (in order) as HF safetensors weights; returns the files written."""
    sizes = [(name, nbytes_of(t.shape, t.dtype)) for name, t in tensors.items()]
    shards = plan_shards(sizes, max_shard_bytes)
    names = [SAFETENSORS] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    _remove_stale_weights(out_dir, keep=set(names))
    for file, members in zip(names, shards):
        with read_ahead({n: tensors[n] for n in members}) as sources:
            write_safetensors_file(out_dir / file, sources, {"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(n for _, n in sizes)},
                 "weight_map": {n: f for f, members in zip(names, shards) for n in members}}
        write_bytes_atomic(out_dir / SAFETENSORS_INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return [out_dir / f for f in names]


def _remove_stale_weights(out_dir: Path, keep: set) -> None:
    # A weights file left by an earlier export would shadow or contradict the new one.
    for entry in out_dir.iterdir():
        stale = (entry.name.startswith("model") and entry.name.endswith(".safetensors")) or \
            entry.name in (SAFETENSORS_INDEX, BIN, BIN_INDEX) or \
            (entry.name.startswith("pytorch_model") and entry.name.endswith(".bin"))
        if stale and entry.name not in keep and entry.is_file():
            entry.unlink()
