"""A differentiable all-to-all with variable splits: how an MoE layer moves tokens to their experts and back.

Forward: ``input_splits[i]`` rows of ``x`` go to rank ``i`` of ``axis`` and
``output_splits[i]`` rows arrive from it (:meth:`hybrid.comm.Communicator.all_to_all_v`,
counted under the operation's name). Backward is the same exchange reversed:
each row's gradient returns to the rank that sent the row.

With a :class:`~hybrid.compression.Quantization` every row travels packed
(:mod:`hybrid.kernels.quantize`: ``bits`` per value in blocks with one fp32
scale each) and arrives dequantized in ``x``'s dtype, both ways; the
gradient of the rounding is taken as the identity (the values computed with
are the dequantized ones, the gradients that return are rounded the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from hybrid.compression import Quantization
from hybrid.kernels import quantize as _quant

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


def _exchange(x: torch.Tensor, output_splits: List[int], input_splits: List[int], topo: "Topology", axis: str,
              op: str, quant: Optional[Quantization]) -> torch.Tensor:
    x = x.contiguous()
    if quant is None:
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        topo.comm.all_to_all_v(out, x, output_splits, input_splits, axis, op=op)
        return out
    width = x[0].numel() if x.shape[0] else int(torch.tensor(x.shape[1:]).prod())
    wire = _quant.pack(x.reshape(x.shape[0], width), quant.bits, quant.block)  # [rows, packed bytes]
    arrived = wire.new_empty((sum(output_splits), wire.shape[1]))
    topo.comm.all_to_all_v(arrived, wire, output_splits, input_splits, axis, op=op)
    return _quant.unpack(arrived, width, quant.bits, quant.block).to(x.dtype).view(
        (arrived.shape[0],) + tuple(x.shape[1:]))


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, topo, axis, op, back_op, quant):
        ctx.splits, ctx.topo, ctx.axis, ctx.back_op, ctx.quant = (output_splits, input_splits), topo, axis, back_op, \
            quant
        return _exchange(x, output_splits, input_splits, topo, axis, op, quant)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return (_exchange(grad, input_splits, output_splits, ctx.topo, ctx.axis, ctx.back_op, ctx.quant),
                None, None, None, None, None, None, None)


def all_to_all_v(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], topo: "Topology",
                 axis: str, op: str = "all_to_all_v", back_op: str = "all_to_all_v",
                 quant: Optional[Quantization] = None) -> torch.Tensor:
    """``x`` ``[sum(input_splits), ...]`` -> ``[sum(output_splits), ...]`` over ``axis``: rows in rank order both
    ways. Counted as ``op`` forward and ``back_op`` backward (the gradients' exchange); ``quant``: rows travel
    packed (see the module docstring)."""
    return _AllToAllV.apply(x, [int(k) for k in output_splits], [int(k) for k in input_splits], topo, axis, op,
                            back_op, quant)
