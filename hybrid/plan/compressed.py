"""Compressed ZeRO communication in the planner: the bytes of a quantized collective, and its buffers.

``zero.quantized_gradients`` and ``zero.quantized_weights`` (:mod:`hybrid.compression`) send a buffer of
``N`` elements over ``n`` data-parallel ranks as ``n`` chunks of ``k = ceil(N / n)`` elements, each packed
to ``W = Quantization.wire_bytes(k)`` bytes (``bits`` per value in whole blocks, plus a 4-byte scale per
block). What the runtime's communicator counts (:meth:`hybrid.comm.Communicator.report`):

* quantized reduce-scatter: an all-to-all; a rank sends its packed chunk ``i`` straight to rank ``i``.
  Payload ``n*W``, wire ``(n-1)*W`` per rank; the bytes leaving a node are ``W`` times, summed over its
  ranks, each rank's group peers on *other* nodes (:func:`hybrid.plan.links.split_by_link`);
* quantized all-gather: a ring all-gather of the packed chunks, payload ``n*W`` (the ring model);
* quantized all-reduce (stage 0): that reduce-scatter, then that all-gather of the summed chunks.

Against the unquantized ``N*p`` bytes (``p`` bytes per element) every figure scales by about
``(bits/8 + 4/block) / p``.
"""

from __future__ import annotations

from typing import Iterable

from hybrid.compression import Quantization

FP32 = 4  # bytes of the fp32 values a quantized collective dequantizes into


def chunk(numel: int, n: int) -> int:
    """Elements of each of the ``n`` chunks a quantized collective cuts ``numel`` elements into."""
    return -(-numel // n)


def packed_bytes(quant: Quantization, numel: int, n: int) -> int:
    """Bytes of ``numel`` elements over ``n`` ranks once packed: ``n`` chunks of ``wire_bytes(k)``. The payload
    of a quantized reduce-scatter of that buffer, or of a quantized all-gather into it."""
    return n * quant.wire_bytes(chunk(numel, n))


def reduction_buffers(quant: Quantization, segments: Iterable[int], n: int, all_reduce: bool) -> int:
    """Bytes that the quantized gradient reductions of ``segments`` (elements each, all in flight together)
    hold beyond the gradient buffers until they are waited on: per segment the packed send buffer and the
    receive buffer of the all-to-all (``n*W`` bytes each); for an all-reduce (stage 0), also the fp32 summed
    chunk (``4k``) that its all-gather sends next."""
    return sum(2 * packed_bytes(quant, s, n) + (FP32 * chunk(s, n) if all_reduce else 0) for s in segments)


def gather_buffers(quant: Quantization, segments: Iterable[int], n: int, largest: int, copies_output: bool) -> int:
    """Bytes of quantized all-gathers of ``segments`` (elements each), all launched before the first is waited on,
    at the worst moment of their waits: per segment this rank's packed chunk (``W``) and the packed gather
    (``n*W``); then, one at a time, the fp32 ``[n, k]`` dequantized values of the ``largest`` segment before
    they are copied into place, and with ``copies_output`` (gloo) the temporary its packed gather lands in."""
    segments = list(segments)
    held = sum(quant.wire_bytes(chunk(s, n)) + packed_bytes(quant, s, n) for s in segments)
    dequantized = FP32 * n * chunk(largest, n)
    return held + dequantized + (packed_bytes(quant, largest, n) if copies_output else 0)
