"""Build index arrays once, on one rank, and share them through ``.npy`` files.

Every rank describes the arrays it needs with a small JSON-able dict. The
dict's hash names the files: ``{cache_dir}/{key}-{name}.npy`` plus
``{key}-description.json``, written last as the completion marker. Rank 0
(of the world when ``torch.distributed`` is initialized) builds and saves
missing arrays; every rank then passes a barrier and memory-maps the files.
Each file is written to a temporary name and moved into place with
``os.replace``, so a reader never sees a partial file.

Where the files go: the caller's ``cache_dir``; when that is only the default
(``index-cache/`` beside the data) it may come with *fallbacks*
(:func:`fallback_dirs`), used when the default cannot be written, as for a
read-only dataset. Rank 0 says so in one line; every rank then reads the first
location that holds a complete cache, so all agree without a message.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from typing import Callable, Mapping, Sequence

import numpy as np

from .errors import DataError, DataFileNotFoundError

_announced: set = set()  # primary directories whose fallback this process has already reported


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
        """Write every array, then the description; raises ``OSError`` when the directory is not writable."""
        os.makedirs(self.cache_dir, exist_ok=True)
        for name in self.names:
            save_array(self.path(name), np.ascontiguousarray(arrays[name]))
        text = json.dumps(self.description, sort_keys=True, indent=1).encode("utf-8")
        _atomic_write(self.marker, lambda f: f.write(text))

    def load(self) -> dict[str, np.ndarray]:
        return {name: np.load(self.path(name), mmap_mode="r", allow_pickle=False) for name in self.names}


def fallback_dirs(primary: str) -> list[str]:
    """Where the cache of the default location ``primary`` goes when ``primary`` is not writable.

    ``hybrid/index-cache/`` under the user's cache directory (``$XDG_CACHE_HOME``,
    else ``~/.cache``), then under the temporary directory; each in a folder
    named by a hash of ``primary``, so that datasets in different directories
    do not share one.
    """
    name = hashlib.sha256(os.path.abspath(primary).encode("utf-8")).hexdigest()[:16]
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tmp = os.path.join(tempfile.gettempdir(), f"hybrid-index-cache-{os.getuid() if hasattr(os, 'getuid') else 0}")
    return [os.path.join(user_cache, "hybrid", "index-cache", name), os.path.join(tmp, name)]


def _save_somewhere(caches: Sequence[IndexCache], arrays: Mapping[str, np.ndarray]) -> None:
    """Save in the first writable location; announce a fallback once; a clear error when none is writable."""
    failures = []
    for cache in caches:
        try:
            cache.save(arrays)
        except OSError as e:
            failures.append(f"{cache.cache_dir} ({e.strerror or e})")
            continue
        primary = caches[0].cache_dir
        if failures and primary not in _announced:
            _announced.add(primary)
            print(f"notice: the index cache {failures[0]} is not writable; using {cache.cache_dir} instead "
                  f"(--data-cache-path chooses the directory)", file=sys.stderr, flush=True)
        return
    raise DataError(f"cannot write the dataset index cache: {'; '.join(failures)}; set --data-cache-path to a "
                    f"writable directory that every rank can read")


def load_or_build(
    cache_dir: str | None,
    description: Mapping,
    names: Sequence[str],
    build: Callable[[], Mapping[str, np.ndarray]],
    rank: int | None = None,
    barrier: Callable[[], None] | None = None,
    fallbacks: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """Arrays ``names`` for ``description``: built by rank 0 if not cached, then read by all.

    ``cache_dir=None`` builds in memory on every rank (the build is
    deterministic) and skips the barrier. ``fallbacks`` are further
    directories, tried in order when ``cache_dir`` is not writable (give them
    only when ``cache_dir`` is a default the user did not choose).
    """
    if cache_dir is None:
        return dict(build())
    rank = default_rank() if rank is None else rank
    barrier = default_barrier if barrier is None else barrier
    caches = [IndexCache(d, description, names) for d in (cache_dir, *fallbacks)]
    if rank == 0 and not any(c.complete() for c in caches):
        _save_somewhere(caches, build())
    barrier()
    for cache in caches:
        if cache.complete():
            return cache.load()
    raise DataFileNotFoundError(
        f"index cache {caches[0].marker} is missing after rank 0 built it; the cache directory "
        f"{caches[0].cache_dir} must be on a filesystem shared by all ranks (--data-cache-path)"
    )
