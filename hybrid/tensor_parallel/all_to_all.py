"""A differentiable all-to-all with variable splits: how an MoE layer moves tokens to their experts and back.

Forward: ``input_splits[i]`` rows of ``x`` go to rank ``i`` of ``axis`` and
``output_splits[i]`` rows arrive from it (:meth:`hybrid.comm.Communicator.all_to_all_v`,
counted under the operation's name). Backward is the same exchange reversed:
each row's gradient returns to the rank that sent the row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


def _exchange(x: torch.Tensor, output_splits: List[int], input_splits: List[int], topo: "Topology", axis: str,
              op: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    topo.comm.all_to_all_v(out, x, output_splits, input_splits, axis, op=op)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, topo, axis, op, back_op):
        ctx.splits, ctx.topo, ctx.axis, ctx.back_op = (output_splits, input_splits), topo, axis, back_op
        return _exchange(x, output_splits, input_splits, topo, axis, op)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return (_exchange(grad, input_splits, output_splits, ctx.topo, ctx.axis, ctx.back_op),
                None, None, None, None, None, None)


def all_to_all_v(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], topo: "Topology",
                 axis: str, op: str = "all_to_all_v", back_op: str = "all_to_all_v") -> torch.Tensor:
    """``x`` ``[sum(input_splits), ...]`` -> ``[sum(output_splits), ...]`` over ``axis``: rows in rank order both
    ways. Counted as ``op`` forward and ``back_op`` backward (the gradients' exchange)."""
    return _AllToAllV.apply(x, [int(k) for k in output_splits], [int(k) for k in input_splits], topo, axis, op,
                            back_op)
