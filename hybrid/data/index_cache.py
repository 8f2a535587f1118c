"""Build index arrays once, on one rank, and share them through ``.npy`` files.

Every rank describes the arrays it needs with a small JSON-able dict. The
dict's hash names the files: ``{cache_dir}/{key}-{name}.npy`` plus
``{key}-description.json``, written last as the completion marker. Rank 0
(of the world when ``torch.distributed`` is initialized) builds and saves
missing arrays; every rank then passes a barrier and memory-maps the files.
Each file is written to a temporary name and moved into place with
``os.replace``, so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Callable, Mapping, Sequence

import numpy as np


def describe_key(description: Mapping) -> str:
    """A stable hash of ``description`` (sorted JSON)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def default_rank() -> int:
    """This process's world rank, or 0 when ``torch.distributed`` is not initialized."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def default_barrier() -> None:
    """World barrier when ``torch.distributed`` is initialized, else nothing.

    ``hybrid.data`` depends on no other part of hybrid, so this one barrier is
    issued directly on the default (world) group rather than through hybrid.comm.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_write(path: str, write: Callable) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_array(path: str, array: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


class IndexCache:
    """The ``.npy`` files of one description under ``cache_dir``."""

    def __init__(self, cache_dir: str, description: Mapping, names: Sequence[str]):
        self.cache_dir = os.fspath(cache_dir)
        self.description = dict(description)
        self.names = list(names)
        self.key = describe_key(self.description)

    def path(self, name: str) -> str:
        return os.path.join(self.cache_dir, f"{self.key}-{name}.npy")

    @property
    def marker(self) -> str:
        return os.path.join(self.cache_dir, f"{self.key}-description.json")

    def complete(self) -> bool:
        return os.path.isfile(self.marker) and all(os.path.isfile(self.path(n)) for n in self.names)

    def save(self, arrays: Mapping[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
        except OSError as e:
            raise OSError(
                f"cannot create the index cache directory {self.cache_dir} ({e}); pass a writable cache_dir"
            ) from e
        for name in self.names:
            save_array(self.path(name), np.ascontiguousarray(arrays[name]))
        text = json.dumps(self.description, sort_keys=True, indent=1).encode("utf-8")
        _atomic_write(self.marker, lambda f: f.write(text))

    def load(self) -> dict[str, np.ndarray]:
        if not self.complete():
            raise FileNotFoundError(
                f"index cache {self.marker} is missing after rank 0 built it; cache_dir "
                f"{self.cache_dir} must be on a filesystem shared by all ranks"
            )
        return {name: np.load(self.path(name), mmap_mode="r", allow_pickle=False) for name in self.names}


def load_or_build(
    cache_dir: str | None,
    description: Mapping,
    names: Sequence[str],
    build: Callable[[], Mapping[str, np.ndarray]],
    rank: int | None = None,
    barrier: Callable[[], None] | None = None,
) -> dict[str, np.ndarray]:
    """Arrays ``names`` for ``description``: built by rank 0 if not cached, then read by all.

    ``cache_dir=None`` builds in memory on every rank (the build is
    deterministic) and skips the barrier.
    """
    if cache_dir is None:
        return dict(build())
    rank = default_rank() if rank is None else rank
    barrier = default_barrier if barrier is None else barrier
    cache = IndexCache(cache_dir, description, names)
    if rank == 0 and not cache.complete():
        cache.save(build())
    barrier()
    return cache.load()
