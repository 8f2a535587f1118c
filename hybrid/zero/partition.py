"""This rank's flat partition of a group: the master weights it steps, and how they return to the model.

Stage 0 gives every rank the whole group (one part); stages 1-2 give DP rank
``k`` chunk ``k`` of every segment. The master copy is one contiguous
``[partition_numel]`` tensor of ``master_dtype``, viewed per segment, unless
the parameters already have that dtype: then the masters *are* this rank's
chunks of the parameter buffer (no second copy of the weights).

After an update the new weights reach the model in two moves: the inner
optimizer rounds the masters into this rank's parameter chunks (when they are
separate tensors; :meth:`GroupPartition.write_params` does the same after a
state is loaded), and :meth:`GroupPartition.gather_params` all-gathers every
segment over ``dp`` in place, so each rank again holds the full buffer
(stages 1-2 only).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from hybrid.comm import Communicator, Handle
from hybrid.compression import Quantization
from hybrid.zero.assembled import AssembledTensor, assembled_or_copy
from hybrid.zero.flat_buffer import FlatGroup


class GroupPartition:
    """Master weights of one flat group for the part this rank owns.

    Attributes:
        param_chunks: per segment, this rank's 1-D chunk of the parameter buffer.
        master_chunks: per segment, the 1-D master tensors the optimizer updates
            (the same tensors as ``param_chunks`` when ``aliased``).
        master: the contiguous [partition_numel] master tensor, or None when aliased.
    """

    def __init__(self, group: FlatGroup, part: int, master_dtype: torch.dtype,
                 master_device: Optional[torch.device] = None):
        self.group = group
        self.part = part
        n_seg = len(group.segments)
        self.param_chunks: List[torch.Tensor] = [group.chunk(group.buffer, s, part) for s in range(n_seg)]
        device = master_device if master_device is not None else group.device
        self.aliased = group.dtype == master_dtype and device == group.device
        if self.aliased:
            self.master: Optional[torch.Tensor] = None
            self.master_chunks = self.param_chunks
        else:
            self.master = torch.empty(group.partition_numel, dtype=master_dtype, device=device)
            self.master_chunks = [group.partition_chunk(self.master, s) for s in range(n_seg)]
            for m, p in zip(self.master_chunks, self.param_chunks):
                m.copy_(p)

    def write_params(self) -> None:
        """Round the updated masters into this rank's parameter chunks."""
        if not self.aliased:
            torch._foreach_copy_(self.param_chunks, self.master_chunks)

    def gather_params(self, comm: Communicator, quant: Optional[Quantization] = None) -> List[Handle]:
        """All-gather every segment of the parameter buffer over ``dp`` in place (async handles, in buffer order)."""
        return [self.gather_segment(s, comm, quant) for s in range(len(self.group.segments))]

    def gather_segment(self, segment: int, comm: Communicator, quant: Optional[Quantization] = None) -> Handle:
        """All-gather one segment of the parameter buffer over ``dp`` in place (an async handle).

        ``quant`` (``zero.quantized_weights``): the chunks travel quantized, and every rank's buffer, this
        rank's own chunk included, ends with the same dequantized values.
        """
        seg = self.group.segments[segment]
        full = self.group.buffer[seg.start: seg.start + seg.size]
        return comm.all_gather_into_tensor(full, self.param_chunks[segment], "dp", async_op=True, quant=quant)

    def master_flat(self, lazy: bool = False):
        """The master partition as one contiguous tensor: the live one, or when aliased a copy of the
        parameter chunks (with ``lazy``, an :class:`~hybrid.zero.assembled.AssembledTensor` of them)."""
        if self.master is not None:
            return self.master
        return assembled_or_copy(AssembledTensor.concat(self.master_chunks), lazy)

    def load_master(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.group.partition_numel:
            raise ValueError(f"master partition of group {self.group.index} has {flat.numel()} elements in "
                             f"the checkpoint but {self.group.partition_numel} here; reshard the "
                             f"checkpoint to this data-parallel layout")
        for s, m in enumerate(self.master_chunks):
            m.copy_(self.group.partition_chunk(flat, s))

    def master_bytes(self) -> int:
        """Bytes of master weights that are not the parameters themselves."""
        return 0 if self.master is None else self.master.numel() * self.master.element_size()
