"""hybrid.data.worker_pool: order and bounded waits; a dead or stuck worker ends the map instead of hanging it."""

import multiprocessing
import os
import re
import signal
import threading
import time

import pytest

from hybrid.data.preprocess import preprocess
from hybrid.data.worker_pool import WorkerPoolError, ordered_map
from tests.data.testkit import synthetic_documents, train_tokenizer, write_jsonl


def _square_slowly_when_odd(x):
    # Odd tasks finish after even ones submitted later, so a map that yields in completion order would show it.
    if x % 2:
        time.sleep(0.01)
    return x * x


def _die_on_three(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _hang_on_two(x):
    if x == 2:
        time.sleep(3600)
    return x


def _raise_on_one(x):
    if x == 1:
        raise KeyError("task one")
    return x


class _TwoArgError(Exception):
    def __init__(self, path, line):  # a custom __init__: unpickling would call it with one argument and fail
        super().__init__(f"{path}:{line}")


def _raise_unpicklable(x):
    raise _TwoArgError("corpus.jsonl", x)


def _pool_processes_left(before):
    return [p for p in multiprocessing.active_children() if p not in before]


def test_results_come_in_input_order():
    assert list(ordered_map(_square_slowly_when_odd, range(40), workers=2, window=5, timeout_s=60)) == [
        x * x for x in range(40)]


def test_a_killed_worker_ends_the_map_with_its_signal_and_no_process_is_left():
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(WorkerPoolError, match=r"worker process \d+ was killed by SIGKILL"):
        list(ordered_map(_die_on_three, range(10), workers=2, window=4, timeout_s=60))
    assert time.monotonic() - start < 30  # found by the health check, long before the 60 s limit
    assert _pool_processes_left(before) == []


def test_a_stuck_worker_ends_the_map_at_the_time_limit_and_is_stopped():
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    got = []
    with pytest.raises(WorkerPoolError, match=r"task 2 was not done 1 s after it was waited on"):
        for value in ordered_map(_hang_on_two, range(6), workers=2, window=3, timeout_s=1.0):
            got.append(value)
    assert got == [0, 1]
    assert 1.0 <= time.monotonic() - start < 30
    assert _pool_processes_left(before) == []


def test_an_exception_in_the_function_reaches_the_caller_unchanged():
    with pytest.raises(KeyError, match="task one"):
        list(ordered_map(_raise_on_one, range(4), workers=2, window=2, timeout_s=60))


def test_an_exception_that_does_not_unpickle_arrives_as_its_description():
    with pytest.raises(RuntimeError, match=r"_TwoArgError: corpus.jsonl:0"):
        list(ordered_map(_raise_unpicklable, range(2), workers=1, window=1, timeout_s=60))


def test_preprocess_with_a_worker_killed_stops_and_writes_nothing(tmp_path):
    tok_model = train_tokenizer(tmp_path / "tok")
    # Enough two-document chunks to keep the workers busy for seconds, well past the moment of the kill.
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(20000, seed=5, max_words=30))
    before = set(multiprocessing.active_children())
    killed = []

    def kill_a_worker():
        # Kill a worker once the pool has been running a while, as the OS would for memory. A worker killed
        # before any task is handed out loses nothing (the pool replaces it), so that would test nothing.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = _pool_processes_left(before)
            if workers and workers[0].pid is not None:
                time.sleep(0.5)
                os.kill(workers[0].pid, signal.SIGKILL)
                killed.append(workers[0].pid)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_worker, daemon=True)
    killer.start()
    with pytest.raises(ValueError, match=r"worker process \d+ was killed by SIGKILL.*fewer --workers"):
        preprocess(str(corpus), tok_model, str(tmp_path / "out"), workers=2, chunk_docs=2, progress=False)
    killer.join(timeout=60)
    assert killed
    assert not list(tmp_path.glob("out*"))
    assert _pool_processes_left(before) == []


_INTERRUPTED_MAP = """
import sys, time
sys.path.insert(0, {repo!r})
from hybrid.data.worker_pool import ordered_map
from tests.data.test_worker_pool import _sleep_then_return

if __name__ == "__main__":
    for value in ordered_map(_sleep_then_return, range(1000), workers=2, window=4, timeout_s=60):
        print("got", value, flush=True)
"""


def _sleep_then_return(x):
    time.sleep(0.2)
    return x


def _processes_in_session(sid: int) -> list:
    """Live process ids whose session is ``sid`` (``/proc/PID/stat``: the session is the 6th field)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue  # it ended meanwhile
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _ignores_ctrl_c(_):
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_workers_ignore_ctrl_c():
    assert list(ordered_map(_ignores_ctrl_c, range(4), workers=2, window=2, timeout_s=60)) == [True] * 4


def test_ctrl_c_stops_the_caller_once_and_leaves_no_worker(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED_MAP.format(repo=str(repo)))
    # a session of its own, so that the SIGINT goes to its process group as a terminal's Ctrl-C does; and SIGINT
    # at its default, as in a terminal: a suite started in the background of a non-interactive shell inherits it
    # ignored, and Python then leaves it ignored in every process it starts
    proc = subprocess.Popen([sys.executable, str(script)], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().startswith("got 0")  # the workers are running
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    # the caller's alone: the workers ignore it and are killed ("Process ForkServerProcess-N:" heads a worker's)
    assert err.count("KeyboardInterrupt") == 1 and "Process " not in err, err
    deadline = time.monotonic() + 30  # the fork server notices its caller is gone and exits within moments
    while True:
        leftover = _processes_in_session(proc.pid)
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert leftover == []


# A worker that is alive but frozen (stopped, stuck in the kernel, swapped out) reads and writes nothing. Tasks
# and results larger than the buffer between caller and worker (64 KiB for a pipe, some 200 KiB for a socket
# pair) then cannot be handed over in one go, so the caller's side of the transfer must have a deadline too.
_BIG_TASK_BYTES = 1 << 20
_BIG_RESULT_BYTES = 50 << 20
_HUNG = object()  # what _map_in_thread returns for a map that did not end in time


def _map_in_thread(limit_s, *args, **kwargs):
    """``list(ordered_map(*args, **kwargs))`` in a thread, so that a map that hangs fails the test instead of
    hanging it. Returns the results or the exception raised (``_HUNG`` if it ran past ``limit_s``) and the
    seconds it took."""
    outcome = [_HUNG]

    def run():
        try:
            outcome[0] = list(ordered_map(*args, **kwargs))
        except BaseException as e:
            outcome[0] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    return outcome[0], time.monotonic() - start


def _state(pid: int):
    """The state letter of process ``pid`` (``T``: stopped, ``Z``: not yet reaped), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _kill_stopped(pids) -> None:
    """SIGKILL whichever of ``pids`` is still stopped, so that a failed test (a hung map) ends its thread."""
    for pid in pids:
        if _state(pid) == "T":
            os.kill(pid, signal.SIGKILL)


def _length(data):
    return len(data)


def _stop_the_workers_first(before, stopped, tasks):
    """``tasks``, after SIGSTOP-ing the pool's workers: the map takes its first task once they have started."""
    for p in _pool_processes_left(before):
        os.kill(p.pid, signal.SIGSTOP)
        stopped.append(p.pid)
    yield from tasks


def test_a_frozen_worker_that_does_not_take_a_large_task_ends_the_map_at_the_time_limit():
    before = set(multiprocessing.active_children())
    stopped = []
    tasks = _stop_the_workers_first(before, stopped, [bytes(_BIG_TASK_BYTES)])
    try:
        outcome, took = _map_in_thread(20, _length, tasks, workers=1, window=1, timeout_s=1.0)
        assert outcome is not _HUNG, "the map hung handing a task to a stopped worker"
        assert len(stopped) == 1
        assert isinstance(outcome, WorkerPoolError), outcome
        assert str(outcome) == (f"worker process {stopped[0]} did not take task 0 within 1 s "
                                f"(it is alive but not reading: frozen or stopped)")
        assert 1.0 <= took < 10
        assert _pool_processes_left(before) == []
        assert _state(stopped[0]) is None  # killed and reaped, not left stopped
    finally:
        _kill_stopped(stopped)


def _bytes_written() -> int:
    """What this process has written so far, pipes and sockets included (``wchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _large_result_then_freeze_midway_through_sending_it(x):
    """For task 1, return a large result, and stop the worker once part of it, more than a frame header, is sent.

    Task 0 only lets the worker start (import this module and its imports), which may take longer than the time
    limit on a busy machine: task 1's time starts when task 0's result is back.
    """
    if x == 0:
        return None
    result = bytes(_BIG_RESULT_BYTES)
    written_before = _bytes_written()

    def stop_if_sending(signum, frame):
        if _bytes_written() - written_before > 1024:
            os.kill(os.getpid(), signal.SIGSTOP)

    # The timer's signal cuts the worker's blocking write short when it waits for the caller to read (the write
    # returns what it has sent so far), and the handler then runs between two writes: with part of the result
    # sent and the rest not. The write of 50 MiB waits many times, so its first cut comes long before its end.
    signal.signal(signal.SIGALRM, stop_if_sending)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    return result


def test_a_worker_frozen_midway_through_sending_a_large_result_ends_the_map_at_the_time_limit():
    before = set(multiprocessing.active_children())
    try:
        outcome, took = _map_in_thread(20, _large_result_then_freeze_midway_through_sending_it, range(2),
                                       workers=1, window=1, timeout_s=1.0)
        assert outcome is not _HUNG, "the map hung reading the result of a worker stopped while sending it"
        assert isinstance(outcome, WorkerPoolError), type(outcome)
        sent = re.fullmatch(r"task 1 was not done 1 s after it was waited on: worker process (\d+) sent "
                            r"(?:[\d.]+ MiB|\d+ bytes) of its 50\.0 MiB result and then stopped \(it is alive but not writing: "
                            r"frozen or stopped\)", str(outcome))
        assert sent, outcome
        assert 1.0 <= took < 10
        assert _pool_processes_left(before) == []
        assert _state(int(sent[1])) is None  # killed and reaped, not left stopped
    finally:
        _kill_stopped([p.pid for p in _pool_processes_left(before)])


def _doubled(data):
    return data + data


def test_large_tasks_and_results_arrive_whole_and_in_order():
    # Several MiB each way, far over the buffer between caller and worker; sizes differ so a mix-up shows.
    tasks = [bytes([i]) * ((3 << 20) + i) for i in range(6)]
    assert list(ordered_map(_doubled, tasks, workers=2, window=3, timeout_s=60)) == [t + t for t in tasks]
