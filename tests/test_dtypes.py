"""The one dtype table (:mod:`hybrid.dtypes`, over :data:`hybrid.layout.PRECISION_DTYPES`) and who reads it.

* The precision names are listed in exactly one module, ``hybrid/layout.py``,
  and the tables that pair torch dtypes with names (precision, Hugging Face,
  safetensors) are written in exactly one, ``hybrid/dtypes.py``: a source scan
  of ``hybrid/``, ``model_zoo/`` and ``tools/``.
* ``hybrid.convert`` does not import the engine: no import statement of any of
  its modules (``TYPE_CHECKING`` blocks and function bodies included) names
  ``hybrid.engine``, and importing every one of them loads no ``hybrid.engine``
  module.
* The table's entries agree with torch and with the safetensors library.
"""

from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

from hybrid import dtypes
from hybrid.layout import PRECISION_DTYPES, PRECISIONS

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("hybrid", "model_zoo", "tools")
NAMES_HOME = "hybrid/layout.py"
TABLE_HOME = "hybrid/dtypes.py"
_TORCH_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


def _sources() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


def _trees():
    for path in _sources():
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _strings(nodes) -> List[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _is_torch_dtype(node) -> bool:
    """``torch.<dtype>`` written out (``torch.bfloat16``)."""
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
            and node.attr in _TORCH_DTYPES)


def _lists_the_precisions(node) -> bool:
    """A tuple, list, set or dict display holding every precision name as an element or key."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set(PRECISIONS) <= set(_strings(node.elts))
    if isinstance(node, ast.Dict):
        return set(PRECISIONS) <= set(_strings([k for k in node.keys if k is not None]))
    return False


def _names_a_torch_dtype(node) -> bool:
    """A dict display pairing a written-out torch dtype with a string (either way round)."""
    if not isinstance(node, ast.Dict):
        return False
    return any((_is_torch_dtype(k) and isinstance(v, ast.Constant) and isinstance(v.value, str))
               or (_is_torch_dtype(v) and isinstance(k, ast.Constant) and isinstance(k.value, str))
               for k, v in zip(node.keys, node.values))


def test_the_precision_names_are_listed_in_one_module():
    where = sorted({name for name, tree in _trees() for node in ast.walk(tree) if _lists_the_precisions(node)})
    assert where == [NAMES_HOME], (
        f"the precision names {PRECISIONS} are listed in {where}; list them only in {NAMES_HOME} "
        f"(PRECISION_DTYPES) and read them from there or from hybrid.dtypes")


def test_torch_dtypes_are_named_in_one_module():
    where = sorted({name for name, tree in _trees() for node in ast.walk(tree) if _names_a_torch_dtype(node)})
    assert where == [TABLE_HOME], (
        f"tables naming torch dtypes (precision, Hugging Face or safetensors names) are written in {where}; "
        f"write them only in {TABLE_HOME} and read them from there")


def _convert_imports() -> Iterator[tuple]:
    for path in sorted((ROOT / "hybrid" / "convert").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path.name, alias.name
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path.name, node.module
                for alias in node.names:
                    yield path.name, f"{node.module}.{alias.name}"


def test_convert_imports_no_engine_module():
    found = sorted({(file, name) for file, name in _convert_imports()
                    if name == "hybrid.engine" or name.startswith("hybrid.engine.")})
    assert found == [], f"hybrid/convert imports the engine: {found}; read what it needs from hybrid.dtypes"


def test_importing_every_convert_module_loads_no_engine_module():
    modules = [f"hybrid.convert.{p.stem}" for p in sorted((ROOT / "hybrid" / "convert").glob("*.py"))
               if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'hybrid.engine' or m.startswith('hybrid.engine.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"importing hybrid.convert loads {out.stdout.strip()}"


def test_each_precision_has_its_torch_dtype_size_and_hf_name():
    assert tuple(dtypes.DTYPES) == PRECISIONS
    assert dict(dtypes.DTYPES) == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for precision, dtype in dtypes.DTYPES.items():
        assert dtypes.PRECISION_OF_DTYPE[dtype] == precision
        assert dtypes.DTYPE_BYTES[precision] == torch.empty((), dtype=dtype).element_size()
        # Hugging Face's config.json names a dtype by torch's attribute, which transformers looks up
        assert getattr(torch, dtypes.HF_DTYPE_NAMES[dtype]) is dtype
        assert dtypes.HF_DTYPE_NAMES[dtype] == PRECISION_DTYPES[precision]
    assert dtypes.dtype_name(torch.bfloat16) == "bf16" and dtypes.dtype_name(torch.int8) == "torch.int8"


@pytest.mark.parametrize("dtype", list(dtypes.SAFETENSORS_CODES), ids=str)
def test_safetensors_codes_are_the_librarys(dtype):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    data = safetensors_torch.save({"t": torch.zeros(3, dtype=dtype)})
    (length,) = struct.unpack("<Q", data[:8])
    code = json.loads(data[8:8 + length])["t"]["dtype"]
    assert dtypes.SAFETENSORS_CODES[dtype] == code
    assert dtypes.DTYPE_OF_SAFETENSORS_CODE[code] is dtype
    assert safetensors_torch.load(data)["t"].dtype is dtype


def test_the_tables_are_read_only():
    with pytest.raises(TypeError):
        dtypes.DTYPES["fp8"] = torch.float8_e4m3fn  # type: ignore[index]
