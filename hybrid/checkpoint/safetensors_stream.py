"""Stream a safetensors file one tensor at a time.

The ``safetensors`` library builds a whole file in memory (``save``) or writes
it from Rust where the bytes cannot be hashed on the way (``save_file``). A TP
shard of a large model can be several GB, and offline conversion must keep
its peak memory well below the model size, so this module writes the same
format incrementally: the header is computed from shapes and dtypes alone,
then each tensor is produced, moved to the CPU, written and dropped.

Reading stays with the ``safetensors`` library (``safe_open`` /
``load_file``), which validates the header against the data.

Format (little-endian): an 8-byte unsigned header length ``N``; ``N`` bytes of
UTF-8 JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (offsets relative to the data section) plus an optional
``"__metadata__"`` map of strings to strings, padded with spaces to a multiple
of 8 bytes; then the raw tensor bytes, back to back in offset order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from hybrid.checkpoint.errors import CheckpointFormatError
from hybrid.dtypes import SAFETENSORS_CODES

_HEADER_ALIGN = 8
_METADATA_KEY = "__metadata__"


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """A tensor produced on demand, so a writer holds one tensor at a time.

    ``produce()`` must return a tensor of exactly ``shape`` and ``dtype`` (on
    any device); it is called once, when the tensor's bytes are written.
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


TensorLike = Union[torch.Tensor, TensorSource]


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    source: TensorLike

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _entries(tensors: Mapping[str, TensorLike]) -> List[_Entry]:
    entries = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointFormatError(f"tensor names must be non-empty strings, got {name!r}")
        if name == _METADATA_KEY:
            raise CheckpointFormatError(f"{_METADATA_KEY!r} is reserved by the safetensors format; "
                                        f"rename that tensor")
        if isinstance(value, TensorSource):
            shape, dtype = tuple(int(s) for s in value.shape), value.dtype
        elif isinstance(value, torch.Tensor):
            shape, dtype = tuple(value.shape), value.dtype
        else:
            raise CheckpointFormatError(f"tensor {name!r}: expected a torch.Tensor or TensorSource, "
                                        f"got {type(value).__name__}")
        if dtype not in SAFETENSORS_CODES:
            raise CheckpointFormatError(
                f"tensor {name!r} has dtype {dtype}, which safetensors cannot store here; supported: "
                f"{', '.join(str(d) for d in SAFETENSORS_CODES)}")
        entries.append(_Entry(name, shape, dtype, value))
    # Larger element sizes first: every tensor then starts at a multiple of its
    # own element size (the header is padded to 8), so readers can map it
    # without copying. Ties go by name, the order the safetensors library
    # itself writes, so both produce the same bytes.
    entries.sort(key=lambda e: (-e.dtype.itemsize, e.name))
    return entries


def _header_bytes(entries: Sequence[_Entry], metadata: Optional[Mapping[str, str]]) -> bytes:
    header: Dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise CheckpointFormatError(f"safetensors metadata must map strings to strings; "
                                        f"offending keys: {bad}")
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return encoded + b" " * (-len(encoded) % _HEADER_ALIGN)


def _tensor_bytes(entry: _Entry):
    source = entry.source
    tensor = source.produce() if isinstance(source, TensorSource) else source
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        raise CheckpointFormatError(
            f"tensor {entry.name!r}: produced shape {tuple(tensor.shape)} dtype {tensor.dtype}, "
            f"but its TensorSource declared shape {entry.shape} dtype {entry.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # A byte view of the CPU tensor: no further copy on the way to the file.
    return flat.view(torch.uint8).numpy()


def write_safetensors(out, tensors: Mapping[str, TensorLike],
                      metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``tensors`` in safetensors format to ``out`` (anything with ``write``).

    Tensors may live on any device and need not be contiguous; each is copied
    to the CPU only while it is written. Returns the number of bytes written.
    """
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise CheckpointFormatError("safetensors files are little-endian; this host is big-endian")
    entries = _entries(tensors)
    header = _header_bytes(entries, metadata)
    out.write(struct.pack("<Q", len(header)))
    out.write(header)
    total = 8 + len(header)
    for entry in entries:
        if entry.nbytes:
            out.write(_tensor_bytes(entry))
            total += entry.nbytes
        elif isinstance(entry.source, TensorSource):
            _tensor_bytes(entry)  # still check the declared shape of an empty tensor
    return total
