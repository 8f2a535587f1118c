"""Optimizer offload to host memory (``offload_optimizer="cpu"``, ZeRO stages 1-3).

The fp32 master weights and the optimizer state of a rank's partition live in
host memory (pinned when the model is on a CUDA device, so copies overlap);
the update runs there with the SIMD CPU Adam of :mod:`hybrid.kernels`, which
reads bf16/fp16 gradients directly and writes the rounded low-precision
weights in the same pass.

When the model itself is on the CPU nothing is copied: the host tensors
*are* the partition's tensors (no second copy of weights, gradients or
state), so an offloaded CPU run holds exactly the bytes of a plain one.
"""

from __future__ import annotations

from typing import List, Optional

import torch

OFFLOAD_CHOICES = ("none", "cpu")


def host_device(offload_optimizer: str, device: torch.device) -> Optional[torch.device]:
    """Where the master weights and optimizer state go: the CPU when offloaded, else None (stay on ``device``)."""
    if offload_optimizer not in OFFLOAD_CHOICES:
        raise ValueError(f"offload_optimizer must be one of {', '.join(OFFLOAD_CHOICES)}, got "
                         f"{offload_optimizer!r} (config key zero.offload_optimizer; DeepSpeed "
                         f"zero_optimization.offload_optimizer.device)")
    return torch.device("cpu") if offload_optimizer == "cpu" else None


def _pinned_like(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=t.device.type == "cuda")


class HostCopy:
    """A host-memory twin of a device tensor (itself when the tensor is already in host memory).

    ``host`` is what the CPU optimizer writes; :meth:`to_device` copies it to
    the device tensor (asynchronously from pinned memory).
    """

    def __init__(self, device_tensor: torch.Tensor, host: torch.device):
        self.device_tensor = device_tensor
        self.same = device_tensor.device == host
        self.host = device_tensor if self.same else _pinned_like(device_tensor)

    def to_device(self) -> None:
        if not self.same:
            self.device_tensor.copy_(self.host, non_blocking=True)

    def staging_bytes(self) -> int:
        return 0 if self.same else self.host.numel() * self.host.element_size()


class ChunkOffload:
    """Stages 1-2 with offload: host twins of one group's reduced gradient chunks and low-precision chunks.

    ``grads`` and ``lowp`` are per-segment 1-D host tensors parallel to the
    device chunks; on a CPU model they are the device chunks themselves.
    Each segment's gradient is streamed to the host as soon as its reduction
    lands (:meth:`grad_to_host`, during backward); the step copies whatever
    was not streamed and waits for the copies.
    """

    def __init__(self, device_grads: List[torch.Tensor], device_params: List[torch.Tensor], host: torch.device):
        self._grads = [HostCopy(g, host) for g in device_grads]
        self._params = [HostCopy(p, host) for p in device_params]
        self.grads = [h.host for h in self._grads]
        self.lowp = [h.host for h in self._params]
        self.same = all(h.same for h in self._grads + self._params)
        self._streamed = set()
        self.streamed_last_step = 0  # segments that reached the host during backward in the last step

    def grad_to_host(self, segment: int) -> None:
        """Start copying one segment's reduced gradient chunk to its host twin (it is final for this step)."""
        h = self._grads[segment]
        if not h.same:
            h.host.copy_(h.device_tensor, non_blocking=True)
            self._streamed.add(segment)

    def grads_to_host(self) -> None:
        """Copy the segments not streamed yet and wait until every host twin holds the step's gradient."""
        self.streamed_last_step = len(self._streamed)
        streamed, self._streamed = self._streamed, set()
        if self.same:
            return
        for k, h in enumerate(self._grads):
            if k not in streamed:
                h.host.copy_(h.device_tensor, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def params_to_device(self) -> None:
        for h in self._params:
            h.to_device()

    def staging_bytes(self) -> int:
        return sum(h.staging_bytes() for h in self._grads + self._params)
