"""The one dtype table: each training precision's torch dtype and byte size, and the names file formats give dtypes.

The precision names and the torch dtype each runs in are plain data in
:data:`hybrid.layout.PRECISION_DTYPES`, so configuration code reads them
without torch; this module adds what needs torch. Everything else reads these:

* :data:`DTYPES`: precision name (``fp32``/``bf16``/``fp16``) -> torch dtype;
  :data:`PRECISION_OF_DTYPE` the reverse;
* :data:`DTYPE_BYTES`: precision name -> bytes per element (torch's ``itemsize``);
* :data:`HF_DTYPE_NAMES`: torch dtype -> the name a Hugging Face ``config.json``
  gives it (``torch_dtype``: torch's own attribute name, ``"bfloat16"``);
* :data:`SAFETENSORS_CODES`: torch dtype -> the code a safetensors header gives it
  (``"BF16"``), for every dtype hybrid writes or reads in that format;
  :data:`DTYPE_OF_SAFETENSORS_CODE` the reverse.

The bytes per element of any other dtype are ``dtype.itemsize``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

from hybrid.layout import PRECISION_DTYPES

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {precision: getattr(torch, name) for precision, name in PRECISION_DTYPES.items()})
PRECISION_OF_DTYPE: Mapping[torch.dtype, str] = MappingProxyType({d: p for p, d in DTYPES.items()})
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({p: d.itemsize for p, d in DTYPES.items()})
HF_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {DTYPES[precision]: name for precision, name in PRECISION_DTYPES.items()})

# The safetensors format's names (its header's "dtype"); the test checks them against the safetensors library.
SAFETENSORS_CODES: Mapping[torch.dtype, str] = MappingProxyType({
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
})
DTYPE_OF_SAFETENSORS_CODE: Mapping[str, torch.dtype] = MappingProxyType(
    {code: d for d, code in SAFETENSORS_CODES.items()})


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s precision name when it is one of :data:`DTYPES`, else torch's name (for messages)."""
    return PRECISION_OF_DTYPE.get(dtype, str(dtype))
