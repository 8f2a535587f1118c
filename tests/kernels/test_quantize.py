"""Blockwise quantization (hybrid.kernels.quantize): format, error bound, non-finite
semantics, ordered sums, error feedback; the compiled CPU op's bit identity with the torch
path (every SIMD path it has); the CUDA kernels' compile check here, their bit identity
with the torch path on a GPU.

The format tests call the public functions with their defaults, so they run on the path a
user gets on CPU (the cpu_quantize op when it builds); the torch path is checked against
them bit for bit in the parity tests below, and directly where it matters (chunking)."""

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


@pytest.mark.parametrize("use_kernel", [True, False], ids=["default", "torch"])
@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
def test_matches_an_independent_numpy_implementation(bits, block, use_kernel):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2 * block + 5, generator=gen) * torch.logspace(-3, 3, 2 * block + 5)
    got = roundtrip(x, bits, block, use_kernel=use_kernel)
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


@pytest.mark.parametrize("use_kernel", [True, False], ids=["default", "torch"])
def test_paths_are_deterministic(use_kernel):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 10_000, generator=gen)
    kw = dict(use_kernel=use_kernel)
    for bits in Q.BITS:
        w1, w2 = Q.pack(x, bits, 256, **kw), Q.pack(x.clone(), bits, 256, **kw)
        assert torch.equal(w1, w2)
        assert torch.equal(Q.unpack(w1, 10_000, bits, 256, **kw), Q.unpack(w2, 10_000, bits, 256, **kw))
        s1 = Q.unpack_sum(w1, 10_000, bits, 256, torch.empty(10_000), **kw)
        s2 = Q.unpack_sum(w2, 10_000, bits, 256, torch.empty(10_000), **kw)
        assert torch.equal(s1, s2)


@pytest.mark.parametrize("bits,block", FORMATS, ids=FORMAT_IDS)
def test_cpu_chunking_does_not_change_the_bits(monkeypatch, bits, block):
    gen = torch.Generator().manual_seed(8)
    k = 11 * block + 5
    x = torch.randn(3, k, generator=gen) * torch.logspace(-5, 5, k)
    x[2, 4 * block + 1] = math.nan
    monkeypatch.setattr(Q, "CPU_CHUNK", 0)  # one step
    t = dict(use_kernel=False)  # the chunking is the torch path's
    wire = Q.pack(x, bits, block, **t)
    rows = Q.unpack(wire, k, bits, block, **t)
    total = Q.unpack_sum(wire, k, bits, block, torch.empty(k), **t)
    half = Q.unpack_sum(wire, k, bits, block, torch.empty(k, dtype=torch.bfloat16), **t)
    for chunk in (1, 3 * block, 2 * 3 * block + 1):
        monkeypatch.setattr(Q, "CPU_CHUNK", chunk)
        assert torch.equal(Q.pack(x, bits, block, **t), wire)
        assert same_bits(Q.unpack(wire, k, bits, block, **t), rows)
        assert same_bits(Q.unpack_sum(wire, k, bits, block, torch.empty(k), **t), total)
        assert same_bits(Q.unpack_sum(wire, k, bits, block, torch.empty(k, dtype=torch.bfloat16), **t), half)


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


class RecordingRegistry:
    def __init__(self, op=None):
        self.asked, self.op = [], op

    def get(self, name):
        self.asked.append(name)
        return self.op


def test_cpu_tensors_ask_for_the_cpu_op_only_when_allowed(monkeypatch):
    import hybrid.kernels.quantize as mod

    registry = RecordingRegistry()  # an op that is not there: the torch path, no error
    monkeypatch.setattr(mod, "default_registry", lambda: registry)
    x = torch.randn(2, 100)
    wire = Q.pack(x, 8, 64)
    Q.unpack(wire, 100, 8, 64)
    Q.unpack_sum(wire, 100, 8, 64, torch.empty(100))
    assert registry.asked == ["cpu_quantize"] * 3
    registry.asked.clear()
    Q.unpack_sum(Q.pack(x, 8, 64, use_kernel=False), 100, 8, 64, torch.empty(100), use_kernel=False)
    Q.unpack(wire, 100, 8, 64, use_kernel=False)
    assert registry.asked == []
    monkeypatch.setattr(mod, "CPU_KERNEL_OPS", frozenset({"unpack_sum"}))  # per-operation choice
    Q.pack(x, 8, 64)
    Q.unpack_sum(wire, 100, 8, 64)
    assert registry.asked == ["cpu_quantize"]


def test_kernels_off_uses_the_torch_path_silently(kernel_env, recwarn):
    kernel_env.setenv("HYBRID_KERNELS", "off")
    x = torch.randn(3, 1000)
    assert torch.equal(Q.pack(x, 4, 256), Q.pack(x, 4, 256, use_kernel=False))
    assert not [w for w in recwarn if "cpu_quantize" in str(w.message)]


def test_the_ops_are_registered():
    from hybrid.kernels.ops import ALL_OPS

    spec = ALL_OPS["cuda_quantize"]
    assert spec.device == "cuda" and "cuda/quantize.cu" in spec.sources and "-fmad=false" in spec.extra_cuda_cflags
    cpu = ALL_OPS["cpu_quantize"]
    assert cpu.device == "cpu" and cpu.sources == ("cpu/quantize.cpp",)
    # bit identity with the torch path rests on these: no FMA contraction, no fast-math
    assert "-ffp-contract=off" in cpu.extra_cflags and "-fno-fast-math" in cpu.extra_cflags
    assert not any("fast-math" in f and f != "-fno-fast-math" for f in cpu.extra_cflags)
    assert not any(f.startswith("-march") or f == "-Ofast" for f in cpu.extra_cflags)
    for rel in spec.sources + cpu.sources:
        assert (Path(__file__).resolve().parents[2] / "csrc" / rel).is_file()


def test_zero_blocks_store_a_positive_zero_scale_on_every_path():
    """-0.0 blocks (and mixed +-0) store +0, as fabs-based absmax (CUDA, C++) does."""
    x = torch.zeros(3, 512)
    x[0] = -0.0
    x[1, ::2] = -0.0
    x[2, 1::3] = -0.0
    for bits in Q.BITS:
        for use_kernel in (True, False):
            wire = Q.pack(x, bits, 256, use_kernel=use_kernel)
            scales = wire[:, Q.data_bytes(512, bits, 256):].clone(memory_format=torch.contiguous_format)
            assert (scales.view(torch.int32) == 0).all(), (bits, use_kernel)
            y = Q.unpack(wire, 512, bits, 256, use_kernel=use_kernel)
            assert (y.view(torch.int32) == 0).all()  # +0 everywhere


# --------------------------------------------------- compiled CPU op parity --

@pytest.fixture(scope="module")
def cpu_quantize_op():
    """The compiled cpu_quantize module (built into the kernel cache on first use)."""
    from hybrid.kernels import ops
    from hybrid.kernels.builder import default_cache_root, default_csrc_dir
    from hybrid.kernels.modes import KernelBuildError, KernelMode
    from hybrid.kernels.registry import KernelRegistry

    problem = ops.requirement_problem(ops.CPU_QUANTIZE)
    if problem is not None:
        pytest.skip(f"cpu_quantize cannot be built here: {problem}")
    try:
        return KernelRegistry(KernelMode.REQUIRE, default_cache_root(), default_csrc_dir()).load("cpu_quantize")
    except KernelBuildError as exc:
        pytest.skip(f"cpu_quantize failed to build: {str(exc).splitlines()[0]}")


def exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern everywhere, NaN payloads and zero signs included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.equal(a.contiguous().view(as_int[a.dtype]), b.contiguous().view(as_int[b.dtype]))


def adversarial_rows(rows: int, k: int, block: int, seed: int) -> torch.Tensor:
    """Random rows over 40 decades with, where they fit, one block of each hard case."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-15, 15, rows)[:, None]
    cases = [
        lambda v: v.fill_(0.3),                               # all equal
        lambda v: v.fill_(-2.5e-3),                           # all equal, negative
        lambda v: v.__setitem__(len(v) // 2, 3e35),           # one outlier
        lambda v: v.zero_(),                                  # zeros
        lambda v: v.fill_(-0.0),                              # negative zeros
        lambda v: v.mul_(1e-41),                              # denormals
        lambda v: v.copy_(torch.randint(-3, 4, v.shape, generator=gen) * 2.0 ** -149),  # tiny denormals
        lambda v: v.clamp_(-1, 1).mul_(3.4e38),               # near FLT_MAX (the 1-bit sum would overflow)
        lambda v: v.__setitem__(0, math.inf),                 # +inf
        lambda v: v.__setitem__(-1, -math.inf),               # -inf
        lambda v: v.__setitem__(len(v) // 3, math.nan),       # NaN
        lambda v: v.copy_(torch.arange(len(v)) % 2 - 0.5),    # +-0.5: exact ties at qmax / 2 steps
    ]
    flat = [(r, b) for r in range(rows) for b in range(k // block)]
    for i, (r, b) in enumerate(flat[:len(cases)]):
        cases[i](x[r, b * block:(b + 1) * block])
    if k % block:  # a non-finite value in a partial last block too
        x[-1, k - 1] = math.nan if seed % 2 else math.inf
    return x


PARITY_FORMATS = FORMATS + [(8, 1000), (4, 1002), (1, 1000), (1, 4096)]
PARITY_IDS = [f"b{b}-blk{n}" for b, n in PARITY_FORMATS]


@pytest.mark.parametrize("bits,block", PARITY_FORMATS, ids=PARITY_IDS)
def test_cpu_op_is_bit_identical_to_the_torch_path(cpu_quantize_op, bits, block):
    op = cpu_quantize_op
    shapes = [(1, 1), (3, block - 1 or 1), (2, block), (4, 13 * block + 3), (1, 12 * block + block // 2 + 1)]
    for seed, (rows, k) in enumerate(shapes):
        x = adversarial_rows(rows, k, block, seed)
        want = Q.pack(x, bits, block, use_kernel=False)
        decoded = Q.unpack(want, k, bits, block, use_kernel=False)
        sums = {dt: Q.unpack_sum(want, k, bits, block, torch.empty(k, dtype=dt), use_kernel=False)
                for dt in (torch.float32, torch.bfloat16, torch.float16)}
        for isa in op.supported_isas():
            wire = torch.empty_like(want)
            op.pack(x, wire, bits, block, isa)
            assert torch.equal(wire, want), (isa, rows, k)
            out = torch.full((rows, k), 123.0)
            op.unpack(want, out, k, bits, block, isa)
            assert exact(out, decoded), (isa, rows, k)
            total = torch.full((k,), 123.0)
            op.unpack_sum(want, total, k, bits, block, isa)
            assert exact(total, sums[torch.float32]), (isa, rows, k)
        # the public functions on CPU (the op by default) agree as well, fp16/bf16 out included
        assert torch.equal(Q.pack(x, bits, block), want)
        assert exact(Q.unpack(want, k, bits, block), decoded)
        for dt, ref in sums.items():
            assert exact(Q.unpack_sum(want, k, bits, block, torch.empty(k, dtype=dt)), ref), (dt, rows, k)


@pytest.mark.parametrize("bits", Q.BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_op_packs_half_inputs_like_the_torch_path(cpu_quantize_op, bits, dtype):
    x = adversarial_rows(3, 7 * 256 + 9, 256, seed=11).clamp(-6e4, 6e4).to(dtype)
    want = Q.pack(x, bits, 256, use_kernel=False)
    for isa in cpu_quantize_op.supported_isas():
        wire = torch.empty_like(want)
        cpu_quantize_op.pack(x, wire, bits, 256, isa)
        assert torch.equal(wire, want), isa
    assert torch.equal(Q.pack(x, bits, 256), want)
    assert torch.equal(Q.pack(x.double(), bits, 256), Q.pack(x.double(), bits, 256, use_kernel=False))


@pytest.mark.parametrize("bits", Q.BITS)
def test_cpu_op_results_do_not_depend_on_threads_or_layout(cpu_quantize_op, bits):
    gen = torch.Generator().manual_seed(12)
    rows, k = 3, 200_003  # big enough to split over threads, with a partial last block
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-5, 5, k)
    x[1, 70_000] = math.nan
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        wire1 = Q.pack(x, bits, 256)
        rows1 = Q.unpack(wire1, k, bits, 256)
        sum1 = Q.unpack_sum(wire1, k, bits, 256)
        torch.set_num_threads(max(2, before))
        wire2 = Q.pack(x, bits, 256)
        assert torch.equal(wire1, wire2)
        assert exact(Q.unpack(wire2, k, bits, 256), rows1)
        assert exact(Q.unpack_sum(wire2, k, bits, 256), sum1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(wire1, Q.pack(x, bits, 256, use_kernel=False))
    # strided inputs and outputs go through contiguous copies with the same bits
    xt = x.t().contiguous().t()
    assert torch.equal(Q.pack(xt, bits, 256), wire1)
    wide = torch.empty(k, rows).t()
    Q.unpack(wire1, k, bits, 256, out=wide)
    assert exact(wide.contiguous(), rows1)
    strided = torch.empty(2 * k)[::2]
    Q.unpack_sum(wire1, k, bits, 256, strided)
    assert exact(strided.contiguous(), sum1)


def test_cpu_op_rejects_what_it_cannot_take(cpu_quantize_op):
    op = cpu_quantize_op
    x = torch.randn(2, 64)
    wire = torch.empty(2, Q.wire_bytes(64, 8, 32), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="contiguous"):
        op.pack(torch.randn(64, 2).t(), wire, 8, 32, "")
    with pytest.raises(RuntimeError, match="wire must be"):
        op.pack(x, torch.empty(2, wire.shape[1] - 1, dtype=torch.uint8), 8, 32, "")
    with pytest.raises(RuntimeError, match="bits"):
        op.pack(x, wire, 2, 32, "")
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op.pack(x, wire, 1, 12, "")
    with pytest.raises(RuntimeError, match="unknown ISA"):
        op.pack(x, wire, 8, 32, "sse9")
    with pytest.raises(RuntimeError, match="out must be"):
        op.unpack(wire, torch.empty(2, 64, dtype=torch.float64), 64, 8, 32, "")
    with pytest.raises(RuntimeError, match="at least one row"):
        op.unpack_sum(wire[:0], torch.empty(64), 64, 8, 32, "")
    assert op.wire_bytes(1001, 4, 256) == Q.wire_bytes(1001, 4, 256)
    assert op.default_isa() in op.supported_isas() and op.supported_isas()[0] == "scalar"


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
