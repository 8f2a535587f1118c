import io

import pytest
import safetensors
import safetensors.torch
import torch

from hybrid.checkpoint import CheckpointFormatError, TensorSource, write_safetensors


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "b16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "h16": torch.randn(7, generator=g).to(torch.float16),
        "d": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "idx": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "i32": torch.arange(5, dtype=torch.int32),
        "u8": torch.arange(6, dtype=torch.uint8),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
    }


def test_bytes_identical_to_the_safetensors_library():
    # Model weights (one floating dtype per file, plus maybe fp32 norms) come out
    # byte for byte as the library writes them; with many dtypes only the order
    # of tensors inside the data section may differ (see the read-back test).
    g = torch.Generator().manual_seed(0)
    tensors = {"z.weight": torch.randn(4, 6, generator=g), "a.bias": torch.randn(6, generator=g),
               "m.weight": torch.randn(3, 3, generator=g).to(torch.bfloat16),
               "b.weight": torch.randn(5, generator=g).to(torch.bfloat16)}
    out = io.BytesIO()
    n = write_safetensors(out, tensors)
    assert out.getvalue() == safetensors.torch.save(tensors)
    assert n == len(out.getvalue())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-exact comparison, NaN-safe, any dtype)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_library_reads_tensors_and_metadata_back(tmp_path):
    tensors = _mixed_tensors()
    tensors["transposed"] = torch.randn(4, 6).t()  # non-contiguous input
    tensors["param"] = torch.nn.Parameter(torch.randn(3))  # requires grad
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, tensors, {"format": "pt", "tp_rank": "1"})
    loaded = safetensors.torch.load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(_bits(loaded[name]), _bits(t)), name
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "tp_rank": "1"}


def test_tensor_sources_are_produced_once_each_in_write_order():
    produced = []

    def source(name, shape, dtype):
        def make():
            produced.append(name)
            return torch.full(shape, float(len(produced)), dtype=dtype)
        return TensorSource(shape, dtype, make)

    tensors = {"a": source("a", (2, 3), torch.float32), "b": source("b", (4,), torch.float64),
               "c": source("c", (5,), torch.bfloat16)}
    out = io.BytesIO()
    write_safetensors(out, tensors)
    assert produced == ["b", "a", "c"]  # 8-byte elements first, then 4, then 2
    loaded = safetensors.torch.load(out.getvalue())
    assert torch.equal(loaded["b"], torch.full((4,), 1.0, dtype=torch.float64))
    assert torch.equal(loaded["a"], torch.full((2, 3), 2.0))


def test_source_that_breaks_its_promise_is_named():
    bad = TensorSource((2, 2), torch.float32, lambda: torch.zeros(3))
    with pytest.raises(CheckpointFormatError, match=r"'w'.*declared shape \(2, 2\)"):
        write_safetensors(io.BytesIO(), {"w": bad})


@pytest.mark.parametrize("tensors,message", [
    ({"z": torch.zeros(2, dtype=torch.complex64)}, "dtype torch.complex64"),
    ({"__metadata__": torch.zeros(2)}, "reserved"),
    ({"": torch.zeros(2)}, "non-empty strings"),
    ({"x": [1, 2]}, "expected a torch.Tensor"),
])
def test_bad_tensors_rejected(tensors, message):
    with pytest.raises(CheckpointFormatError, match=message):
        write_safetensors(io.BytesIO(), tensors)


def test_metadata_must_be_strings():
    with pytest.raises(CheckpointFormatError, match="strings to strings"):
        write_safetensors(io.BytesIO(), {"x": torch.zeros(1)}, {"tp_rank": 1})
