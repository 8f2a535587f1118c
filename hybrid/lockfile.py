"""Lock files that a crashed holder cannot leave behind for good.

The one rule shared by the kernel build lock (:mod:`hybrid.kernels.build_lock`)
and the save-folder lock (:mod:`hybrid.checkpoint.lock`):

* A lock is a small JSON file naming its holder: host, pid, the pid's start
  time (to detect pid reuse) and when it was taken.
* It is created with ``O_CREAT | O_EXCL``: of two processes creating it at
  once, exactly one succeeds.
* A holder is *provably gone* when it ran on this host and its pid is dead or
  now belongs to another process (:func:`holder_gone`). Only then, or by a
  caller's own extra rule (the build lock also breaks old locks), may a lock
  be broken.
* Checking, breaking and taking happen under ``flock`` on a guard (a
  sidecar file ``NAME.guard``, or a directory the caller names), which the
  kernel releases when its holder dies, so two processes can never both
  break the same stale lock and then both take it. Waiting for the guard is
  bounded; on a filesystem without ``flock`` the guard is skipped and
  ``O_EXCL`` alone keeps taking exclusive (two processes breaking the same
  stale lock at the same instant could then both succeed).

Nothing here imports the rest of hybrid or torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

GUARD_TIMEOUT_S = 30.0
# flock errors that mean "this filesystem has no flock", not "someone holds it".
# (EBADF: NFS maps flock to POSIX locks, which a directory opened read-only cannot take.)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


def process_start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (Linux), to detect pid reuse."""
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


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


@dataclasses.dataclass(frozen=True)
class LockOwner:
    host: str
    pid: int
    pid_start: Optional[int]
    created: float

    @classmethod
    def me(cls) -> "LockOwner":
        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start_ticks(pid), time.time())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> "Optional[LockOwner]":
        try:
            raw = json.loads(text)
            return cls(str(raw["host"]), int(raw["pid"]), raw.get("pid_start"), float(raw["created"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.created, datetime.timezone.utc)
        return f"pid {self.pid} on host {self.host} (since {since.isoformat(timespec='seconds')})"


def holder_gone(owner: LockOwner) -> Optional[str]:
    """Why ``owner`` provably holds nothing any more, or None when it may still be running.

    Only a holder on this host can be checked; one on another host may always
    still be running.
    """
    if owner.host != socket.gethostname():
        return None
    if not pid_alive(owner.pid):
        return f"holder pid {owner.pid} is no longer running"
    start = process_start_ticks(owner.pid)
    if owner.pid_start is not None and start is not None and start != owner.pid_start:
        return f"pid {owner.pid} now belongs to another process"
    return None


def guard_path(path: Path) -> Path:
    """The default guard of lock ``path``: a sidecar file ``NAME.guard``."""
    return path.with_name(path.name + ".guard")


@contextlib.contextmanager
def guarded(guard: Path, timeout_s: float = GUARD_TIMEOUT_S) -> Iterator[None]:
    """Hold ``flock`` on ``guard`` (a directory, or a file created if missing) for the block.

    Waits at most ``timeout_s``.
    """
    if guard.is_dir():
        fd = os.open(guard, os.O_RDONLY | os.O_DIRECTORY)
    else:
        fd = os.open(guard, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        locked = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Holders keep the guard for microseconds; a long wait means a stopped process.
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout_s:.0f} s for the flock on {guard}, held by a "
                                       f"process that does not let go (stopped?); find it with "
                                       f"'fuser {guard}'") from None
                time.sleep(0.01)
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
                locked = False  # no flock on this filesystem: O_EXCL alone decides who takes the lock
                break
        yield
    finally:
        if locked:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read_owner(path: Path) -> Optional[LockOwner]:
    """The holder recorded in lock ``path`` (None when unreadable); FileNotFoundError when there is no lock."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, IsADirectoryError):
        return None
    return LockOwner.parse(text)


def create_exclusive(path: Path, owner: LockOwner) -> None:
    """Create lock ``path`` naming ``owner``; FileExistsError when it already exists."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, owner.to_json().encode("utf-8"))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """The outcome of one :func:`try_take`."""

    mine: Optional[LockOwner]  # set when this attempt took the lock
    holder: Optional[LockOwner]  # when it did not: the holder (None if its file is unreadable)
    broken: Optional[tuple] = None  # (owner, reason) of a stale lock removed on the way


StaleRule = Callable[[Optional[LockOwner]], Optional[str]]


def try_take(path: Path, stale_reason: StaleRule, guard: Optional[Path] = None) -> Attempt:
    """One attempt to take lock ``path``; a lock whose ``stale_reason`` is not None is broken first.

    ``guard`` is what to ``flock`` meanwhile (default :func:`guard_path`).
    """
    with guarded(guard or guard_path(path)):
        broken = None
        try:
            owner = read_owner(path)
        except FileNotFoundError:
            pass
        else:
            reason = stale_reason(owner)
            if reason is None:
                return Attempt(None, owner)
            path.unlink(missing_ok=True)
            broken = (owner, reason)
        me = LockOwner.me()
        try:
            create_exclusive(path, me)
        except FileExistsError:  # taken by a process that could not use the guard either
            try:
                holder = read_owner(path)
            except FileNotFoundError:
                holder = None
            return Attempt(None, holder, broken)
        return Attempt(me, None, broken)


def release(path: Path, mine: LockOwner, guard: Optional[Path] = None) -> None:
    """Remove lock ``path`` if it still names ``mine`` (if it was broken and retaken, it is someone else's)."""
    with guarded(guard or guard_path(path)):
        try:
            current = read_owner(path)
        except FileNotFoundError:
            return
        if current is not None and (current.host, current.pid, current.created) == \
                (mine.host, mine.pid, mine.created):
            path.unlink(missing_ok=True)
