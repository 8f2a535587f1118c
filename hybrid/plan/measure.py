"""Measure what a training step really holds, so the planner's predictions can be checked.

Two instruments, both counting *storages* (a view shares its base's bytes, so
it costs nothing extra; a tensor saved twice is counted once):

* :class:`SavedActivations` records every tensor autograd saves for backward
  during a forward pass (``torch.autograd.graph.saved_tensors_hooks``),
  leaving out the storages of parameters. Inside a non-reentrant
  recomputation region the region's own hooks take over, so only what the
  region keeps (its inputs) is seen -- exactly what stays in memory.
* :class:`LiveTensorTracker` is a ``TorchDispatchMode`` that follows the bytes
  of every live tensor storage of this process: at entry it takes all tensors
  that exist (found through the garbage collector), then adds every storage an
  operator creates and subtracts it when its last reference dies (a weak
  reference callback). ``peak_bytes`` is the most that was live at once.

What neither sees: memory allocated inside a kernel or a communication
library that never becomes a tensor (gloo's scratch buffers, allocator
slack). That is why these numbers are compared with the planner *without*
its fragmentation allowance.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t.untyped_storage())


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def storage_keys(tensors: Iterable[torch.Tensor]) -> Set[int]:
    """The storage identities of ``tensors`` (for excluding them from a measurement)."""
    return {_storage_key(t) for t in tensors if isinstance(t, torch.Tensor) and _storage_nbytes(t) > 0}


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats counted once)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[_storage_key(t)] = _storage_nbytes(t)
    return sum(seen.values())


class SavedActivations:
    """Bytes of the distinct non-parameter storages autograd saves while the block runs.

    ``exclude``: storage keys to leave out (:func:`storage_keys` of the model's
    parameters). After the block, ``bytes`` is the total and ``by_dtype`` a
    breakdown; ``records`` lists ``(shape, dtype, storage bytes)`` in save order.
    Each storage is also followed until it is freed (after the backward that
    used it): ``peak_held_bytes`` is the most held at once, where a pipeline
    schedule's micro-batches in flight add up and its backwards subtract.
    """

    def __init__(self, exclude: Optional[Set[int]] = None):
        self.exclude = set(exclude or ())
        self._seen: Dict[int, int] = {}
        self.records = []
        self.by_dtype: Dict[torch.dtype, int] = {}
        self._held: Dict[int, int] = {}
        self._refs: Dict[int, weakref.ref] = {}
        self.held_bytes = self.peak_held_bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes() == 0:
            return t
        key = _storage_key(t)
        if key in self.exclude or key in self._held:
            return t
        n = _storage_nbytes(t)
        if key not in self._seen:
            self._seen[key] = n
            self.records.append((tuple(t.shape), t.dtype, n))
            self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + n
        self._held[key] = n
        self._refs[key] = weakref.ref(t.untyped_storage(), lambda _r, k=key: self._release(k))
        self.held_bytes += n
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        return t

    def _release(self, key: int) -> None:
        self.held_bytes -= self._held.pop(key, 0)
        self._refs.pop(key, None)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedActivations":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class LiveTensorTracker(TorchDispatchMode):
    """Follows the bytes of live tensor storages in this process while the mode is active.

    ``start_bytes``: live at entry; ``current_bytes`` now; ``peak_bytes`` the
    maximum seen; ``peak_op`` the operator whose output reached it. Operators
    running on other threads (none in a CPU training step: autograd runs CPU
    backward on the calling thread) are not seen.

    The entry scan matters beyond the starting figure: an in-place operator
    returns a tensor that already existed, and only a storage known from the
    scan is recognised as not new.
    """

    def __init__(self):
        super().__init__()
        self._live: Dict[int, int] = {}
        self._refs: Dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.start_bytes = 0
        self.peak_op = ""

    def _add(self, t: torch.Tensor, op: str = "") -> None:
        if t.device.type == "meta" or t.is_sparse:
            return
        st = t.untyped_storage()
        n = st.nbytes()
        if n == 0:
            return
        key = st.data_ptr()
        if key in self._live:
            if self._live[key] != n:  # resized in place
                self.current_bytes += n - self._live[key]
                self._live[key] = n
            return
        try:
            ref = weakref.ref(st, lambda _r, k=key: self._drop(k))
        except TypeError:  # not weak-referenceable: count it as permanent
            ref = None
        self._live[key] = n
        if ref is not None:
            self._refs[key] = ref
        self.current_bytes += n
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_op = op

    def _drop(self, key: int) -> None:
        n = self._live.pop(key, 0)
        self._refs.pop(key, None)
        self.current_bytes -= n

    def __enter__(self) -> "LiveTensorTracker":
        for t in _live_tensors():
            self._add(t)
        self.start_bytes = self.current_bytes
        self.peak_bytes = self.current_bytes
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, str(func))
        return out

    def reset_peak(self) -> None:
        """Restart peak tracking from what is live now."""
        self.peak_bytes = self.current_bytes
        self.peak_op = ""


def _live_tensors() -> List[torch.Tensor]:
    """Every tensor the garbage collector can see (after a collection), meta tensors excluded."""
    gc.collect()
    out = []
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and not obj.is_sparse:
                    # fake and functional tensors (what torch.compile keeps in its caches) hold no memory: this
                    # raises for them
                    obj.untyped_storage().data_ptr()
                    out.append(obj)
            except Exception:  # noqa: BLE001 - tensor subclasses without a storage
                continue
    return out


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process now."""
    return unique_storage_bytes(_live_tensors())
