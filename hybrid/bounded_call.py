"""A call that may block for ever (a hung mount, a frozen store host), given a deadline.

Nothing can interrupt a thread stuck in a system call, so :func:`call_within`
runs the call on a daemon thread and stops waiting for it: the caller gets a
:class:`StillRunning` error in bounded time and goes on (to report, to exit),
and the abandoned thread never keeps the process alive.

Nothing here imports the rest of hybrid or torch.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Tuple


class StillRunning(TimeoutError):
    """The call had not returned by its deadline; it goes on, abandoned, on a daemon thread."""


def call_within(seconds: float, fn: Callable[[], Any], name: str) -> Any:
    """``fn()``'s value, or its exception raised here, when it returns within ``seconds``; else
    :class:`StillRunning`. ``name`` names the thread (``hybrid-...``), which ``py-spy`` and a
    ``faulthandler`` dump then show."""
    outcome: List[Tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            outcome.append((False, e))

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        raise StillRunning(f"{name}: still running after {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
