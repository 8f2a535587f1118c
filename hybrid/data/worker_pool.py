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

A worker can also be alive but frozen (stopped, stuck in the kernel, swapped
out): it reads and writes nothing, yet its pipe stays open and its sentinel
silent. Tasks and results are often far larger than the pipe's buffer (chunks
of documents run to megabytes), so handing one over takes many writes and
reads, each of which would wait on the frozen worker for ever. The caller
therefore never blocks on a pipe: its ends are non-blocking, and it moves each
message itself, in frames of its own (a length, then the pickled message),
waiting for the pipe with a deadline. Handing a task to a worker must finish
within the time limit from the moment it starts; a result, read in whatever
pieces arrive while the caller waits on all the pipes, must be whole by the
deadline of its task. Either way the error names the worker and the task. The
``multiprocessing`` pipe is only how a worker gets its end (its file
descriptor, as this requires POSIX); the workers read and write it blocking,
which is safe: a worker waits only on the caller, and the caller's end
closes when it exits or is killed.

Workers start from a ``forkserver`` where the platform has one. Forking the
caller itself is unsafe once it runs threads (torch's, a progress bar's, a test
runner's): a lock held by another thread at the fork stays locked in the child
for ever. The fork server is a fresh single-threaded process, so its children
start clean.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import selectors
import signal
import struct
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from hybrid.processes import KILL_LATENCY_S

from .errors import DataError

T = TypeVar("T")
R = TypeVar("R")

_END = object()  # marks the end of the task stream


# A frame: the length of the body, then the body, one pickled message. Eight bytes, so no message is too long.
_HEADER = struct.Struct("!Q")

# poll where there is one: select cannot watch a descriptor numbered 1024 or more, and a big job opens many files.
_Selector = getattr(selectors, "PollSelector", selectors.SelectSelector)


class WorkerPoolError(DataError):
    """A worker died, froze, or a task ran past its time limit; the workers have been stopped."""


def default_start_method() -> str:
    """``forkserver`` where the platform has it (see the module docstring), else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class _Inbox:
    """The frame coming in on one pipe, as far as it has arrived: the header, then the body."""

    def __init__(self) -> None:
        self._header = bytearray(_HEADER.size)
        self._reset()

    def _reset(self) -> None:
        self._body: Optional[bytearray] = None  # allocated once the header says how long it is
        self._got = 0  # bytes of the part being read (header or body) in so far

    def started(self) -> bool:
        return self._body is not None or self._got > 0

    def progress(self) -> str:
        """How much of the frame has come, for an error message."""
        if self._body is None:
            return f"{self._got} of the {_HEADER.size} header bytes of its result"
        return f"{_size(self._got)} of its {_size(len(self._body))} result"

    def read(self, fd: int) -> Optional[bytearray]:
        """Read from ``fd`` until the frame is whole (then return its body) or the pipe has nothing more for now.

        On a non-blocking ``fd`` this never waits: it returns None when the rest has not come yet. On a blocking
        one it waits for the whole frame. Raises EOFError when the writer has closed its end (it exited or died),
        even mid-frame.
        """
        while True:
            part = self._header if self._body is None else self._body
            if self._got < len(part):
                try:
                    n = os.readv(fd, [memoryview(part)[self._got:]])  # into the buffer: a large body is not copied
                except BlockingIOError:
                    return None
                except OSError as e:  # ECONNRESET: the writer is gone, as with EOF
                    raise EOFError(str(e)) from e
                if n == 0:
                    raise EOFError("the pipe's other end is closed")
                self._got += n
            elif self._body is None:
                self._body = bytearray(_HEADER.unpack(self._header)[0])
                self._got = 0
            else:
                body = self._body
                self._reset()  # ready for the next frame
                return body


def _write_all(fd: int, data, deadline: Optional[float] = None) -> bool:
    """Write all of ``data`` to ``fd``; False if a non-blocking ``fd`` took not all of it by ``deadline``.

    A blocking ``fd`` (the worker's) waits as long as the reader does not read, so ``deadline`` applies only to
    a non-blocking one (the caller's). Raises OSError (EPIPE, ECONNRESET) when the reader has gone.
    """
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if not _writable_by(fd, deadline):
                return False
    return True


def _writable_by(fd: int, deadline: Optional[float]) -> bool:
    """Wait until ``fd`` can take more, or until ``deadline``; whether it can."""
    remaining = None if deadline is None else deadline - time.monotonic()
    if remaining is not None and remaining <= 0:
        return False
    with _Selector() as selector:
        selector.register(fd, selectors.EVENT_WRITE)
        return bool(selector.select(remaining))


def _write_frame(fd: int, body: bytes, deadline: Optional[float] = None) -> bool:
    """Write one frame holding ``body`` (see :func:`_write_all` for ``deadline`` and the return)."""
    # Two writes, not one of header + body: that would copy a body of megabytes for eight bytes.
    return _write_all(fd, _HEADER.pack(len(body)), deadline) and _write_all(fd, body, deadline)


def _dumps(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass
class _Worker:
    process: Any  # a multiprocessing Process of the chosen context
    conn: Connection  # the caller's end of the worker's pipe, non-blocking; read and written by its fd only
    task_no: Optional[int] = None  # the task it holds; None when idle
    inbox: _Inbox = field(default_factory=_Inbox)  # its result, as far as it has come
    hung_up: bool = False  # its end of the pipe closed: it has died, and its sentinel will say how


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

    Raises :class:`WorkerPoolError` when any worker dies; when a worker does
    not take a task within ``timeout_s`` of its being handed over; or when one
    task's result is not all back ``timeout_s`` after the task became the one
    waited on. An exception raised by ``fn`` reaches the caller unchanged.
    Closing the generator early (or any error) kills the workers at once.
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
            os.set_blocking(ours.fileno(), False)  # so that no read or write of ours can wait on a frozen worker
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
                _hand_over(w, submitted, task, timeout_s, wanted)
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
        listening = [w.conn for w in busy if not w.hung_up]  # a closed pipe reads as ready for ever: not it
        ready = set(wait(listening + [w.process.sentinel for w in pool], max(0.0, remaining)))
        # Results first, so that a death reported below names only the task its worker really lost.
        for w in busy:
            if w.conn in ready:
                _take_in(w, done)
        for w in pool:
            if w.process.sentinel in ready:
                raise _died(w, wanted)
        if wanted not in done and time.monotonic() >= deadline:
            raise _late(pool, wanted, timeout_s)


def _hand_over(w: _Worker, task_no: int, task, timeout_s: float, wanted: int) -> None:
    """Send task ``task_no`` to the idle worker ``w``, waiting at most ``timeout_s`` for it to take it all.

    An idle worker is reading, so this normally takes no time however large the task; only a frozen worker makes
    it wait, and then for no longer than the time limit. A worker that has died is left for its sentinel to report.
    """
    try:
        taken = _write_frame(w.conn.fileno(), _dumps((task_no, task)), time.monotonic() + timeout_s)
    except OSError:
        return  # it has just died; its sentinel reports that in _run
    if not taken:
        if not w.process.is_alive():
            raise _died(w, wanted)
        raise WorkerPoolError(f"worker process {w.process.pid} did not take task {task_no} within {timeout_s:g} s "
                              f"(it is alive but not reading: frozen or stopped)")


def _take_in(w: _Worker, done: dict) -> None:
    """Read what has come of ``w``'s result, without waiting; once it is whole, file it in ``done``."""
    try:
        body = w.inbox.read(w.conn.fileno())
    except EOFError:
        w.hung_up = True  # it died, mid-send or not; its sentinel reports the death in _run
        return
    if body is not None:
        task_no, ok, value = pickle.loads(body)
        done[task_no] = (ok, value)
        w.task_no = None


def _died(w: _Worker, wanted: int) -> WorkerPoolError:
    w.process.join(KILL_LATENCY_S)
    held = f"task {w.task_no}" if w.task_no is not None else "no task"
    return WorkerPoolError(f"worker process {w.process.pid} {_how_it_ended(w.process.exitcode)} while "
                           f"task {wanted} was waited on; it held {held}")


def _late(pool: list, wanted: int, timeout_s: float) -> WorkerPoolError:
    """The error for task ``wanted`` past its time limit: whether its worker was computing or sending it."""
    late = f"task {wanted} was not done {timeout_s:g} s after it was waited on"
    holder = next((w for w in pool if w.task_no == wanted), None)
    if holder is None:  # not expected: a task waited on is always held
        return WorkerPoolError(f"{late}; its worker is stuck or far too slow")
    if holder.inbox.started():
        return WorkerPoolError(f"{late}: worker process {holder.process.pid} sent {holder.inbox.progress()} and "
                               f"then stopped (it is alive but not writing: frozen or stopped)")
    return WorkerPoolError(f"{late}; its worker (process {holder.process.pid}) is stuck or far too slow")


def _serve(fn, conn: Connection) -> None:
    """A worker's loop: receive ``(task_no, task)``, send ``(task_no, ok, result or exception)``; stop at EOF.

    Its reads and writes block: it has nothing else to do, and they wait only on the caller, whose end closes
    (EOF, EPIPE) when it exits or is killed.
    """
    # Ctrl-C reaches the whole process group: the caller handles it and kills the workers, which would otherwise
    # each print a KeyboardInterrupt traceback of their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = conn.fileno()  # conn stays referenced here, so the descriptor stays open
    os.set_blocking(fd, True)  # as it comes: made explicit, since _Inbox.read and _write_all rely on it
    inbox = _Inbox()
    while True:
        try:
            task_no, task = pickle.loads(inbox.read(fd))
        except EOFError:
            return  # the caller is gone
        try:
            _write_frame(fd, _reply(fn, task_no, task))
        except OSError:
            return  # the caller is gone (or has killed us, and is only waiting for the kill to land)
        del task  # a task of megabytes need not stay alive while the worker waits for the next one


def _reply(fn, task_no: int, task) -> bytes:
    """The pickled ``(task_no, ok, result or exception)`` for ``fn(task)``."""
    try:
        reply = (task_no, True, fn(task))
    except Exception as e:
        reply = (task_no, False, _portable(e))
    try:
        return _dumps(reply)
    except Exception as e:  # a result that does not pickle: say what it was instead
        return _dumps((task_no, False, RuntimeError(f"the worker could not send back {reply[2]!r:.200}: {e}")))


def _portable(e: Exception) -> Exception:
    """``e`` if it survives a pickle round trip (one with a custom ``__init__`` may not), else its description."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _stop(pool: list) -> None:
    """Kill the workers and reap them. SIGKILL ends a stopped (SIGSTOP) process too, so this is bounded."""
    for w in pool:
        if w.process.is_alive():
            w.process.kill()
    for w in pool:
        w.process.join(KILL_LATENCY_S)
        w.conn.close()


def _size(n: int) -> str:
    """``n`` bytes for a message: in MiB, or in bytes where a tenth of a MiB would round to nothing."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 else f"{n} bytes"


def _how_it_ended(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
