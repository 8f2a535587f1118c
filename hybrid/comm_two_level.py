"""The communicator's two-level reductions over ``dp``: inside each node first, then across nodes.

After :meth:`hybrid.topology.Topology.enable_node_axes`, ``dp`` rank ``i*l + j``
is rank ``j`` of node ``i`` (``l`` ranks per node, ``m`` nodes;
:meth:`hybrid.grid.Nodes.split`): the ``dp_node`` group holds a node's ``l``
ranks, the ``dp_cross`` group the ``m`` ranks at one position on every node.
Only the step over ``dp_cross`` leaves the node, and only it is quantized
(``quant``): the node's own link is fast, so compressing there would add error
and save little. :class:`hybrid.comm.Communicator` calls these when an
operation is asked for ``two_level`` and :func:`splits_over_nodes` holds.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from hybrid.comm_handle import Handle
from hybrid.comm_tensors import padded
from hybrid.compression import Quantization


class _Host(Protocol):
    """What these reductions use of their :class:`~hybrid.comm.Communicator`."""

    def size(self, axis: str) -> int: ...

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, axis: str, op: str = "sum",
                              async_op: bool = False, quant: Optional[Quantization] = None) -> Optional[Handle]: ...

    def all_reduce(self, tensor: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False,
                   quant: Optional[Quantization] = None) -> Optional[Handle]: ...

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, axis: str,
                               async_op: bool = False) -> Optional[Handle]: ...

    def _then(self, rest: Callable[[], None], async_op: bool) -> Optional[Handle]: ...


def splits_over_nodes(comm: _Host, axis: str) -> bool:
    """Whether a two-level collective over ``axis`` has two levels here (``dp`` with ranks on several nodes
    and several on each node); otherwise the flat collective is the same thing."""
    if axis != "dp":
        raise ValueError(f"a two-level collective runs over 'dp' only, not {axis!r}")
    return comm.size("dp_node") > 1 and comm.size("dp_cross") > 1


def reduce_scatter(comm: _Host, output: torch.Tensor, input: torch.Tensor, op: str,
                   quant: Optional[Quantization], async_op: bool) -> Optional[Handle]:
    """Reduce-scatter of ``input`` [m*l*c] over ``dp`` into ``output`` [c]: inside the node, then across nodes.

    ``input`` is reordered to [l, m, c] so that the ``dp_node`` reduce-scatter
    leaves node rank ``j`` the node's sum of chunks ``i*l + j`` for every ``i``
    ([m*c]); the ``dp_cross`` reduce-scatter over the ``m`` ranks at position
    ``j`` then leaves each its own chunk [c]. Only that second step, ``(m-1)/m``
    of ``m*c`` per rank, leaves the node.
    """
    l, m, c = comm.size("dp_node"), comm.size("dp_cross"), output.numel()
    staged = input.reshape(m, l, c).transpose(0, 1).contiguous()
    node_sum = torch.empty(m * c, dtype=input.dtype, device=input.device)
    first = comm.reduce_scatter_tensor(node_sum, staged.view(-1), "dp_node", async_op=True)

    def across() -> None:
        first.wait()
        comm.reduce_scatter_tensor(output, node_sum, "dp_cross", quant=quant)
        if op == "avg":
            output.div_(l * m)
    return comm._then(across, async_op)


def all_reduce(comm: _Host, tensor: torch.Tensor, op: str, quant: Optional[Quantization],
               async_op: bool) -> Optional[Handle]:
    """All-reduce of ``tensor`` (any shape) over ``dp`` as a reduce-scatter inside the node, an all-reduce of
    that [numel/l] share across nodes (quantized with ``quant``), and an all-gather inside the node;
    ``tensor`` is zero-padded to a multiple of the ``l`` ranks per node."""
    l, numel = comm.size("dp_node"), tensor.numel()
    flat = tensor.view(-1)
    source, share = padded(flat, l)
    mine = torch.empty(share, dtype=tensor.dtype, device=tensor.device)
    first = comm.reduce_scatter_tensor(mine, source, "dp_node", async_op=True)

    def rest() -> None:
        first.wait()
        comm.all_reduce(mine, "dp_cross", op="sum", quant=quant)
        if op == "avg":
            mine.div_(l * comm.size("dp_cross"))
        comm.all_gather_into_tensor(source, mine, "dp_node")
        if source is not flat:
            flat.copy_(source[:numel])
    return comm._then(rest, async_op)
