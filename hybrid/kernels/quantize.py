"""Blockwise quantization for compressed communication: int8, int4 and 1-bit sign.

The codec behind the quantized reduce-scatter / all-gather and the 1-bit compressed
optimizer. ``pack`` turns a ``[rows, k]`` float tensor into ``[rows, wire_bytes]`` uint8
(each row on its own, so row ``i`` can go to rank ``i`` in one ``all_to_all_single``);
``unpack`` and ``unpack_sum`` turn it back into fp32. The format is in docs/compression.md.

Layout of one packed row (``nb = ceil(k / block)`` blocks, the last one zero-padded)::

    [ data of block 0 | data of block 1 | ... | data of block nb-1 | scale 0 | ... | scale nb-1 ]
      block * bits / 8 bytes each                                     fp32, little endian

* int8 (qmax 127): one two's-complement byte per element.
* int4 (qmax 7): two elements per byte, element ``2i`` in the low nibble and ``2i+1`` in the
  high nibble, each a 4-bit two's-complement ``q`` (so ``q = 0`` is a zero nibble).
* 1-bit: element ``8i+j`` in bit ``j`` (LSB first) of byte ``i``; a set bit means ``x >= 0``.

Scales and arithmetic (all fp32, in exactly this order; the CUDA and the CPU kernels use
the same correctly rounded operations, so every path is bit-identical):

* int8 / int4: the stored scale is the block's absmax ``a``;
  ``q = round_half_even(x / a * qmax)``, and ``x' = (q / qmax) * a``.
* 1-bit: ``r_i = |x_i| / a`` summed by a fixed pairwise tree (the block zero-padded to a
  power of two ``P``, then ``v[i] += v[i + h]`` for ``h = P/2, P/4, ..., 1``), the scale is
  ``s = (sum / n) * a`` with ``n`` the block's real element count: ``mean(|x|)`` computed
  without overflow near FLT_MAX; ``x' = +s`` for a set bit, ``-s`` otherwise (computed as
  ``(+-1) * s``).
* A zero block (``+0`` or ``-0`` values) stores scale ``+0`` and decodes to exact zeros;
  a block holding any NaN or +-inf stores a NaN scale and zero data, and decodes to all
  NaN (never a hidden overflow).

CUDA tensors use the ``cuda_quantize`` op when the registry provides it (1-bit blocks up
to :data:`MAX_CUDA_1BIT_BLOCK`), the torch path otherwise. CPU tensors use the
``cpu_quantize`` op (csrc/cpu/quantize.cpp: one fused, auto-vectorised pass per block,
OpenMP over blocks, the same fp32 operations in the same order, so again bit-identical)
for each operation in :data:`CPU_KERNEL_OPS`, the ones it measured faster than the torch
path (benchmarks/quantize_cpu.py); without the op (``HYBRID_KERNELS=off``, no compiler)
they fall back to the torch path. ``use_kernel=False`` forces the torch path on any device.

Each of ``pack``, ``unpack`` and ``unpack_sum`` checks its arguments and then makes one call
of a ``torch.library`` custom op (``hybrid::quantize_pack``, ``hybrid::quantize_unpack``,
``hybrid::quantize_unpack_sum``), which makes the kernel choice above and has a fake
implementation, so ``torch.compile`` keeps the codec as single graph nodes.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# the wire size and the default block are the compression settings' (plain data, no torch)
from hybrid.compression import BITS, DEFAULT_BLOCK, packed_bytes
from hybrid.kernels.library import custom_op
from hybrid.kernels.registry import default_registry

QMAX = {8: 127, 4: 7}
# Largest power of two the 1-bit CUDA kernel's shared-memory tree holds (32 KiB of fp32).
MAX_CUDA_1BIT_BLOCK = 8192
OP_NAME = "cuda_quantize"
CPU_OP_NAME = "cpu_quantize"
# Operations CPU tensors send to the cpu_quantize op when it is built: those where it beat
# the torch path in benchmarks/quantize_cpu.py (every bits value and size measured; see
# benchmarks/results/quantize_cpu.json and docs/compression.md "CPU speed").
CPU_KERNEL_OPS = frozenset({"pack", "unpack", "unpack_sum"})
# SIMD path of the cpu_quantize op: "" picks the best this CPU runs; "scalar", "avx2" or
# "avx512" force one (all are bit-identical; the tests compare them).
CPU_ISA = ""
# Elements per step of the torch path on CPU (see _chunks); 0 processes a call in one step.
CPU_CHUNK = 1 << 19

_UNIT_ROUNDOFF = 2.0 ** -24   # fp32 round-to-nearest relative error
_HALF_DENORM = 2.0 ** -150    # absolute error of an fp32 result that underflows
_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

if sys.byteorder != "little":  # the wire stores the scales as raw little-endian bytes
    raise ImportError("hybrid.kernels.quantize assumes a little-endian host")


# ------------------------------------------------------------------ geometry --

def _check_format(bits: int, block: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if not isinstance(block, (int, torch.SymInt)) or block <= 0:  # SymInt: a block dynamo made dynamic
        raise ValueError(f"block must be a positive int, got {block!r}")
    if bits == 4 and block % 2:
        raise ValueError(f"int4 needs an even block, got {block}")
    if bits == 1 and block % 8:
        raise ValueError(f"1-bit needs a block that is a multiple of 8, got {block}")


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def block_bytes(bits: int, block: int) -> int:
    """Data bytes of one block."""
    _check_format(bits, block)
    return block * bits // 8


def data_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes before the scales in one packed row (also the offset of scale 0)."""
    return num_blocks(numel, block) * block_bytes(bits, block)


def wire_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one packed row of ``numel`` elements: ``ceil(numel/block)`` blocks of
    ``block*bits/8`` data bytes (the last block padded to a whole block), plus one fp32
    scale per block."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    _check_format(bits, block)
    return packed_bytes(numel, bits, block)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------ kernel choice --

def _cuda_op(t: Tensor, bits: int, block: int, use_kernel: bool):
    """The compiled op for this call, or None for the torch path."""
    if not use_kernel or not t.is_cuda:
        return None
    if bits == 1 and _pow2_ceil(block) > MAX_CUDA_1BIT_BLOCK:
        return None  # a documented limit, not a missing op: no warning
    return default_registry().get(OP_NAME)


def _cpu_op(t: Tensor, what: str, use_kernel: bool):
    """The compiled CPU op for ``what`` (pack, unpack, unpack_sum) on this call, or None."""
    if not use_kernel or t.device.type != "cpu" or what not in CPU_KERNEL_OPS:
        return None
    return default_registry().get(CPU_OP_NAME)


def _launch_context(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0


def _scalar(value: float, like: Tensor) -> Tensor:
    # A 0-dim tensor on the data's device: torch turns division by a Python scalar into a
    # multiplication by its reciprocal on CUDA, which would change the bits.
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _chunks(nblocks: int, rows: int, block: int, device: torch.device):
    """Ranges of blocks the torch path handles per step. On CPU about CPU_CHUNK elements
    (all rows together) at a time, so temporaries stay in cache and their memory is reused;
    one step on other devices."""
    step = nblocks if device.type != "cpu" or CPU_CHUNK <= 0 else max(1, CPU_CHUNK // max(1, rows * block))
    for b0 in range(0, nblocks, max(1, step)):
        yield b0, min(nblocks, b0 + step)


# ---------------------------------------------------------------- torch: pack --

def _tree_sum(v: Tensor) -> Tensor:
    """Sum over the last dim by the fixed pairwise tree of the format (zero-padded to 2^m)."""
    h = _pow2_ceil(v.shape[-1]) // 2
    while h >= 1:
        n = v.shape[-1]
        if n > h:
            if n == 2 * h:
                v = v[..., :h] + v[..., h:]
            else:  # the upper half is partly padding: v[i] + 0 == v[i] for v[i] >= +0
                lo = v[..., :h].clone()
                lo[..., :n - h] += v[..., h:]
                v = lo
        h //= 2
    return v[..., 0]


def _encode(xb: Tensor, bits: int, count: int, data: Tensor, scale: Tensor) -> None:
    """Quantize full blocks ``xb`` [rows, n, block] (fp32) into ``data`` [rows, n, bytes] and
    ``scale`` [rows, n]; ``count`` is how many leading elements of each block are real."""
    # max(max x, -min x) is exactly max|x| without an |x| temporary; amax/amin propagate NaN
    # (and are several times faster than aminmax over a short last dim).
    # NaN if the block holds a NaN, inf if an inf. "+ 0" turns the -0 that torch.maximum
    # returns for an all-(-0) block (its first argument on a tie) into the +0 the compiled
    # kernels store, the fabs-based absmax.
    absmax = torch.maximum(xb.amax(-1), xb.amin(-1).neg_()).add_(0.0)
    bad = ~torch.isfinite(absmax)
    safe = torch.where(absmax > 0, absmax, torch.ones((), device=xb.device))  # NaN > 0 is False
    if bits in QMAX:
        t = xb / safe[..., None]
        t.mul_(QMAX[bits]).round_()
        if bool(bad.any()):
            t.masked_fill_(bad[..., None], 0.0)
        scale.copy_(torch.where(bad, float("nan"), absmax))
        if bits == 8:
            data.view(torch.int8).copy_(t)
        else:
            q = t.to(torch.int8).view(torch.uint8)
            data.copy_((q[..., 0::2] & 15) | (q[..., 1::2] << 4))
        return
    r = xb.abs().div_(safe[..., None])
    total = _tree_sum(r)
    s = total.div_(_scalar(float(count), total)).mul_(absmax)
    scale.copy_(torch.where(bad, float("nan"), s))
    sign = (xb >= 0) & ~bad[..., None]
    shifts = torch.arange(8, dtype=torch.uint8, device=xb.device)
    data.copy_((sign.view(torch.uint8).unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.uint8))


def _as_rows(x: Tensor, what: str) -> Tensor:
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{what} must be [rows, k] or [k], got shape {tuple(x.shape)}")
    return x


def _pack_torch(x: Tensor, bits: int, block: int, wire: Tensor) -> None:
    rows, k = x.shape
    nb, nfull = num_blocks(k, block), k // block
    dbytes = data_bytes(k, bits, block)
    if rows == 0 or nb == 0:
        return
    data = wire[:, :dbytes].unflatten(1, (nb, block_bytes(bits, block)))
    scale = torch.empty(rows, nb, dtype=torch.float32, device=x.device)
    for b0, b1 in _chunks(nfull, rows, block, x.device):
        xb = x[:, b0 * block:b1 * block].float().unflatten(1, (b1 - b0, block))
        _encode(xb, bits, block, data[:, b0:b1], scale[:, b0:b1])
    if nfull < nb:  # the partial last block, zero-padded
        tail = F.pad(x[:, nfull * block:].float(), (0, nb * block - k)).unsqueeze(1)
        _encode(tail, bits, k - nfull * block, data[:, nfull:], scale[:, nfull:])
    wire[:, dbytes:] = scale.view(torch.uint8)


@custom_op("quantize_pack")
def _pack_op(x: Tensor, bits: int, block: int, use_kernel: bool) -> Tensor:
    """``hybrid::quantize_pack``: x [rows, k] float -> uint8 [rows, wire_bytes(k, bits, block)].

    The compiled op of x's device (cpu_quantize / cuda_quantize) when ``use_kernel`` and the
    registry provides it, the torch path otherwise; all are bit-identical."""
    _check_format(bits, block)
    rows, k = x.shape
    wire = torch.empty(rows, wire_bytes(k, bits, block), dtype=torch.uint8, device=x.device)
    op = _cuda_op(x, bits, block, use_kernel)
    cpu = None if op is not None else _cpu_op(x, "pack", use_kernel)
    if op is None and cpu is None:
        _pack_torch(x, bits, block, wire)
        return wire
    if x.dtype not in _FLOAT_INPUTS:
        x = x.float()
    if rows and k:
        if cpu is not None:
            cpu.pack(x.contiguous(), wire, bits, block, CPU_ISA)
        else:
            with _launch_context(x.device):
                op.pack(x.contiguous(), wire, bits, block, _stream(x.device))
    return wire


@_pack_op.register_fake
def _pack_fake(x: Tensor, bits: int, block: int, use_kernel: bool) -> Tensor:
    return x.new_empty((x.shape[0], wire_bytes(x.shape[1], bits, block)), dtype=torch.uint8)


def pack(x: Tensor, bits: int, block: int = DEFAULT_BLOCK, *, use_kernel: bool = True) -> Tensor:
    """Quantize ``x`` [rows, k] (fp32, fp16 or bf16; a 1-D ``x`` is one row) to uint8
    [rows, wire_bytes(k, bits, block)]: each row is its data bytes, then its fp32 scales as
    raw little-endian bytes. Rows are independent. One ``hybrid::quantize_pack`` call."""
    _check_format(bits, block)
    x2 = _as_rows(x, "x")
    if not x2.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x2.dtype}")
    return _pack_op(x2, bits, block, use_kernel)


# -------------------------------------------------------------- torch: unpack --

def _check_wire(wire: Tensor, k: int, bits: int, block: int) -> Tensor:
    """``wire`` as [rows, W] after checking it holds rows packed from ``k`` elements."""
    _check_format(bits, block)
    if wire.dtype != torch.uint8:
        raise TypeError(f"wire must be uint8, got {wire.dtype}")
    wire = _as_rows(wire, "wire")
    expected = wire_bytes(k, bits, block)
    if wire.shape[1] != expected:
        raise ValueError(f"wire rows have {wire.shape[1]} bytes; k={k}, bits={bits}, block={block} "
                         f"packs to {expected}")
    return wire


def _split(wire: Tensor, k: int, bits: int, block: int) -> tuple[Tensor, Tensor]:
    """(data [rows, nb, bytes], scale [rows, nb] fp32) of a checked wire."""
    nb, dbytes = num_blocks(k, block), data_bytes(k, bits, block)
    data = wire[:, :dbytes].unflatten(1, (nb, block_bytes(bits, block)))
    # A copy: the scales start at any byte offset, and fp32 views need 4-byte alignment.
    scale = wire[:, dbytes:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return data, scale


_SIGN_TABLES: dict[torch.device, Tensor] = {}


def _sign_table(device: torch.device) -> Tensor:
    """int8 [256, 8]: row b holds +1 where bit j of b is set, -1 elsewhere."""
    table = _SIGN_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _SIGN_TABLES[device] = (bits * 2 - 1).to(torch.int8).to(device)
    return table


def _decode(data: Tensor, scale: Tensor, bits: int, out: Tensor) -> None:
    """Dequantize ``data`` [rows, n, bytes] with ``scale`` [rows, n] into ``out`` [rows, n, block] fp32."""
    if bits == 1:  # one table lookup per byte, one int8 -> fp32 conversion, and (+-1) * s == +-s exactly
        signs = _sign_table(data.device).index_select(0, data.reshape(-1).long())
        out.copy_(signs.view(out.shape))
        out.mul_(scale.unsqueeze(-1))
        return
    if bits == 8:
        out.copy_(data.view(torch.int8))
    else:
        pairs = out.unflatten(-1, (-1, 2))
        pairs[..., 0].copy_((data << 4).view(torch.int8) >> 4)  # sign-extend the low nibble
        pairs[..., 1].copy_(data.view(torch.int8) >> 4)         # arithmetic shift: the high nibble
    out.div_(_scalar(float(QMAX[bits]), out)).mul_(scale.unsqueeze(-1))


def _decode_range(data: Tensor, scale: Tensor, k: int, bits: int, block: int, b0: int, b1: int,
                  out: Tensor) -> None:
    """Dequantize blocks [b0, b1) of every row into ``out`` [rows, their elements] (fp32, any strides)."""
    nfull = k // block
    f1 = min(b1, nfull)
    if f1 > b0:
        _decode(data[:, b0:f1], scale[:, b0:f1], bits, out[:, :(f1 - b0) * block].unflatten(1, (f1 - b0, block)))
    if b1 > nfull:  # the partial last block
        tail = torch.empty(out.shape[0], 1, block, dtype=torch.float32, device=out.device)
        _decode(data[:, nfull:], scale[:, nfull:], bits, tail)
        out[:, (nfull - b0) * block:] = tail[:, 0, :k - nfull * block]


def _unpack_torch(wire: Tensor, k: int, bits: int, block: int, out: Tensor) -> None:
    """Dequantize every row of a checked ``wire`` into ``out`` [rows, k] fp32 (any strides)."""
    data, scale = _split(wire, k, bits, block)
    rows, nb = scale.shape
    if rows == 0:
        return
    for b0, b1 in _chunks(nb, rows, block, out.device):
        _decode_range(data, scale, k, bits, block, b0, b1, out[:, b0 * block:min(b1 * block, k)])


def _unpack_sum_torch(wire: Tensor, k: int, bits: int, block: int, out: Tensor) -> None:
    """``out`` [k] = cast(((row 0 + row 1) + ...) + row rows-1), dequantized rows added in fp32."""
    data, scale = _split(wire, k, bits, block)
    rows, nb = scale.shape
    fp32_out = out.dtype == torch.float32
    for b0, b1 in _chunks(nb, 1, block, out.device):
        cols = slice(b0 * block, min(b1 * block, k))
        width = cols.stop - cols.start
        acc = out[cols] if fp32_out else torch.empty(width, dtype=torch.float32, device=out.device)
        _decode_range(data[:1], scale[:1], k, bits, block, b0, b1, acc.unsqueeze(0))
        if rows > 1:
            row = torch.empty(1, width, dtype=torch.float32, device=out.device)
            for r in range(1, rows):
                _decode_range(data[r:r + 1], scale[r:r + 1], k, bits, block, b0, b1, row)
                acc.add_(row[0])
        if not fp32_out:
            out[cols] = acc  # the one cast, round to nearest even


def _decode_on_host(launch, wire: Tensor, out: Tensor, k: int, bits: int, block: int) -> None:
    """Run the CPU op's ``launch`` (unpack or unpack_sum, which write contiguous fp32) into
    ``out``, through a contiguous fp32 copy when it is not one (a cast to fp16/bf16 rounds
    to nearest even, as the torch path's)."""
    fits = out.dtype == torch.float32 and out.is_contiguous()
    target = out if fits else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    launch(wire.contiguous(), target, k, bits, block, CPU_ISA)
    if target is not out:
        out.copy_(target)


def _decode_with(wire: Tensor, out: Tensor, k: int, bits: int, block: int, use_kernel: bool, what: str,
                 torch_path) -> Tensor:
    """Fill the new contiguous ``out`` from a checked ``wire`` with ``what`` (unpack or
    unpack_sum): the compiled op of wire's device when there is one, else ``torch_path``."""
    op = _cuda_op(wire, bits, block, use_kernel)
    cpu = None if op is not None else _cpu_op(wire, what, use_kernel)
    if op is None and cpu is None:
        torch_path(wire, k, bits, block, out)
    elif out.numel():
        if op is not None:
            with _launch_context(wire.device):
                getattr(op, what)(wire.contiguous(), out, k, bits, block, _stream(wire.device))
        else:
            _decode_on_host(getattr(cpu, what), wire, out, k, bits, block)
    return out


@custom_op("quantize_unpack")
def _unpack_op(wire: Tensor, k: int, bits: int, block: int, use_kernel: bool) -> Tensor:
    """``hybrid::quantize_unpack``: wire uint8 [rows, wire_bytes(k, bits, block)] -> fp32 [rows, k]."""
    _check_format(bits, block)
    rows = wire.shape[0]
    out = torch.empty(rows, k, dtype=torch.float32, device=wire.device)
    return _decode_with(wire, out, k, bits, block, use_kernel, "unpack", _unpack_torch)


@_unpack_op.register_fake
def _unpack_fake(wire: Tensor, k: int, bits: int, block: int, use_kernel: bool) -> Tensor:
    return wire.new_empty((wire.shape[0], k), dtype=torch.float32)


@custom_op("quantize_unpack_sum")
def _unpack_sum_op(wire: Tensor, k: int, bits: int, block: int, out_dtype: torch.dtype, use_kernel: bool) -> Tensor:
    """``hybrid::quantize_unpack_sum``: wire uint8 [rows, wire_bytes(k, bits, block)] -> [k] of
    ``out_dtype`` (fp32, fp16 or bf16), the rows dequantized and added in fp32 in row order."""
    _check_format(bits, block)
    rows = wire.shape[0]
    out = torch.empty(k, dtype=out_dtype, device=wire.device)
    if rows == 0:
        return out.zero_()
    return _decode_with(wire, out, k, bits, block, use_kernel, "unpack_sum", _unpack_sum_torch)


@_unpack_sum_op.register_fake
def _unpack_sum_fake(wire: Tensor, k: int, bits: int, block: int, out_dtype: torch.dtype,
                     use_kernel: bool) -> Tensor:
    return wire.new_empty((k,), dtype=out_dtype)


def _into(result: Tensor, out: Optional[Tensor]) -> Tensor:
    """``result``, or ``out`` after copying it there (the ops return new tensors, so that
    compiled graphs hold them as functional nodes; a caller's ``out`` costs one copy)."""
    if out is None:
        return result
    return out.copy_(result)


def unpack(wire: Tensor, k: int, bits: int, block: int = DEFAULT_BLOCK, out: Optional[Tensor] = None, *,
           use_kernel: bool = True) -> Tensor:
    """Dequantize ``wire`` uint8 [rows, wire_bytes(k, bits, block)] (a 1-D wire is one row) to
    fp32 [rows, k], written into ``out`` (fp32 [rows, k]) when given. One
    ``hybrid::quantize_unpack`` call."""
    wire = _check_wire(wire, k, bits, block)
    rows = wire.shape[0]
    if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (rows, k) or out.device != wire.device):
        raise ValueError(f"out must be float32 [{rows}, {k}] on {wire.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    return _into(_unpack_op(wire, k, bits, block, use_kernel), out)


def unpack_sum(wire: Tensor, k: int, bits: int, block: int = DEFAULT_BLOCK, out: Optional[Tensor] = None, *,
               use_kernel: bool = True) -> Tensor:
    """Dequantize every row of ``wire`` and add them in fp32, in row order 0, 1, ..., rows-1,
    into ``out`` [k] (fp32, or fp16/bf16: the fp32 sum is cast once, round to nearest even).
    The result is bit-identical to ``sum`` of the rows of ``unpack(wire, ...)`` taken in order;
    quantized integers are never added. ``out`` defaults to a new fp32 tensor. One
    ``hybrid::quantize_unpack_sum`` call."""
    wire = _check_wire(wire, k, bits, block)
    if out is not None and (out.dtype not in _OUT_DTYPES or tuple(out.shape) != (k,) or out.device != wire.device):
        raise ValueError(f"out must be fp32/fp16/bf16 [{k}] on {wire.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    out_dtype = torch.float32 if out is None else out.dtype
    return _into(_unpack_sum_op(wire, k, bits, block, out_dtype, use_kernel), out)


# ------------------------------------------------------------------- bounds --

def error_bound(x: Tensor, bits: int, block: int = DEFAULT_BLOCK) -> Tensor:
    """Per-element bound on ``|unpack(pack(x)) - x|`` (fp32, shaped like ``x``, rounded up).

    With ``a`` the block's absmax (of ``x.float()``) and ``u = 2^-24``:

    * int8 / int4: ``a * (1/(2*qmax) + 5u) + 2^-149`` -- half a quantization step, plus the
      rounding of the four fp32 operations (``x/a``, ``*qmax``, ``q/qmax``, ``*a``: at most
      ``(4u + 2u^2) * a``) and the absolute error of a result that underflows;
    * 1-bit: ``a * (1 + (log2(P) + 4) * u) + 2^-149`` (``P`` the block rounded up to a power
      of two): the decoded value has x's sign and magnitude ``s <= a(1 + (log2(P)+2)u)``, so the
      error ``|s - |x||`` is at most ``max(s, |x|)``. Only error feedback makes 1-bit useful.

    Blocks holding a NaN or inf have an infinite bound (they decode to NaN).
    See docs/compression.md for the derivation.
    """
    _check_format(bits, block)
    x2 = _as_rows(x, "x")
    rows, k = x2.shape
    nb = num_blocks(k, block)
    xb = F.pad(x2.double(), (0, nb * block - k)).view(rows, nb, block)
    absmax = xb.abs().amax(-1) if nb else torch.zeros(rows, 0, dtype=torch.float64, device=x.device)
    if bits in QMAX:
        factor = 0.5 / QMAX[bits] + 5 * _UNIT_ROUNDOFF
    else:
        factor = 1.0 + (math.log2(_pow2_ceil(block)) + 4) * _UNIT_ROUNDOFF
    bound64 = absmax * factor + 2 * _HALF_DENORM
    bound64 = torch.where(torch.isfinite(absmax), bound64, math.inf)
    bound = bound64.float()
    bound = torch.where(bound.double() < bound64, torch.nextafter(bound, torch.full_like(bound, math.inf)), bound)
    per_element = bound.repeat_interleave(block, dim=1)[:, :k]
    return per_element.reshape(x.shape)


__all__ = ["BITS", "DEFAULT_BLOCK", "QMAX", "MAX_CUDA_1BIT_BLOCK", "wire_bytes", "data_bytes", "block_bytes",
           "num_blocks", "pack", "unpack", "unpack_sum", "error_bound"]
