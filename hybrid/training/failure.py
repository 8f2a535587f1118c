"""How ``hybrid-train`` ends on an error the user can fix: one line from rank 0, quiet exits elsewhere.

A *user error* is one of the library's user-facing error types
(:data:`USER_ERRORS`: bad settings, a checkpoint that cannot be loaded or
saved, unusable data, a diverged run, ...). Their messages already say what is
wrong and which flag changes it, so ``main`` prints exactly one line,
``hybrid-train: error: <message>``, from rank 0 and exits non-zero
(:func:`exit_code`); every other rank exits with the same code and prints
nothing. Anything else is a bug and keeps its traceback.

Most user errors happen on every rank alike (settings, a model that does not
match the checkpoint, a dataset too small). Some happen on one rank only (the
checksum of the one partition file it reads, a cache only rank 0 writes), and
the other ranks are then waiting for it in a collective. So a failing rank:

1. records ``(exit code, line)`` in the job's rendezvous store, the one channel
   that still works once collectives have failed;
2. closes its gloo process groups, so that peers waiting for it in a
   collective fail now rather than at the collective timeout;
3. waits (at most ``_SETTLE_S``) until every rank has handled the failure,
   since the store may live in this very process (rank 0 outside torchrun).

A peer whose collective failed looks for a record (:func:`peer_failure`) and,
finding one, ends the same way without a traceback: rank 0 prints the
recorded line, the others nothing, all with the recorded exit code. A record
says whether it is a *cause* or a *consequence* (a broken collective, recorded
when no cause was found in time); a rank that failed with a bug of its own
takes no consequence for its reason (its own failure broke that collective)
and keeps its traceback, and records itself as the cause so that rank 0 names
it when rank 0 is not the one that failed. SIGTERM does not cut this short:
the trainer only notes signals from its first line on (but during the
rendezvous, where no rank has anything to record yet), and a rank that is
ending ignores them, so torchrun stopping the job when the first rank exits
changes neither who prints nor the exit status. (torchrun itself then reports
the failed job, with a traceback of its own.)
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
from typing import Any, Callable, Iterator, Optional, Tuple

from hybrid.bounded_call import call_within
from hybrid.checkpoint.errors import CheckpointError
from hybrid.comm import CollectiveError
from hybrid.config.errors import ConfigError
from hybrid.data.errors import DataError
from hybrid.distributed import DistributedEnvError, default_store
from hybrid.layout import LayoutError
from hybrid.topology import TopologyError
from hybrid.training.health import TrainingDiverged
from hybrid.zero.flat_buffer import ZeroConfigError

# CheckpointError covers its subclasses, hybrid.convert's ConversionError among them.
# A CollectiveError (a peer stopped, died or unreachable within the timeout) is no bug of ours either: its
# message names the operation, the axis and the ranks; run_main first looks for the peer's own reason.
USER_ERRORS = (ConfigError, CheckpointError, DataError, TrainingDiverged, DistributedEnvError, LayoutError,
               CollectiveError, TopologyError, ZeroConfigError)
PREFIX = "hybrid-train: error: "
USER_ERROR_EXIT = 1
_KEY = "hybrid-train/failure/"
_PEER_GRACE_S = 2.0  # how long a rank whose collective broke looks for the failing peer's record
_SETTLE_S = 10.0  # how long a failing rank waits for every rank to have read the records
_STORE_S = 5.0  # slack for the store's own answers (its host may be frozen: a store call can block for ever)


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS)


def exit_code(exc: BaseException) -> int:
    """The exit status for a user error: its type's ``exit_code`` (3 for a diverged run), else 1."""
    return int(getattr(exc, "exit_code", USER_ERROR_EXIT))


def error_line(exc: BaseException) -> str:
    """The one line printed for a user error (any newline of the message folded into a space).

    An error raised under :func:`flag_context` starts with the flag it was raised for.
    """
    context = getattr(exc, "hybrid_flag_context", None)
    message = " ".join(str(exc).split("\n")).strip()
    return PREFIX + (f"{context}: {message}" if context else message)


@contextlib.contextmanager
def flag_context(flag: str) -> Iterator[None]:
    """Checkpoint errors raised inside are reported as about ``flag`` (``"--load DIR"``, ``"--save DIR"``).

    The checkpoint layer names files, not the trainer's flags; the error keeps its type.
    """
    try:
        yield
    except CheckpointError as e:
        if getattr(e, "hybrid_flag_context", None) is None:
            e.hybrid_flag_context = flag
        raise


def report(line: str, rank: int) -> None:
    """Print ``line`` on stderr, from rank 0 only."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)


# ---- the record in the rendezvous store ---------------------------------------------------------
# A store call has no deadline of its own that covers a frozen host, so every use below runs in a
# daemon thread joined with a timeout (:func:`_within`); a call that never returns is abandoned.

def _within(seconds: float, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
    """``fn(*args)``, or ``default`` when it raises or has not returned after ``seconds``."""
    try:
        return call_within(seconds, lambda: fn(*args), name="hybrid-failure-store")
    except Exception:  # noqa: BLE001 - a store that failed or froze leaves nothing to record or read
        return default


def _store():
    """The job's rendezvous store (:func:`hybrid.distributed.default_store`), or None (one process, or no
    group yet). Taken before the groups are closed: the reference keeps the store alive on the rank hosting it."""
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no store means nothing to record, never a second failure
        return None


def record(store, rank: int, code: int, line: str, consequence: bool = False) -> None:
    """Leave this rank's failure for its peers (best effort: the store's host may have exited first).

    ``consequence``: the failure is a broken collective, likely the effect of another rank's."""
    def write() -> None:
        store.set(f"{_KEY}{rank}", f"{code}\n{int(consequence)}\n{line}")
        # add() waits for the store's answer: once it returns, the record is there for every peer.
        store.add(f"{_KEY}count", 1)

    _within(_STORE_S, write)


def peer_failure(store, world_size: int, grace_s: float = _PEER_GRACE_S) -> Optional[Tuple[int, str, bool]]:
    """(exit code, line, whether it is a consequence) of the lowest rank that recorded a cause, else of the
    lowest that recorded a consequence, or None.

    Waits up to ``grace_s`` for a record to appear: a collective can fail a
    moment before the failing peer's record is visible. None too when the
    store cannot be read.
    """
    def read() -> Optional[Tuple[int, str, bool]]:
        deadline = time.monotonic() + grace_s
        while store.add(f"{_KEY}count", 0) == 0:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        found = []
        for rank in range(world_size):
            key = f"{_KEY}{rank}"
            if store.check([key]):
                code, consequence, line = store.get(key).decode("utf-8").split("\n", 2)
                found.append((int(code), line, consequence == "1"))
        return min(found, key=lambda f: f[2], default=None)  # a cause first; among equals the lowest rank

    return _within(grace_s + _STORE_S, read)


def _break_collectives() -> None:
    """Close this rank's gloo process groups: peers blocked in a collective with it fail at once.

    (NCCL peers would not notice; there torchrun stops them once a rank exits.)
    """
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()


def _wait_count(store, key: str, target: int, count: int, deadline: float) -> int:
    while count < target and time.monotonic() < deadline:
        time.sleep(0.05)
        count = store.add(key, 0)
    return count


def _settle(store, rank: int, world_size: int) -> None:
    """Wait (bounded) until every rank has read the records, so that the store outlives its readers.

    Rank 0 may host the store (outside torchrun), so it leaves last: every
    rank counts itself as handled, waits for all to be, then the others count
    themselves as gone and exit without touching the store again, and rank 0
    waits for that. (Each add() answers with the new count.)
    """
    deadline = time.monotonic() + _SETTLE_S

    def settle() -> None:
        handled = store.add(f"{_KEY}handled", 1)
        _wait_count(store, f"{_KEY}handled", world_size, handled, deadline)
        if rank != 0:
            store.add(f"{_KEY}gone", 1)
            return
        _wait_count(store, f"{_KEY}gone", world_size - 1, store.add(f"{_KEY}gone", 0), deadline)

    _within(_SETTLE_S + _STORE_S, settle)


# ---- the entry point's wrapper ------------------------------------------------------------------

def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@contextlib.contextmanager
def quiet_unless(show: bool) -> Iterator[None]:
    """Swallow stderr inside unless ``show``: argparse's usage errors, printed by rank 0 only."""
    if show:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def run_main(body: Callable[[], int]) -> int:
    """Run ``body`` (the trainer's entry point) so that a user error ends the job as one line.

    Returns what ``body`` returns; on a user error (its own, or a peer's found
    in the store) raises ``SystemExit`` with the error's exit code after rank 0
    printed the line. Anything else propagates with its traceback.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        return body()
    except Exception as exc:  # noqa: BLE001 - sorted below: user errors end quietly, the rest re-raise
        store = _store()
        found = None
        own_bug = not is_user_error(exc)
        if store is not None and (own_bug or isinstance(exc, CollectiveError)):
            # A broken collective is usually the consequence of a peer's failure, whose record says why.
            found = peer_failure(store, world)
            if found is not None and found[2] and own_bug:
                found = None  # a peer's broken collective: this rank's own failure broke it
        if found is not None:
            code, line, _ = found
        elif not own_bug:
            code, line = exit_code(exc), error_line(exc)
            if store is not None:
                record(store, rank, code, line, consequence=isinstance(exc, CollectiveError))
        else:
            if store is not None:  # rank 0 names the failed rank (its traceback follows on that rank's output)
                text = " ".join(str(exc).split())[:300]
                record(store, rank, USER_ERROR_EXIT,
                       f"{PREFIX}rank {rank} failed with {type(exc).__name__}: {text} (its traceback is in its output)")
            raise
        if store is not None:
            # torchrun sends SIGTERM to the other ranks as soon as one exits: this rank is ending anyway, and
            # must end with the recorded status (not -15), after saying why.
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        report(line, rank)
        if store is not None:
            _break_collectives()
            _settle(store, rank, world)
        raise SystemExit(code) from None
