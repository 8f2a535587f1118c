"""A build lock that a crashed or killed build cannot leave behind.

The lock is a small JSON file next to the build directory that records who holds it
(host, PID, the PID's start time, and when it was taken). A waiting process breaks the
lock when the holder is provably gone (same host, PID dead or reused) or when the lock
is older than ``stale_after_s``. Taking and breaking happen under ``flock`` on a sidecar
guard file, which the kernel releases when its holder dies, so two waiters can never both
break the same lock and then both build.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STALE_AFTER_S = 20 * 60.0


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), to detect PID reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are space separated.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LockOwner:
    host: str
    pid: int
    pid_start: int | None
    created: float

    @classmethod
    def me(cls) -> "LockOwner":
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _process_start_ticks(pid), time.time())

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def parse(cls, text: str) -> "LockOwner | None":
        try:
            raw = json.loads(text)
            return cls(str(raw["host"]), int(raw["pid"]), raw.get("pid_start"), float(raw["created"]))
        except (ValueError, KeyError, TypeError):
            return None


class BuildLockTimeout(TimeoutError):
    pass


class BuildLock:
    """Exclusive lock at ``path``; use as a context manager.

    Args:
        path: the lock file (its parent directory is created).
        stale_after_s: a lock older than this is broken even if its holder looks alive.
        timeout_s: give up waiting after this long (None: wait until the lock is free or stale).
        poll_s: how often a waiter re-checks.
    """

    def __init__(self, path: str | os.PathLike, stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 timeout_s: float | None = None, poll_s: float = 0.2):
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.path = Path(path)
        self.guard_path = self.path.with_name(self.path.name + ".guard")
        self.stale_after_s = stale_after_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.broken_owners: list[LockOwner | None] = []
        self._owner: LockOwner | None = None

    def stale_reason(self, owner: LockOwner | None, now: float | None = None) -> str | None:
        """Why a lock held by ``owner`` may be broken, or None if it must be respected."""
        now = time.time() if now is None else now
        if owner is None:
            return "unreadable lock file"
        if now - owner.created > self.stale_after_s:
            return f"older than {self.stale_after_s:.0f} s"
        if owner.host == socket.gethostname():
            if not _pid_alive(owner.pid):
                return f"holder pid {owner.pid} is no longer running"
            start = _process_start_ticks(owner.pid)
            if owner.pid_start is not None and start is not None and start != owner.pid_start:
                return f"pid {owner.pid} now belongs to another process"
        return None

    @contextlib.contextmanager
    def _guard(self):
        fd = os.open(self.guard_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _try_take(self) -> LockOwner | None:
        """One attempt; returns the current holder when the lock is held by someone live."""
        with self._guard():
            if self.path.exists():
                try:
                    owner = LockOwner.parse(self.path.read_text())
                except OSError:
                    owner = None
                reason = self.stale_reason(owner)
                if reason is None:
                    return owner
                print(f"[hybrid.kernels] removing stale build lock {self.path} ({reason})", file=sys.stderr)
                self.broken_owners.append(owner)
                self.path.unlink(missing_ok=True)
            me = LockOwner.me()
            tmp = self.path.with_name(f"{self.path.name}.{me.pid}.tmp")
            tmp.write_text(me.to_json())
            os.replace(tmp, self.path)
            self._owner = me
            return None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        announced = False
        while True:
            holder = self._try_take()
            if holder is None:
                return
            waited = time.monotonic() - start
            if self.timeout_s is not None and waited > self.timeout_s:
                raise BuildLockTimeout(
                    f"build lock {self.path} is held by pid {holder.pid} on {holder.host}; gave up after "
                    f"{waited:.0f} s. If no build is running, delete that file."
                )
            if not announced:
                print(f"[hybrid.kernels] waiting for build lock {self.path} held by pid {holder.pid} on "
                      f"{holder.host} (broken automatically if that process dies or after "
                      f"{self.stale_after_s:.0f} s)", file=sys.stderr)
                announced = True
            time.sleep(self.poll_s)

    def release(self) -> None:
        if self._owner is None:
            return
        with self._guard():
            try:
                current = LockOwner.parse(self.path.read_text())
            except OSError:
                current = None
            # Only remove our own lock: if it was broken as stale, someone else owns the file now.
            if current is not None and current.pid == self._owner.pid and current.created == self._owner.created:
                self.path.unlink(missing_ok=True)
        self._owner = None

    def __enter__(self) -> "BuildLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
