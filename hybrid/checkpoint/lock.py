"""One job per save directory: the lock a run holds on its ``--save`` folder.

Two jobs saving into one folder destroy each other's checkpoints: every save
first deletes leftovers of interrupted saves (which include the other job's
files still being written), and each job prunes by its own idea of what is
newest. So a job's global rank 0 holds ``DIR/save.lock`` for the whole run
and a second job is refused at start-up with the holder's host and pid.

The lock file, its exclusive creation and when a holder counts as gone are
:mod:`hybrid.lockfile`'s rules (shared with the kernel build lock). A lock
left by a killed job on this host is broken automatically; one whose holder
ran on another host cannot be checked from here, so the refusal says which
file to delete if that job is no longer running. Locks held by a process are
released at its exit (``atexit``), so only a killed process leaves one behind.

Within one process the lock is counted: the trainer takes it for the run and
:func:`~hybrid.checkpoint.save_checkpoint` takes it again around each save,
which also protects callers that save without the trainer.
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from hybrid import lockfile
from hybrid.bounded_call import StillRunning, call_within
from hybrid.checkpoint.errors import CheckpointError, CheckpointLockedError
from hybrid.checkpoint.layout import SAVE_LOCK_FILE

log = logging.getLogger(__name__)

# (pid, real path of the save dir) -> [our LockOwner record, how many holders in this process]
_HELD: Dict[Tuple[int, str], list] = {}
_atexit_registered = False
# Taking or removing the lock: the guard's own wait, then a few small file operations (mkdir, read, create
# and fsync, unlink). Past this the file system is hung, not busy.
LOCK_FILE_TIMEOUT_S = lockfile.GUARD_TIMEOUT_S + 15.0


def _stale_reason(owner: Optional[lockfile.LockOwner]) -> Optional[str]:
    # An unreadable lock is respected: its writer may be mid-write, and a save folder is too costly to risk.
    return None if owner is None else lockfile.holder_gone(owner)


def refusal(save_dir: Path, holder: Optional[lockfile.LockOwner]) -> str:
    """The one-line error for a save directory held by ``holder``."""
    lock = save_dir / SAVE_LOCK_FILE
    who = f"names {holder.describe()}" if holder is not None else "exists but cannot be read"
    return (f"the save directory {save_dir} (--save) is in use by another job: {lock} {who}. Two jobs saving "
            f"into one folder delete each other's checkpoints; give this run its own --save folder, or stop "
            f"the other job (if it is no longer running, delete {lock})")


class SaveDirLock:
    """The lock on one save directory; :meth:`acquire` / :meth:`release`, or use as a context manager."""

    def __init__(self, save_dir):
        self.save_dir = Path(os.path.abspath(save_dir))  # the same folder even if the working directory changes
        self.path = self.save_dir / SAVE_LOCK_FILE
        self._key: Optional[Tuple[int, str]] = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> "SaveDirLock":
        """Take the lock (creating the directory) or raise :class:`CheckpointLockedError`."""
        if self._key is not None:
            return self
        try:
            key, attempt = call_within(LOCK_FILE_TIMEOUT_S, self._take, name="hybrid-save-lock-take")
        except StillRunning:
            raise CheckpointError(f"cannot lock the save directory {self.save_dir} (--save): the file system did "
                                  f"not answer within {LOCK_FILE_TIMEOUT_S:g} s (a hung mount?)") from None
        except (OSError, TimeoutError) as e:
            raise CheckpointError(f"cannot lock the save directory {self.save_dir} (--save) through "
                                  f"{self.path}: {e}") from None
        if attempt is None:  # this process holds it: one more holder
            entry = _HELD[key]
        else:
            if attempt.broken is not None:
                log.warning("removed the stale lock %s (%s)", self.path, attempt.broken[1])
            if attempt.mine is None:
                raise CheckpointLockedError(refusal(self.save_dir, attempt.holder))
            entry = _HELD[key] = [attempt.mine, 0]
            _release_at_exit()
        entry[1] += 1
        self._key = key
        return self

    def _take(self) -> Tuple[Tuple[int, str], Optional[lockfile.Attempt]]:
        """Create the save directory and, unless this process holds it already, try to take its lock file:
        the directory's key in :data:`_HELD` (this process, its real path) and the attempt (None when held)."""
        try:
            self.save_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the save directory {self.save_dir} (--save): {e}") from None
        key = (os.getpid(), os.path.realpath(self.save_dir))
        if key in _HELD:
            return key, None
        # The directory itself is the flock guard: no extra file in the save folder.
        return key, lockfile.try_take(self.path, _stale_reason, guard=self.save_dir)

    def release(self) -> None:
        """Let go (the file goes when this process's last holder of it lets go); a no-op when not held."""
        key, self._key = self._key, None
        if key is None or key not in _HELD:
            return
        entry = _HELD[key]
        entry[1] -= 1
        if entry[1] <= 0:
            del _HELD[key]
            _remove(Path(key[1]), entry[0])

    def __enter__(self) -> "SaveDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _remove(save_dir: Path, owner: lockfile.LockOwner) -> None:
    """Remove the lock file, waiting at most :data:`LOCK_FILE_TIMEOUT_S`: on a hung mount the run (which may be
    ending on a failed save, its error not yet printed) goes on to exit, and the stale lock is broken later."""
    path = save_dir / SAVE_LOCK_FILE
    try:
        call_within(LOCK_FILE_TIMEOUT_S, lambda: lockfile.release(path, owner, guard=save_dir),
                    name="hybrid-save-lock-release")
    except StillRunning:
        log.warning("gave up removing the lock %s after %g s: the file system does not answer; the next job "
                    "breaks the lock if this host can check its holder, else delete it", path, LOCK_FILE_TIMEOUT_S)
    except (OSError, TimeoutError) as e:  # the run is over either way; a stale lock is broken later
        log.warning("could not remove the lock %s: %s", path, e)


def _release_at_exit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_release_all)
        _atexit_registered = True


def _release_all() -> None:
    """Remove every lock this process still holds (an exception or sys.exit ended the run early)."""
    for key in [k for k in _HELD if k[0] == os.getpid()]:
        owner, _ = _HELD.pop(key)
        _remove(Path(key[1]), owner)


GatherFn = Callable[[Any], List[Any]]


def lock_save_dir(save_dir, *, holder: bool, all_gather_object: GatherFn) -> Optional[SaveDirLock]:
    """Take ``save_dir``'s lock for a whole job; collective over the world.

    The rank with ``holder`` true (global rank 0) takes the lock and every rank
    learns the outcome through ``all_gather_object``
    (``topology.comm.all_gather_object``), so a refusal raises the same
    :class:`CheckpointLockedError` on every rank before any training. Returns
    the held lock on the holder (release it when the run ends), None elsewhere.
    """
    lock, outcome = None, {}
    if holder:
        try:
            lock = SaveDirLock(save_dir).acquire()
        except CheckpointError as e:
            outcome = {"error": str(e), "locked": isinstance(e, CheckpointLockedError)}
    try:
        outcomes = all_gather_object(outcome)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    for o in outcomes:
        if o.get("error"):
            raise (CheckpointLockedError if o.get("locked") else CheckpointError)(o["error"])
    return lock
