"""Crash-safe file writes that hash the bytes on their way to disk.

A file is written under a temporary name in its final directory, flushed,
fsync'd, and only then renamed over its final name, so a reader sees either
the old file, the complete new one, or nothing, never a torn file. The sha256
digest is computed from the very bytes handed to ``write``: a multi-GB shard
is never read back just to checksum it.

Renames become durable only once the directory itself is fsync'd; callers do
that with :func:`fsync_dir` after their last rename into a directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]

TEMP_MARKER = ".tmp."
_READ_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True)
class FileDigest:
    sha256: str
    nbytes: int


def temp_name_for(path: Path) -> Path:
    """The temporary sibling of ``path`` written by this process (unique per pid)."""
    return path.with_name(f"{path.name}{TEMP_MARKER}{os.getpid()}")


def is_temp_name(name: str) -> bool:
    return TEMP_MARKER in name


class AtomicHashedFile:
    """A binary file that becomes visible under its name only on :meth:`commit`.

    Usable as a context manager: leaving the block normally commits, leaving
    it with an exception removes the temporary file. ``write`` accepts any
    C-contiguous buffer (bytes, memoryview, numpy array).

    A write the file system refuses (a full disk: ``OSError`` errno 28; with
    buffering it may surface at ``flush`` or :meth:`commit`) raises an
    ``OSError`` naming this file, and is kept as :attr:`write_error`: a
    serializer that calls ``write`` (``torch.save``'s zip writer) may report it
    as an internal error of its own, and :meth:`raise_write_error` puts the
    disk's error back.
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.temp_path = temp_name_for(self.path)
        # "wb" rather than "xb": a temp file of the same pid can only be a
        # leftover of an earlier failed attempt in this same process.
        self._file = open(self.temp_path, "wb")
        self._hash = hashlib.sha256()
        self._nbytes = 0
        self.digest: FileDigest | None = None
        self.write_error: OSError | None = None  # the first write the file system refused

    def write(self, data) -> int:
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValueError(f"write to {self.path}: buffer is not C-contiguous")
        view = view.cast("B")
        try:
            self._file.write(view)
        except OSError as e:
            raise self._refused(e) from None
        self._hash.update(view)
        self._nbytes += view.nbytes
        return view.nbytes

    def _refused(self, e: OSError) -> OSError:
        """``e``, naming this file where it names none, kept as :attr:`write_error` (the first one)."""
        if self.write_error is None:
            self.write_error = e if e.filename else OSError(e.errno, e.strerror, str(self.path))
        return self.write_error

    def raise_write_error(self) -> None:
        """Raise :attr:`write_error` if a write failed (call while handling whatever the writer raised)."""
        if self.write_error is not None:
            raise self.write_error from None

    def flush(self) -> None:
        # Writers such as torch.save call flush; durability comes from commit's fsync. A buffered write the
        # disk refuses fails here (or in commit), not in write.
        try:
            self._file.flush()
        except OSError as e:
            raise self._refused(e) from None

    def commit(self) -> FileDigest:
        """Make the file durable and visible under its final name; returns its digest."""
        if self.digest is not None:
            return self.digest
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        except OSError as e:
            raise self._refused(e) from None
        os.replace(self.temp_path, self.path)
        self.digest = FileDigest(self._hash.hexdigest(), self._nbytes)
        return self.digest

    def abort(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass  # the buffered bytes of a file being discarded failed to flush again: nothing is lost
        try:
            os.unlink(self.temp_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "AtomicHashedFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_bytes_atomic(path: PathLike, data: bytes) -> FileDigest:
    """Atomically replace ``path`` with ``data`` (the directory is not fsync'd)."""
    with AtomicHashedFile(path) as f:
        f.write(data)
    return f.digest  # type: ignore[return-value]


def fsync_dir(path: PathLike) -> None:
    """Persist the entries (creations, renames, removals) of directory ``path``."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of_file(path: PathLike) -> FileDigest:
    """Digest of a file on disk, read in chunks (used to verify on load)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
    return FileDigest(h.hexdigest(), n)
