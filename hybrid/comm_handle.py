"""What a communication operation returns and raises: its :class:`Handle` and, when it fails or times out, a
:class:`CollectiveError` naming the operation, its axis and its group's ranks, raised by the :class:`Guard`
around every wait.

:mod:`hybrid.comm` and its algorithm modules (``hybrid.comm_*``) create them; :mod:`hybrid.comm` re-exports
them: import them from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from typing import Callable, ContextManager, Optional, Tuple

from torch.autograd import profiler as autograd_profiler

from hybrid.comm_accounting import profiler_label


class CollectiveError(RuntimeError):
    """A collective or transfer that failed or timed out, named by operation, axis and group ranks."""


def backend_cause(error: BaseException) -> str:
    """What a torch.distributed error says, in one line: its first line (at most 300 characters), else the
    name of its type."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


@dataclasses.dataclass(frozen=True)
class OpName:
    """What a failed operation was, for its error: ``all_reduce over 'dp' (global ranks [0, 2])``."""

    op: str
    axis: str
    ranks: Tuple[int, ...]

    def describe(self) -> str:
        return f"{self.op} over '{self.axis}' (global ranks {list(self.ranks)})"


class Guard:
    """Around every wait of one operation: add the time blocked to ``blocked`` and re-raise a backend error (a
    timeout, a peer that closed its connection) as a :class:`CollectiveError` naming the operation. While a
    torch profiler records (``--profile``), the wait is also a span named ``{op}/{axis}``
    (:func:`~hybrid.comm_accounting.profiler_label`), so that a trace shows every collective with its axis.

    A class rather than two nested generator context managers, which cost several times as much: it runs around
    every transfer and every wait (hundreds in a pipeline step, as many in a ZeRO-3 step).
    """

    __slots__ = ("_name", "_timeout", "_blocked", "_start", "_span")

    def __init__(self, name: OpName, timeout: Optional[datetime.timedelta], blocked: Callable[[float], None]):
        self._name = name
        self._timeout = timeout
        self._blocked = blocked

    def __enter__(self) -> None:
        self._span = None
        if autograd_profiler._is_profiler_enabled:  # a flag read: no cost on the hot path without a profiler
            self._span = autograd_profiler.record_function(profiler_label(self._name.op, self._name.axis))
            self._span.__enter__()
        self._start = time.perf_counter()

    def __exit__(self, kind, error, traceback) -> bool:
        self._blocked(time.perf_counter() - self._start)
        if self._span is not None:
            self._span.__exit__(None, None, None)
        # torch.distributed's errors (DistBackendError, gloo's timeouts) are RuntimeErrors
        if isinstance(error, RuntimeError) and not isinstance(error, CollectiveError):
            cause = backend_cause(error)
            t = self._timeout
            # The backend fails the wait at the timeout, or earlier when a peer closes its connection: the
            # message gives the limit, not a claim that it was reached.
            limit = f"timeout {t.total_seconds():g} s" if t else "the group's timeout"
            raise CollectiveError(f"{self._name.describe()} did not complete ({limit}): a peer has stopped, died or "
                                  f"is unreachable (backend: {cause})") from error
        return False


class Handle:
    """Result of an async collective. :meth:`wait` blocks until it is done (at most the communicator's timeout).

    ``work``: the backend's work object, waited for inside ``guard()`` (which
    names the operation in errors and counts the time blocked); ``finish``:
    what completes the operation after that (a division, the remaining steps
    of a ring).
    """

    def __init__(self, work=None, finish: Optional[Callable[[], None]] = None,
                 timeout: Optional[datetime.timedelta] = None,
                 guard: Optional[Callable[[], ContextManager[None]]] = None,
                 on_done: Optional[Callable[["Handle"], None]] = None):
        self._work = work
        self._finish = finish
        self._timeout = timeout
        self._guard = guard or contextlib.nullcontext
        self._on_done = on_done
        self._done = work is None and finish is None

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            with self._guard():
                if self._timeout is not None:
                    self._work.wait(self._timeout)
                else:
                    self._work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True
        # drop the work and the closure: they hold the operation's buffers (a quantized one's packed copies)
        self._work = self._finish = None
        if self._on_done is not None:
            self._on_done(self)

    @property
    def done(self) -> bool:
        return self._done
