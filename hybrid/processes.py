"""A process this one started and everything it started in turn, found from /proc and stopped together.

A launcher's children may leave its process group and even its session: torchrun starts each worker in a
session of its own, ninja each compiler in a process group of its own. Neither ``killpg`` nor a session id
reaches them all; the parent links in ``/proc/PID/stat`` do. (Linux; where there is no /proc only the
process itself is stopped.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional

_POLL_S = 0.1
# How long killed processes get to end: a SIGKILL cannot be ignored, so this is only the scheduler's latency
# (a process in an uninterruptible wait, on a hung mount, may outlast it; it is not waited for longer).
KILL_LATENCY_S = 10.0


def _stat_fields(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces): state, ppid, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which has exited and waits to be reaped, does not)."""
    fields = _stat_fields(pid)
    if fields is not None:
        return fields[0] != "Z"
    if Path("/proc").is_dir():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` in the parent links, children first."""
    children: Dict[int, List[int]] = {}
    if Path("/proc").is_dir():
        for entry in Path("/proc").iterdir():
            fields = _stat_fields(int(entry.name)) if entry.name.isdigit() else None
            if fields is not None and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, ())]
        found += frontier
    return found


def stop_tree(pid: int, grace_s: float) -> None:
    """SIGTERM to ``pid`` (a launcher then stops what it started: torchrun its workers), and after at most
    ``grace_s``, SIGKILL to it and to every descendant still alive: those found before and while it ended,
    since an orphan loses its link to ``pid`` once ``pid`` is gone. Returns once the killed ones have ended
    (or after at most ``KILL_LATENCY_S`` more)."""
    tree = set(descendants(pid))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        tree.update(descendants(pid))
        time.sleep(_POLL_S)
    tree.update(descendants(pid))
    killed = []
    for p in (pid, *tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if alive(p):
                os.kill(p, signal.SIGKILL)
                killed.append(p)
    # A SIGKILL is delivered when the process next runs, which on a loaded machine is not at once: wait until
    # they are gone, so that a caller that goes on (to rebuild, to report) no longer shares the machine with them.
    deadline = time.monotonic() + KILL_LATENCY_S
    while any(alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
