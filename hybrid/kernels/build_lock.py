"""A build lock that a crashed or killed build cannot leave behind.

The lock is a small JSON file next to the build directory that records who holds it;
:mod:`hybrid.lockfile` holds the rules shared with the save-folder lock (the file's
contents, exclusive creation, when a holder is provably gone, the ``flock`` guard that
keeps two waiters from both breaking the same lock and then both building). On top of
them a build lock is also broken when it is older than ``stale_after_s`` (a build never
takes that long) or unreadable, and a waiter polls until the lock is free.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from hybrid import lockfile
from hybrid.lockfile import LockOwner

__all__ = ["BuildLock", "BuildLockTimeout", "LockOwner", "DEFAULT_STALE_AFTER_S"]

DEFAULT_STALE_AFTER_S = 20 * 60.0


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
        self.guard_path = lockfile.guard_path(self.path)
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
        return lockfile.holder_gone(owner)

    def _try_take(self) -> LockOwner | None:
        """One attempt; returns the current holder when the lock is held by someone live."""
        attempt = lockfile.try_take(self.path, self.stale_reason)
        if attempt.broken is not None:
            owner, reason = attempt.broken
            print(f"[hybrid.kernels] removing stale build lock {self.path} ({reason})", file=sys.stderr)
            self.broken_owners.append(owner)
        if attempt.mine is not None:
            self._owner = attempt.mine
            return None
        # An unreadable holder is broken on the next attempt (it is stale by the rule above).
        return attempt.holder or LockOwner("?", -1, None, time.time())

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
        lockfile.release(self.path, self._owner)
        self._owner = None

    def __enter__(self) -> "BuildLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
