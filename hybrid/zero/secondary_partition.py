"""hpZ for ZeRO stage 3: a secondary copy of the parameters, sharded only over the node's data-parallel ranks.

``zero.hpz_partition_size = l`` (the ``dp_node`` group: this rank's dp group
members on its own node, :meth:`hybrid.topology.Topology.enable_node_axes`).
After a unit is gathered over ``dp`` (forward), each rank keeps its ``1/l``
slice of the whole unit here; the backward re-gather of that unit is then an
all-gather over ``dp_node`` of these slices, which never leaves the node and
is never quantized: the slices hold exactly the values the forward gather
produced (dequantized, with ``zero.quantized_weights``), so backward computes
with the weights forward used. The optimizer step makes every slice stale
(:meth:`SecondaryPartition.invalidate`); the next gather over ``dp`` refreshes
it. Cost: ``1/l`` of the gathered units' elements per rank, in the
parameters' dtype.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch

from hybrid.comm import Communicator, Handle
from hybrid.zero.stage3_layout import Unit

AXIS = "dp_node"  # the group the secondary partition is sharded over


def hpz_size_problem(size: int, ranks_on_node: int) -> Optional[str]:
    """Why ``zero.hpz_partition_size = size`` cannot run when each node holds ``ranks_on_node`` data-parallel ranks
    of a dp group (None when it can; 1 is off). The one rule of the runtime and the planner."""
    if size == 1 or size == ranks_on_node:
        return None
    if ranks_on_node == 1:
        return (f"zero.hpz_partition_size = {size} but each node holds 1 data-parallel rank of this group, so there "
                f"is no node to shard over; set it to 1 (off)")
    if size > 1 and ranks_on_node % size == 0:
        # DeepSpeed's smaller secondary groups would need a process group per group of `size` ranks inside each
        # node; the node's whole dp group is the only one hybrid creates there (Topology.enable_node_axes), and
        # the full node size gives the same on-node backward gather with a smaller copy per rank.
        return (f"zero.hpz_partition_size = {size} but each node holds {ranks_on_node} data-parallel ranks of this "
                f"group; DeepSpeed also takes a divisor of that (secondary groups of {size} ranks inside a node), "
                f"but hybrid shards the secondary copy over the node's whole data-parallel group, the one process "
                f"group it makes on each node: set it to {ranks_on_node} (the backward gather stays on the node "
                f"the same, and each rank keeps 1/{ranks_on_node} of a unit instead of 1/{size}), or 1 to turn "
                f"hpZ off")
    return (f"zero.hpz_partition_size = {size} but each node holds {ranks_on_node} data-parallel ranks of this "
            f"group; set it to {ranks_on_node} (or 1 to turn hpZ off)")


class SecondaryPartition:
    """This rank's ``1/l`` slice of every gathered (non-persistent) unit, and the ``dp_node`` gather that rebuilds
    a whole unit from the ``l`` slices of the node.

    ``buffer``: ``[sum(unit.numel) / l]`` elements of ``dtype``; slice ``k`` of
    unit ``u`` is ``whole[k*s : (k+1)*s]`` with ``s = unit.numel / l`` (a unit
    is padded to a multiple of ``N_d``, and ``l`` divides ``N_d``). ``rank``:
    this rank's position in ``dp_node`` (its slice).
    """

    def __init__(self, units: List[Unit], comm: Communicator, dtype: torch.dtype, device: torch.device,
                 size: int, rank: int):
        self.comm = comm
        self.size = size
        self.rank = rank
        self._slices: Dict[int, torch.Tensor] = {}
        shares = {u.index: u.numel // size for u in units if not u.persistent}
        for u in units:
            if not u.persistent and u.numel % size:
                raise ValueError(f"unit {u.module_name!r} of {u.numel} elements does not split into {size} slices")
        self.buffer = torch.empty(sum(shares.values()), dtype=dtype, device=device)
        at = 0
        for i, share in shares.items():
            self._slices[i] = self.buffer[at: at + share]
            at += share
        self._fresh: Set[int] = set()  # units whose slice holds the current weights

    def fresh(self, i: int) -> bool:
        """Whether unit ``i``'s slice holds the weights of the current partition (gathered since the last step)."""
        return i in self._fresh

    def store(self, i: int, whole: torch.Tensor) -> None:
        """Keep this rank's slice of unit ``i``'s gathered ``whole`` [unit.numel] (no communication)."""
        mine = self._slices.get(i)
        if mine is None:
            return
        share = mine.numel()
        mine.copy_(whole[self.rank * share: (self.rank + 1) * share])
        self._fresh.add(i)

    def gather(self, i: int, out: torch.Tensor) -> Handle:
        """Async all-gather of unit ``i``'s slices over ``dp_node`` into ``out`` [unit.numel] (stays on the node)."""
        return self.comm.all_gather_into_tensor(out, self._slices[i], AXIS, async_op=True)

    def invalidate(self) -> None:
        """The partition is about to change (an optimizer step, a load): every slice is stale."""
        self._fresh.clear()

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
