"""Blockwise quantization (hybrid.kernels.quantize): format, error bound, non-finite
semantics, ordered sums, error feedback; the CUDA kernels' compile check here, their bit
identity with the torch path on a GPU."""

from __future__ import annotations

import math
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid.kernels import quantize as Q
from hybrid.kernels.ops import find_nvcc

FORMATS = [(8, 256), (8, 64), (4, 256), (4, 6), (1, 256), (1, 24), (1, 8)]
FORMAT_IDS = [f"b{b}-blk{n}" for b, n in FORMATS]


def roundtrip(x, bits, block, **kw):
    k = x.shape[-1]
    return Q.unpack(Q.pack(x, bits, block, **kw), k, bits, block, **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit where finite (so -0.0 != +0.0), NaN at the same places."""
    a, b = a.float(), b.float()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    return torch.equal(a.masked_fill(nan_a, 0).view(torch.int32), b.masked_fill(nan_b, 0).view(torch.int32))


def numpy_reference(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """The format written out a second time, block by block in numpy (float32 throughout)."""
    rows, k = x.shape
    nb = -(-k // block)
    out = np.empty((rows, nb * block), np.float32)
    for r in range(rows):
        for b in range(nb):
            real = x[r, b * block:(b + 1) * block].astype(np.float32)
            v = np.zeros(block, np.float32)
            v[:real.size] = real
            a = np.float32(np.abs(v).max())
            if not np.isfinite(a):
                out[r, b * block:(b + 1) * block] = np.nan
                continue
            safe = a if a > 0 else np.float32(1)
            if bits == 1:
                width = 1 << (block - 1).bit_length()
                t = np.zeros(width, np.float32)
                t[:block] = np.abs(v) / safe
                while t.size > 1:
                    t = t[:t.size // 2] + t[t.size // 2:]
                s = (t[0] / np.float32(real.size)) * a
                out[r, b * block:(b + 1) * block] = np.where(v >= 0, s, -s)
            else:
                qmax = np.float32(Q.QMAX[bits])
                q = np.rint((v / safe) * qmax).astype(np.int8).astype(np.float32)  # an integer: no -0
                out[r, b * block:(b + 1) * block] = (q / qmax) * a
    return out[:, :k]


# ------------------------------------------------------------------ format --

def test_wire_bytes_matches_pack_and_meets_the_ratios():
    for bits, block in FORMATS:
        for k in (0, 1, block - 1, block, block + 1, 4099):
            wire = Q.pack(torch.randn(3, k), bits, block)
            assert wire.dtype == torch.uint8 and wire.shape == (3, Q.wire_bytes(k, bits, block))
            assert Q.wire_bytes(k, bits, block) == math.ceil(k / block) * (block * bits // 8 + 4)
    fp32 = 4096 * 4
    assert Q.wire_bytes(4096, 8, 256) / fp32 <= 0.27
    assert Q.wire_bytes(4096, 4, 256) / fp32 <= 0.15
    assert Q.wire_bytes(4096, 1, 256) / fp32 <= 0.04
    assert Q.DEFAULT_BLOCK == 256 and Q.BITS == (8, 4, 1)


def test_byte_layout_int8_int4_and_1bit():
    x = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.0, 3e-3, -0.75, 0.125])
    # int8: two's complement q = rint(x / 1 * 127), then the little-endian fp32 absmax.
    w8 = Q.pack(x, 8, 8)[0]
    q8 = [127, -127, 64, -32, 0, 0, -95, 16]  # 63.5 -> 64 (even), -31.75 -> -32, 0.381 -> 0, -95.25 -> -95, 15.875
    assert w8[:8].view(torch.int8).tolist() == q8
    assert bytes(w8[8:].tolist()) == struct.pack("<f", 1.0)
    # int4: q = rint(x * 7) = [7, -7, 4 (3.5 ties to even), -2, 0, 0, -5, 1]; element 2i low nibble.
    w4 = Q.pack(x, 4, 8)[0]
    nibbles = [7, -7, 4, -2, 0, 0, -5, 1]
    expect = [(lo & 15) | ((hi & 15) << 4) for lo, hi in zip(nibbles[0::2], nibbles[1::2])]
    assert w4[:4].tolist() == expect and bytes(w4[4:].tolist()) == struct.pack("<f", 1.0)
    # 1-bit: bit j of byte i is element 8i+j, set when x >= 0 (so -0.0 counts as non-negative).
    # Scale = mean |x| = 15 / 8, computed as (sum(|x| / 4) / 8) * 4 (exact for these values).
    w1 = Q.pack(torch.tensor([1.0, -1.0, -0.0, -2.0, 4.0, 0.0, -3.0, -4.0]), 1, 8)[0]
    assert w1[0].item() == 0b00110101
    assert bytes(w1[1:].tolist()) == struct.pack("<f", 15.0 / 8)
    # Each row stands alone: packing rows separately gives the same bytes.
    xs = torch.randn(3, 300)
    for bits, block in FORMATS:
        wire = Q.pack(xs, bits, block)
        for r in range(3):
            assert torch.equal(wire[r], Q.pack(xs[r], bits, block)[0])


@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
def test_matches_an_independent_numpy_implementation(bits, block):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2 * block + 5, generator=gen) * torch.logspace(-3, 3, 2 * block + 5)
    got = roundtrip(x, bits, block)
    assert same_bits(got, torch.from_numpy(numpy_reference(x.numpy(), bits, block)))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="bits"):
        Q.pack(torch.zeros(8), 2, 8)
    with pytest.raises(ValueError, match="even"):
        Q.wire_bytes(10, 4, 7)
    with pytest.raises(ValueError, match="multiple of 8"):
        Q.pack(torch.zeros(8), 1, 12)
    with pytest.raises(ValueError, match="packs to"):
        Q.unpack(Q.pack(torch.zeros(2, 10), 8, 8), 17, 8, 8)
    with pytest.raises(TypeError, match="uint8"):
        Q.unpack(torch.zeros(2, 20), 8, 8, 8)
    with pytest.raises(ValueError, match="out must be"):
        Q.unpack(Q.pack(torch.zeros(2, 10), 8, 8), 10, 8, 8, out=torch.empty(2, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        Q.unpack_sum(Q.pack(torch.zeros(2, 10), 8, 8), 10, 8, 8, out=torch.empty(11))


# ------------------------------------------------------------- error bound --

@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e5, 1e30])
def test_round_trip_is_within_the_error_bound(bits, block, scale):
    gen = torch.Generator().manual_seed(0)
    k = 3 * block + block // 2 + 1  # a partial last block
    if bits == 4 and k % 2 == 0:
        k += 1
    x = torch.randn(4, k, generator=gen) * scale
    x[1] *= torch.rand(k, generator=gen) ** 4  # skewed magnitudes within blocks
    y = roundtrip(x, bits, block)
    assert y.shape == (4, k) and y.dtype == torch.float32 and torch.isfinite(y).all()
    err = (y.double() - x.double()).abs()
    bound = Q.error_bound(x, bits, block)
    assert bound.shape == x.shape and bound.dtype == torch.float32
    assert (err <= bound.double()).all(), (err - bound.double()).max()
    if bits != 1:  # the bound is half a step, not a loose multiple of it
        absmax = Q.pack(x, bits, block)  # recover the block scales from the wire
        scales = absmax[:, Q.data_bytes(k, bits, block):].clone(memory_format=torch.contiguous_format).view(torch.float32)
        step = scales.double().repeat_interleave(block, dim=1)[:, :k] / Q.QMAX[bits]
        assert (bound.double() <= 0.5 * step * (1 + 1e-4) + 2.0 ** -149).all()
        assert err.max() >= 0.3 * (0.5 * step).max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", Q.BITS)
def test_half_inputs_quantize_their_fp32_values(dtype, bits):
    x = torch.randn(2, 1000).to(dtype)
    y = roundtrip(x, bits, 256)
    assert same_bits(y, roundtrip(x.float(), bits, 256))
    assert ((y.double() - x.double()).abs() <= Q.error_bound(x, bits, 256).double()).all()
    assert torch.equal(Q.pack(x, bits, 256), Q.pack(x.float(), bits, 256))


# --------------------------------------------------------- adversarial blocks --

@pytest.mark.parametrize("bits", Q.BITS)
def test_equal_magnitudes_round_trip_exactly(bits):
    x = torch.full((2, 512), 0.3)
    x[1] = -7.0e-39  # a denormal block with equal magnitudes
    x[0, 256:] = -1e30
    x[0, 256::3] = 1e30  # mixed signs, equal magnitude
    y = roundtrip(x, bits, 256)
    assert torch.equal(y, x)


def test_one_huge_outlier_is_exact_and_the_rest_stay_in_bound():
    x = torch.randn(1, 768)
    x[0, 300] = 3e35
    for bits in (8, 4):
        y = roundtrip(x, bits, 256)
        assert y[0, 300] == x[0, 300]  # q = qmax: exact
        assert (y[0, 256:512].double() - x[0, 256:512].double()).abs().max() <= Q.error_bound(x, bits, 256)[0, 256]
        # the outlier's block swamps its neighbours to zero; the other blocks do not notice it
        assert (y[0, 256:512] == 0).sum() == 255
        assert torch.equal(y[0, :256], roundtrip(x[:, :256], bits, 256)[0])
        assert torch.equal(y[0, 512:], roundtrip(x[:, 512:], bits, 256)[0])


@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
def test_zero_blocks_are_exact_zeros(bits, block):
    x = torch.zeros(2, 3 * block + 3)
    x[1, block:2 * block] = torch.randn(block)
    x[0, :block] = -0.0
    wire = Q.pack(x, bits, block)
    y = Q.unpack(wire, x.shape[1], bits, block)
    assert torch.isfinite(y).all()
    assert (y[0] == 0).all() and (y[1, :block] == 0).all() and (y[1, 2 * block:] == 0).all()
    scales = wire[:, Q.data_bytes(x.shape[1], bits, block):].clone(memory_format=torch.contiguous_format).view(torch.float32)
    assert scales[0].tolist() == [0.0] * 4
    if bits != 1:  # q = 0 everywhere: zero bytes (1-bit sets the sign bits of +-0)
        assert (wire[0, :Q.data_bytes(x.shape[1], bits, block)] == 0).all()


@pytest.mark.parametrize("bits", Q.BITS)
def test_denormal_and_near_max_blocks_stay_finite(bits):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1024, generator=gen)
    x[0, :256] *= 1e-40                                # denormal
    x[0, 256:512] = torch.randn(256, generator=gen).sign() * 2.0 ** -149 * torch.randint(1, 9, (256,), generator=gen)
    x[0, 512:768] = torch.randn(256, generator=gen).clamp(-1, 1) * 3.4e38  # near FLT_MAX
    x[0, 768:] = 3.4e38                                # sum(|x|) would overflow fp32
    y = roundtrip(x, bits, 256)
    assert torch.isfinite(y).all()
    assert ((y.double() - x.double()).abs() <= Q.error_bound(x, bits, 256).double()).all()
    if bits == 1:
        assert y[0, 800].item() == pytest.approx(3.4e38, rel=1e-6)


@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["+inf", "-inf", "nan"])
def test_a_non_finite_value_turns_its_block_into_nan_only(bits, block, bad):
    gen = torch.Generator().manual_seed(4)
    k = 4 * block - 1
    x = torch.randn(2, k, generator=gen)
    clean = x.clone()
    x[0, block + 3] = bad      # a full block
    x[1, k - 1] = bad          # the partial last block
    wire = Q.pack(x, bits, block)
    y = Q.unpack(wire, k, bits, block)
    assert torch.isnan(y[0, block:2 * block]).all() and torch.isnan(y[1, 3 * block:]).all()
    ok = torch.ones_like(x, dtype=torch.bool)
    ok[0, block:2 * block] = False
    ok[1, 3 * block:] = False
    assert torch.equal(y[ok], roundtrip(clean, bits, block)[ok])  # other blocks unaffected
    scales = wire[:, Q.data_bytes(k, bits, block):].clone(memory_format=torch.contiguous_format).view(torch.float32)
    assert torch.isnan(scales[0, 1]) and torch.isnan(scales[1, 3]) and torch.isfinite(scales[0, [0, 2, 3]]).all()
    bpb = Q.block_bytes(bits, block)
    assert (wire[0, bpb:2 * bpb] == 0).all()  # data of a bad block is zero
    assert torch.isinf(Q.error_bound(x, bits, block)[0, block:2 * block]).all()
    # the NaN survives the reduction, whatever the other ranks sent
    s = Q.unpack_sum(wire, k, bits, block, torch.empty(k, dtype=torch.bfloat16))
    assert torch.isnan(s[block:2 * block]).all() and torch.isnan(s[3 * block:]).all()
    assert torch.isfinite(s[:block]).all()


# ------------------------------------------------------------------ sums --

@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_unpack_sum_is_the_ordered_fp32_sum_of_the_rows(bits, block, out_dtype):
    gen = torch.Generator().manual_seed(5)
    k = 5 * block + 7
    x = torch.randn(4, k, generator=gen) * torch.tensor([1e-3, 1.0, 1e3, 7.0])[:, None]
    wire = Q.pack(x, bits, block)
    rows = Q.unpack(wire, k, bits, block)
    want = rows[0].clone()
    for r in range(1, 4):
        want = want + rows[r]
    out = torch.full((k,), float("nan"), dtype=out_dtype)
    got = Q.unpack_sum(wire, k, bits, block, out)
    assert got is out and same_bits(got, want.to(out_dtype))
    # the order is part of the contract: another order gives other bits somewhere
    reverse = rows[3] + rows[2] + rows[1] + rows[0]
    if out_dtype == torch.float32 and bits != 1:
        assert not torch.equal(reverse, want)
    assert same_bits(Q.unpack_sum(wire[:1], k, bits, block, torch.empty(k)), rows[0])


def test_unpack_into_out_and_strided_out():
    x = torch.randn(3, 1001)
    wire = Q.pack(x, 8, 256)
    out = torch.full((3, 1001), float("nan"))
    assert Q.unpack(wire, 1001, 8, 256, out=out) is out
    assert torch.equal(out, Q.unpack(wire, 1001, 8, 256))
    wide = torch.full((1001, 3), float("nan")).t()  # non-contiguous [3, 1001]
    Q.unpack(wire, 1001, 8, 256, out=wide)
    assert torch.equal(wide, out)
    strided = torch.zeros(2002)[::2]
    Q.unpack_sum(wire, 1001, 8, 256, strided)
    assert torch.equal(strided, out[0] + out[1] + out[2])
    assert torch.equal(Q.unpack_sum(wire[:0], 1001, 8, 256, torch.ones(1001)), torch.zeros(1001))


def test_torch_path_is_deterministic():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 10_000, generator=gen)
    for bits in Q.BITS:
        w1, w2 = Q.pack(x, bits, 256), Q.pack(x.clone(), bits, 256)
        assert torch.equal(w1, w2)
        assert torch.equal(Q.unpack(w1, 10_000, bits, 256), Q.unpack(w2, 10_000, bits, 256))
        s1 = Q.unpack_sum(w1, 10_000, bits, 256, torch.empty(10_000))
        s2 = Q.unpack_sum(w2, 10_000, bits, 256, torch.empty(10_000))
        assert torch.equal(s1, s2)


@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
def test_cpu_chunking_does_not_change_the_bits(monkeypatch, bits, block):
    gen = torch.Generator().manual_seed(8)
    k = 11 * block + 5
    x = torch.randn(3, k, generator=gen) * torch.logspace(-5, 5, k)
    x[2, 4 * block + 1] = math.nan
    monkeypatch.setattr(Q, "CPU_CHUNK", 0)  # one step
    wire = Q.pack(x, bits, block)
    rows = Q.unpack(wire, k, bits, block)
    total = Q.unpack_sum(wire, k, bits, block, torch.empty(k))
    half = Q.unpack_sum(wire, k, bits, block, torch.empty(k, dtype=torch.bfloat16))
    for chunk in (1, 3 * block, 2 * 3 * block + 1):
        monkeypatch.setattr(Q, "CPU_CHUNK", chunk)
        assert torch.equal(Q.pack(x, bits, block), wire)
        assert same_bits(Q.unpack(wire, k, bits, block), rows)
        assert same_bits(Q.unpack_sum(wire, k, bits, block, torch.empty(k)), total)
        assert same_bits(Q.unpack_sum(wire, k, bits, block, torch.empty(k, dtype=torch.bfloat16)), half)


# -------------------------------------------------------- error feedback --

def test_one_bit_error_feedback_recovers_the_mean():
    """Acceptance: with e_{t+1} = (x + e_t) - deq(pack(x + e_t)), the running mean of the
    dequantized values over 200 steps matches x's mean within 1e-3 of max|x|.

    Per element the running mean converges too, but at rate O(block / T): sum_t deq_t =
    T x - e_T exactly, and |e_T| saturates near block-many times |x| (measured: 0.02 of max|x|
    per element after 200 steps with block 8, 0.38 with block 256; see docs/compression.md)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4096, generator=gen)
    for block, per_element in ((256, None), (8, 0.05)):
        e = torch.zeros_like(x)
        total = torch.zeros(4096, dtype=torch.float64)
        for _ in range(200):
            y = x + e
            d = Q.unpack(Q.pack(y, 1, block), 4096, 1, block)[0]
            e = y - d
            total += d.double()
        running = total / 200
        scale = x.abs().max().item()
        assert abs(running.mean().item() - x.double().mean().item()) <= 1e-3 * scale
        # the telescoping identity that makes error feedback unbiased
        assert torch.allclose(total, 200 * x.double() - e.double(), rtol=0, atol=1e-2 * scale)
        if per_element is not None:
            assert (running - x.double()).abs().max() <= per_element * scale


# ------------------------------------------------------------ kernel glue --

class StandInQuantOp:
    """The cuda_quantize op's contract (preallocated outputs, contiguous inputs) in torch."""

    def __init__(self):
        self.calls = []

    def pack(self, x, wire, bits, block, stream):
        assert x.is_contiguous() and x.dim() == 2 and wire.shape == (x.shape[0], Q.wire_bytes(x.shape[1], bits, block))
        self.calls.append("pack")
        wire.copy_(Q.pack(x, bits, block, use_kernel=False))

    def unpack(self, wire, out, k, bits, block, stream):
        assert wire.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
        self.calls.append("unpack")
        Q.unpack(wire, k, bits, block, out=out, use_kernel=False)

    def unpack_sum(self, wire, out, k, bits, block, stream):
        assert wire.is_contiguous() and out.is_contiguous() and out.shape == (k,)
        self.calls.append("unpack_sum")
        Q.unpack_sum(wire, k, bits, block, out, use_kernel=False)


def test_wrappers_call_the_op_with_its_contract(monkeypatch):
    op = StandInQuantOp()
    monkeypatch.setattr(Q, "_cuda_op", lambda t, bits, block, use_kernel: op if use_kernel else None)
    x = torch.randn(1001, 3).t()  # non-contiguous input
    wire = Q.pack(x, 4, 256)
    assert torch.equal(wire, Q.pack(x, 4, 256, use_kernel=False))
    strided = torch.empty(1001, 3).t()
    Q.unpack(wire, 1001, 4, 256, out=strided)
    assert torch.equal(strided, Q.unpack(wire, 1001, 4, 256, use_kernel=False))
    s = Q.unpack_sum(wire, 1001, 4, 256, torch.empty(2002)[::2])
    assert torch.equal(s, Q.unpack_sum(wire, 1001, 4, 256, torch.empty(1001), use_kernel=False))
    assert op.calls == ["pack", "unpack", "unpack_sum"]


def test_cpu_tensors_never_ask_the_registry(monkeypatch):
    import hybrid.kernels.quantize as mod

    monkeypatch.setattr(mod, "default_registry", lambda: pytest.fail("registry consulted for a CPU tensor"))
    Q.unpack_sum(Q.pack(torch.randn(2, 100), 8, 64), 100, 8, 64, torch.empty(100))


def test_the_op_is_registered():
    from hybrid.kernels.ops import ALL_OPS

    spec = ALL_OPS["cuda_quantize"]
    assert spec.device == "cuda" and "cuda/quantize.cu" in spec.sources and "-fmad=false" in spec.extra_cuda_cflags
    for rel in spec.sources:
        assert (Path(__file__).resolve().parents[2] / "csrc" / rel).is_file()


# --------------------------------------------------------------- nvcc --

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "cuda"


@pytest.mark.slow
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_quantize_binding_links_and_imports():
    """The binding and the launchers agree (link with --no-undefined, then import).

    About 45 s on two idle cores (2 min on busy ones), mostly torch's headers."""
    from hybrid.kernels import cuda_check as cc

    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        objects = []
        for name in ("quantize.cu", "status.cu"):
            obj = out / f"{name}.o"
            result = cc._run(cc.nvcc_command(nvcc, CSRC / name, obj, ("90",), pic=True), name)
            assert result.ok, result.output
            objects.append(obj)
        binding = out / "binding.o"
        result = cc._run(cc._binding_command(CSRC / "quantize_binding.cpp", binding, "hybrid_check_cuda_quantize"),
                         "binding")
        assert result.ok, result.output
        result = cc._link_and_import("cuda_quantize", [binding, *objects], out, nvcc)
        assert result.ok, result.output


# ----------------------------------------------------------- GPU parity --

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _adversarial(rows: int, k: int, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-20, 20, rows)[:, None]
    if dtype == torch.float32 and k > 4 * block:
        x[0, :block] *= 1e-25                   # denormals
        x[0, block:2 * block] = 3.3e38          # near FLT_MAX
        x[-1, 2 * block + 1] = math.nan
        x[-1, 3 * block + 2] = -math.inf
        x[-1, 4 * block:5 * block] = 0.0
    return x.to(dtype)


@cuda
@pytest.mark.parametrize("bits,block", FORMATS + [(8, 4096), (1, 8192)], ids=FORMAT_IDS + ["b8-blk4096", "b1-blk8192"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda_kernels_are_bit_identical_to_the_torch_path(kernel_env, bits, block, dtype):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    for rows, k in ((1, 1), (3, block - 1), (4, 6 * block + 3), (2, 100_003)):
        x = _adversarial(rows, k, block, dtype, seed=rows + k)
        want = Q.pack(x, bits, block)                  # CPU torch path
        wire = Q.pack(x.cuda(), bits, block)           # CUDA kernel
        assert torch.equal(wire.cpu(), want), (rows, k)
        assert same_bits(Q.unpack(wire, k, bits, block).cpu(), Q.unpack(want, k, bits, block))
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = Q.unpack_sum(wire, k, bits, block, torch.empty(k, device="cuda", dtype=out_dtype))
            ref = Q.unpack_sum(want, k, bits, block, torch.empty(k, dtype=out_dtype))
            assert same_bits(got.cpu(), ref), (rows, k, out_dtype)
        # the torch path on the GPU agrees as well
        assert torch.equal(Q.pack(x.cuda(), bits, block, use_kernel=False).cpu(), want)
