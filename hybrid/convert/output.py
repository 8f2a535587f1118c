"""Small pieces shared by the writers: progress, read-ahead, atomic safetensors files.

Every conversion takes ``progress``: ``None`` (silent) or a callable
``progress(description, total_bytes)`` returning a bar with ``update(nbytes)``
and ``close()`` (``tools/convert_checkpoint.py`` passes a tqdm factory).

:func:`read_ahead` produces the next tensor of a file on a worker thread while
the current one is written: writing runs at disk speed, so the reading and
copying (which release the GIL) cost no extra time.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from pathlib import Path
from typing import Callable, Dict, Iterator, Mapping, Optional

import torch

from hybrid.checkpoint import (LATEST_FILE, SaveDirLock, TensorSource, iteration_dir_name, list_iterations,
                               write_safetensors)
from hybrid.checkpoint.atomic import fsync_dir, temp_name_for
from hybrid.convert.consolidate import ConversionError

ProgressFactory = Callable[[str, int], object]


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def open_bar(progress: Optional[ProgressFactory], description: str, total_bytes: int):
    """A progress bar from ``progress``, or one that does nothing."""
    return _Silent() if progress is None else progress(description, total_bytes)


def nbytes_of(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def tracked(shape, dtype: torch.dtype, produce: Callable[[], torch.Tensor], bar) -> TensorSource:
    """A :class:`TensorSource` that advances ``bar`` by its size once produced."""
    shape = tuple(int(s) for s in shape)

    def make() -> torch.Tensor:
        tensor = produce()
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        bar.update(nbytes_of(shape, dtype))
        return tensor

    return TensorSource(shape, dtype, make)


def write_safetensors_file(path, tensors: Mapping[str, object],
                           metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write a safetensors file atomically (temporary name, fsync, rename), one tensor at a time.

    For files outside a hybrid checkpoint (Hugging Face weights, ``to-fp32``),
    which carry no recorded checksum, so none is computed. Returns the bytes written.
    """
    path = Path(path)
    temp = temp_name_for(path)
    try:
        with open(temp, "wb") as f:
            nbytes = write_safetensors(f, tensors, metadata)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return nbytes


@contextlib.contextmanager
def new_checkpoint_in(save, iteration: int, *, force: bool) -> Iterator[None]:
    """Hold ``save``'s save lock (the trainer's, :class:`hybrid.checkpoint.SaveDirLock`) while an offline tool
    writes iteration ``iteration`` there, after refusing a folder that already holds checkpoints unless ``force``.

    The commit of a new checkpoint moves ``latest``: written into a run's folder it would hide that run's newest
    checkpoint, and the run's next resume would load the tool's output instead. Checked under the lock, so no job
    saves in between.
    """
    with SaveDirLock(save):
        existing = [d.path.name for d in list_iterations(Path(save)) if d.complete]
        latest = Path(save) / LATEST_FILE
        if (existing or latest.exists()) and not force:
            held = latest.read_text(errors="replace").strip()[:40] if latest.is_file() else existing[-1]
            raise ConversionError(
                f"--save {save} already holds checkpoints (latest: {held}; {len(existing)} complete); writing "
                f"{iteration_dir_name(iteration)} there would repoint its latest and hide or replace them: give a "
                f"new --save folder, or pass --force to write beside them")
        yield


def writer_order(tensors: Mapping[str, TensorSource]) -> list:
    """The order in which :func:`hybrid.checkpoint.write_safetensors` produces tensors: larger
    element sizes first, then by name (see its module)."""
    return sorted(tensors, key=lambda n: (-torch.empty((), dtype=tensors[n].dtype).element_size(), n))


# A tensor read (from the checkpoint or HF files: local disk or a network mount) that takes longer than this
# plus one second per READ_FLOOR_BYTES_PER_S bytes is hung, not slow.
READ_BASE_TIMEOUT_S = 300.0
READ_FLOOR_BYTES_PER_S = 10e6


def read_timeout_s(shape, dtype: torch.dtype) -> float:
    """How long one tensor's read may take before :func:`read_ahead` reports it hung (seconds)."""
    return READ_BASE_TIMEOUT_S + nbytes_of(shape, dtype) / READ_FLOOR_BYTES_PER_S


class _Read:
    """One ``produce`` running on a daemon thread: a hung read (a dead mount) never keeps the process alive."""

    def __init__(self, name: str, source: TensorSource):
        self.name, self.source = name, source
        self._outcome: list = []
        self._thread = threading.Thread(target=self._run, name=f"hybrid-read-ahead-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome.append((True, self.source.produce()))
        except BaseException as e:  # noqa: BLE001 - raised again on the writing thread
            self._outcome.append((False, e))

    def result(self) -> torch.Tensor:
        limit = read_timeout_s(self.source.shape, self.source.dtype)
        self._thread.join(limit)
        if not self._outcome:
            raise ConversionError(f"reading tensor {self.name!r} ({nbytes_of(self.source.shape, self.source.dtype)} "
                                  f"bytes) did not finish within {limit:g} s: the file system does not answer (a "
                                  f"hung mount?)")
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value


@contextlib.contextmanager
def read_ahead(tensors: Mapping[str, TensorSource]) -> Iterator[Dict[str, TensorSource]]:
    """The same sources, each produced one step ahead on a worker thread.

    When tensor ``i`` is asked for, its read (started when ``i - 1`` was
    handed over) is waited for, and tensor ``i + 1`` (in :func:`writer_order`)
    starts: at most one extra tensor is held, and no two reads run at once, so
    the underlying reader is never used by two threads together. Each wait is
    bounded by :func:`read_timeout_s`; a hung read raises
    :class:`ConversionError` and is abandoned on its daemon thread. A writer
    asking in another order still gets every tensor, just without the overlap.
    """
    order = writer_order(tensors)
    position = {name: i for i, name in enumerate(order)}
    ahead: Dict[str, _Read] = {}  # at most one: the read in flight

    def wrap(name: str) -> TensorSource:
        def produce() -> torch.Tensor:
            read = ahead.pop(name, None)
            for other in list(ahead.values()):  # asked out of order: let the read in flight end first
                ahead.clear()
                other.result()
            tensor = (read or _Read(name, tensors[name])).result()
            nxt = position[name] + 1
            if nxt < len(order):
                ahead[order[nxt]] = _Read(order[nxt], tensors[order[nxt]])
            return tensor
        return TensorSource(tensors[name].shape, tensors[name].dtype, produce)

    try:
        yield {name: wrap(name) for name in tensors}
    finally:
        for read in ahead.values():  # the next tensor's read, never asked for (an error, or a writer that stops)
            try:
                read.result()
            except BaseException:  # noqa: BLE001 - the writer's own outcome is what is reported
                pass
