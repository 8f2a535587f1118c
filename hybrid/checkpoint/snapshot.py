"""A copy of one rank's state in host memory, taken while training waits, written while it goes on.

:class:`HostSnapshot` copies a nested state (dicts, lists and tuples of
tensors, numbers and strings, as the engine's ``state_dict`` parts are) so
that the next optimizer step cannot change what a background writer is
writing. Every tensor is copied, wherever it lives:

* on the CPU, a plain ``clone`` (the host copy is all there is to make);
* on CUDA, into page-locked ("pinned") host buffers that the snapshot keeps
  and reuses at the next save while the tensors keep their shapes, so that a
  save neither allocates nor pins gigabytes again; the copies are issued
  non-blocking and waited for once, at the end, on the current stream.
  (This path is compiled and written for GPUs; the project's tests run it on
  CPU only.)

A :class:`~hybrid.checkpoint.safetensors_stream.TensorSource` is produced at
snapshot time: it reads the live state. Containers are rebuilt and other
leaves kept when immutable, deep-copied otherwise, so the copy shares no
mutable object with the live state.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch

from hybrid.checkpoint.safetensors_stream import TensorSource

_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.Size, torch.device)


def state_nbytes(value: Any) -> int:
    """Bytes of every tensor in a nested state (what one host copy of it costs)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, TensorSource):
        numel = 1
        for n in value.shape:
            numel *= n
        return numel * torch.empty((), dtype=value.dtype).element_size()
    if isinstance(value, dict):
        return sum(state_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_nbytes(v) for v in value)
    return 0


class HostSnapshot:
    """Host copies of nested states; on CUDA it keeps its pinned buffers between saves.

    One snapshot serves one save at a time: the buffers of a save are reused
    by the next, so the caller must not snapshot again before the previous
    copy was written (the background writer allows one save in flight).
    """

    def __init__(self) -> None:
        self._pinned: Dict[str, torch.Tensor] = {}  # path in the state -> reusable page-locked buffer
        self._pending_cuda = False

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes kept for reuse (0 on CPU)."""
        return sum(t.numel() * t.element_size() for t in self._pinned.values())

    def copy(self, value: Any, path: str = "") -> Any:
        """A copy of ``value`` that shares no tensor storage or mutable object with it.

        CUDA copies may still be in flight when this returns: call :meth:`finish` before reading them.
        """
        if isinstance(value, TensorSource):
            value = value.produce()
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), path)
        if isinstance(value, dict):
            items = [(k, self.copy(v, f"{path}/{k}")) for k, v in value.items()]
            out = type(value).__new__(type(value))  # keeps OrderedDict and other dict subclasses
            out.update(items)
            return out
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(self.copy(v, f"{path}/{i}") for i, v in enumerate(value)))
        if isinstance(value, (list, tuple)):
            return type(value)(self.copy(v, f"{path}/{i}") for i, v in enumerate(value))
        if isinstance(value, _IMMUTABLE):
            return value
        return copy.deepcopy(value)

    def finish(self) -> None:
        """Wait for the CUDA copies issued by :meth:`copy` (a no-op on CPU)."""
        if self._pending_cuda:
            torch.cuda.current_stream().synchronize()
            self._pending_cuda = False

    def _copy_tensor(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor.clone(memory_format=torch.contiguous_format)
        buffer = self._pinned_buffer(path, tuple(tensor.shape), tensor.dtype)
        buffer.copy_(tensor, non_blocking=True)
        self._pending_cuda = True
        return buffer

    def _pinned_buffer(self, path: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = self._pinned.get(path)
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype:
            buffer = self._pinned[path] = torch.empty(shape, dtype=dtype, pin_memory=True)
        return buffer
