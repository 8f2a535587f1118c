"""Optimizer offload to host memory (``offload_optimizer="cpu"``, ZeRO stages 1-3).

The fp32 master weights and the optimizer state of a rank's partition live in
host memory (pinned when the model is on a CUDA device, so copies overlap);
the update runs there with the SIMD CPU Adam of :mod:`hybrid.kernels`, which
reads bf16/fp16 gradients directly and writes the rounded low-precision
weights in the same pass.

When the model itself is on the CPU nothing is copied: the host tensors
*are* the partition's tensors (no second copy of weights, gradients or
state), so an offloaded CPU run holds exactly the bytes of a plain one.

Debug mode (``HYBRID_DEBUG_POISON_HOST=1``, stages 1-2): the copies between
host and device are non-blocking, so a missing wait or a missing copy would
let the optimizer read a stale host gradient, or the device keep a stale
weight, without any error. With the variable set, the host twins are
filled with NaN as soon as the step no longer needs their contents: the
gradient twins right after the update has read them, the weight twins right
after the wait that ends the previous step's device copies. A copy that
did not land, or landed after that point, then turns the weights or the
loss into NaN. On a CPU model the twins get their own memory in this mode
(unless the masters are the weights themselves, as in an fp32 run), so the
same check runs there too.
"""

from __future__ import annotations

import os
from typing import List, Mapping, Optional

import torch

OFFLOAD_CHOICES = ("none", "cpu")
POISON_ENV = "HYBRID_DEBUG_POISON_HOST"


def poison_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``HYBRID_DEBUG_POISON_HOST`` asks for the debug poisoning of the host twins (1/0, unset: 0)."""
    raw = (os.environ if environ is None else environ).get(POISON_ENV, "").strip().lower()
    if raw in ("", "0", "false", "off"):
        return False
    if raw in ("1", "true", "on"):
        return True
    raise ValueError(f"{POISON_ENV}={raw!r} is not a switch; set it to 1 to poison the offload host buffers "
                     f"between steps (debug), or 0 / unset it")


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

    def __init__(self, device_tensor: torch.Tensor, host: torch.device, separate: bool = False):
        self.device_tensor = device_tensor
        self.same = device_tensor.device == host and not separate
        self.host = device_tensor if self.same else _pinned_like(device_tensor)

    def poison(self) -> None:
        """Fill the host twin with NaN (debug mode; never the device tensor itself)."""
        if not self.same:
            self.host.fill_(float("nan"))

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

    ``poison``: the debug mode of the module docstring; the twins get their
    own memory even on a CPU model. Only for partitions whose weights the
    inner step writes through ``lowp`` (not when the masters are the weights).
    """

    def __init__(self, device_grads: List[torch.Tensor], device_params: List[torch.Tensor], host: torch.device,
                 poison: bool = False):
        self.poison = poison
        self._grads = [HostCopy(g, host, separate=poison) for g in device_grads]
        self._params = [HostCopy(p, host, separate=poison) for p in device_params]
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
        if self.poison:
            # The wait above also ended the last step's weight copies: the inner step must rewrite every
            # element of the weight twins before they travel again.
            for h in self._params:
                h.poison()

    def params_to_device(self) -> None:
        for h in self._params:
            h.to_device()
        if self.poison:
            # The update has read the gradient twins (synchronously, on the host) and no copy into them is
            # in flight: the next step must fill every element again before its update reads them.
            for h in self._grads:
                h.poison()

    def staging_bytes(self) -> int:
        return sum(h.staging_bytes() for h in self._grads + self._params)
