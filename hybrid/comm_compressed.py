"""The communicator's compressed exchanges: reduce-scatter, all-gather and all-reduce of quantized chunks.

Every chunk travels packed (:mod:`hybrid.kernels.quantize`, ``quant.bits`` per
value in blocks of ``quant.block``) and is summed or copied out in fp32 at the
receiver. A reduce-scatter is one all-to-all of the packed chunks; an
all-gather gathers each rank's packed chunk; an all-reduce is the two in turn.
:class:`hybrid.comm.Communicator` calls these when an operation is given a
:class:`~hybrid.compression.Quantization`; they run over the ``axis`` group.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol

import torch

from hybrid.comm_accounting import RING_WIRE_FACTOR
from hybrid.comm_handle import Handle
from hybrid.comm_tensors import nbytes, padded
from hybrid.compression import Quantization
from hybrid.kernels import quantize as _quant


class _Host(Protocol):
    """What these exchanges use of their :class:`~hybrid.comm.Communicator`."""

    def size(self, axis: str) -> int: ...

    def _record(self, op: str, axis: str, nbytes: int, wire_factor: float, peer: Optional[int] = None,
                fan_out: Optional[List[int]] = None, each: Optional[int] = None) -> None: ...

    def _all_to_all(self, op: str, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                    finish: Optional[Callable[[], None]]) -> Optional[Handle]: ...

    def _gather_flat(self, output: torch.Tensor, input: torch.Tensor, axis: str, async_op: bool,
                     finish: Optional[Callable[[], None]] = None) -> Optional[Handle]: ...

    def _then(self, rest: Callable[[], None], async_op: bool) -> Optional[Handle]: ...


def reduce_scatter(comm: _Host, output: torch.Tensor, input: torch.Tensor, axis: str, op: str,
                   quant: Quantization, async_op: bool) -> Optional[Handle]:
    """All-to-all of ``input`` [n*k] packed per chunk ([n, W] bytes), then an fp32 sum into ``output`` [k] at
    the receiver, in group-rank order (counted as a ``reduce_scatter``)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_tensor over {axis}: op {op!r} cannot be quantized (sum or avg)")
    n, k = comm.size(axis), output.numel()
    wire = _quant.pack(input.reshape(n, k), quant.bits, quant.block)
    received = torch.empty_like(wire)

    def finish() -> None:
        _quant.unpack_sum(received, k, quant.bits, quant.block, out=output.view(-1))
        if op == "avg":
            output.div_(n)
    return comm._all_to_all("reduce_scatter", received, wire, axis, async_op, finish)


def all_gather(comm: _Host, output: torch.Tensor, input: torch.Tensor, axis: str, quant: Quantization,
               async_op: bool) -> Optional[Handle]:
    """All-gather of ``input`` [k] packed ([1, W] bytes per rank), dequantized into ``output`` [n*k]."""
    n, k = comm.size(axis), input.numel()
    wire = _quant.pack(input.reshape(1, k), quant.bits, quant.block)
    gathered = torch.empty(n, wire.shape[1], dtype=wire.dtype, device=wire.device)
    comm._record("all_gather", axis, nbytes(gathered), RING_WIRE_FACTOR["all_gather"](n))

    def finish() -> None:
        values = _quant.unpack(gathered, k, quant.bits, quant.block)
        output.view(n, k).copy_(values)
    return comm._gather_flat(gathered.view(-1), wire.view(-1), axis, async_op, finish)


def all_reduce(comm: _Host, tensor: torch.Tensor, axis: str, op: str, quant: Quantization,
               async_op: bool) -> Optional[Handle]:
    """:func:`reduce_scatter` of ``tensor`` (any shape) cut into ``n`` chunks of ``k = ceil(numel / n)`` (the
    last zero-padded), then :func:`all_gather` of the summed chunk back into ``tensor``, launched when the
    handle is waited for."""
    n, numel = comm.size(axis), tensor.numel()
    flat = tensor.view(-1)
    source, k = padded(flat, n)
    mine = torch.empty(k, dtype=torch.float32, device=tensor.device)

    def gather() -> None:
        gathered = torch.empty(n * k, dtype=torch.float32, device=tensor.device)
        all_gather(comm, gathered, mine, axis, quant, async_op=False)
        flat.copy_(gathered[:numel])
    first = reduce_scatter(comm, mine, source, axis, op, quant, async_op=True)

    def rest() -> None:
        first.wait()
        gather()
    return comm._then(rest, async_op)
