"""Map a function over a stream in worker processes: results in input order, memory bounded, every wait bounded.

``multiprocessing.Pool`` cannot be made safe against a worker that dies (the
OS stops it for memory, a crash in native code): the task the worker held is
lost and its result is waited on for ever; a worker killed while it reads the
shared task queue leaves that queue's lock held, so even ``Pool.terminate``
then hangs; and the pool's own handler thread polls the workers concurrently
with any caller that does, which garbles the exit codes the fork server
reports. This module therefore runs its own workers, each with a private pipe
and no shared lock: the caller waits on the pipes and the processes' sentinels
together, so a death or a task past its time limit becomes a
:class:`WorkerPoolError` within a bounded time, and every way out kills the
workers.

Workers start from a ``forkserver`` where the platform has one. Forking the
caller itself is unsafe once it runs threads (torch's, a progress bar's, a test
runner's): a lock held by another thread at the fork stays locked in the child
for ever. The fork server is a fresh single-threaded process, so its children
start clean.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from .errors import DataError

T = TypeVar("T")
R = TypeVar("R")

_END = object()  # marks the end of the task stream

# How long the workers get to exit once killed; a kill cannot be ignored, so this is only the kernel's latency.
_REAP_S = 10.0


class WorkerPoolError(DataError):
    """A worker died or a task ran past its time limit; the workers have been stopped."""


def default_start_method() -> str:
    """``forkserver`` where the platform has it (see the module docstring), else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass
class _Worker:
    process: Any  # a multiprocessing Process of the chosen context
    conn: Connection
    task_no: Optional[int] = None  # the task it holds; None when idle


def ordered_map(
    fn: Callable[[T], R],
    tasks: Iterable[T],
    workers: int,
    window: int,
    timeout_s: float,
    start_method: Optional[str] = None,
) -> Iterator[R]:
    """Yield ``fn(task)`` for each task, in order, computed on ``workers`` processes.

    At most ``window`` tasks are handed out ahead of the one being waited on,
    so memory stays flat however long ``tasks`` is. ``fn``, the tasks and the
    results travel by pickle between this process and its own workers, so
    ``fn`` must be importable by name from a module.

    Raises :class:`WorkerPoolError` when any worker dies, or when one task's
    result is not back ``timeout_s`` after it became the one waited on. An
    exception raised by ``fn`` reaches the caller unchanged. Closing the
    generator early (or any error) kills the workers at once.
    """
    if workers < 1 or window < 1:
        raise ValueError(f"workers and window must be >= 1, got {workers} and {window}")
    ctx = multiprocessing.get_context(start_method or default_start_method())
    pool = []
    try:
        for _ in range(workers):
            ours, theirs = ctx.Pipe(duplex=True)
            process = ctx.Process(target=_serve, args=(fn, theirs), daemon=True)
            process.start()
            theirs.close()  # only the worker holds its end, so its death reads as EOF here
            pool.append(_Worker(process, ours))
        yield from _run(pool, iter(tasks), window, timeout_s)
    finally:
        _stop(pool)


def _run(pool: list, tasks: Iterator, window: int, timeout_s: float):
    done: dict = {}  # task number -> (ok, value), for results that came back ahead of their turn
    submitted = wanted = 0
    exhausted = False
    deadline = time.monotonic() + timeout_s
    while True:
        for w in pool:
            if exhausted or submitted - wanted >= window:
                break
            if w.task_no is None:
                task = next(tasks, _END)
                if task is _END:
                    exhausted = True
                    break
                w.task_no = submitted
                try:
                    w.conn.send((submitted, task))  # the worker is idle, so it is reading: this does not block long
                except OSError:
                    pass  # it has just died; its sentinel reports that below
                submitted += 1
        if wanted in done:
            ok, value = done.pop(wanted)
            if not ok:
                raise value
            yield value
            wanted += 1
            deadline = time.monotonic() + timeout_s
            continue
        if exhausted and wanted == submitted:
            return
        remaining = deadline - time.monotonic()
        busy = [w for w in pool if w.task_no is not None]
        ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in pool], max(0.0, remaining)))
        # Results first, so that a death reported below names only the task its worker really lost.
        for w in busy:
            if w.conn in ready:
                try:
                    task_no, ok, value = w.conn.recv()
                except (EOFError, OSError):
                    continue  # it died mid-send; its sentinel reports the death below
                done[task_no] = (ok, value)
                w.task_no = None
        for w in pool:
            if w.process.sentinel in ready:
                w.process.join(_REAP_S)
                held = f"task {w.task_no}" if w.task_no is not None else "no task"
                raise WorkerPoolError(f"worker process {w.process.pid} {_how_it_ended(w.process.exitcode)} while "
                                      f"task {wanted} was waited on; it held {held}")
        if wanted not in done and time.monotonic() >= deadline:
            raise WorkerPoolError(f"task {wanted} was not done {timeout_s:g} s after it was waited on; "
                                  f"its worker is stuck or far too slow")


def _serve(fn, conn: Connection) -> None:
    """A worker's loop: receive ``(task_no, task)``, send ``(task_no, ok, result or exception)``; stop at EOF."""
    # Ctrl-C reaches the whole process group: the caller handles it and kills the workers, which would otherwise
    # each print a KeyboardInterrupt traceback of their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            task_no, task = conn.recv()
        except EOFError:
            return  # the caller is gone
        try:
            reply = (task_no, True, fn(task))
        except Exception as e:
            reply = (task_no, False, _portable(e))
        try:
            conn.send(reply)
        except Exception as e:  # a result that does not pickle: say what it was instead
            conn.send((task_no, False, RuntimeError(f"the worker could not send back {reply[2]!r:.200}: {e}")))


def _portable(e: Exception) -> Exception:
    """``e`` if it survives a pickle round trip (one with a custom ``__init__`` may not), else its description."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _stop(pool: list) -> None:
    for w in pool:
        if w.process.is_alive():
            w.process.kill()
    for w in pool:
        w.process.join(_REAP_S)
        w.conn.close()


def _how_it_ended(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
