"""hybrid.processes: a process tree found from /proc's parent links is stopped whole, and is gone on return."""

from __future__ import annotations

import subprocess
import sys
import time

from hybrid.processes import alive, descendants, stop_tree

# A launcher that starts a worker in a session of its own (as torchrun does; ninja's compilers in their own
# process groups are alike), prints the worker's pid, and waits on it. Both ignore SIGTERM, so only the SIGKILL
# that follows the grace ends them.
WORKER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
LAUNCHER = ("import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"w = subprocess.Popen([sys.executable, '-c', {WORKER!r}], start_new_session=True); "
            "print(w.pid, flush=True); w.wait()")


def _start_tree():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    return launcher, worker


def test_descendants_follow_parent_links_across_sessions():
    launcher, worker = _start_tree()
    try:
        assert descendants(launcher.pid) == [worker]
    finally:
        stop_tree(launcher.pid, grace_s=0.5)
        launcher.wait(timeout=30)


def test_the_whole_tree_is_gone_when_stop_tree_returns():
    for _ in range(3):  # the kill's latency is the scheduler's: give a race three chances to show
        launcher, worker = _start_tree()
        started = time.monotonic()
        stop_tree(launcher.pid, grace_s=0.5)
        took = time.monotonic() - started
        # no waiting here: a caller goes on as soon as stop_tree returns
        assert not alive(launcher.pid) and not alive(worker), "a stopped process still runs"
        assert 0.5 <= took < 15, took  # the grace was honoured for the SIGTERM-ignoring launcher
        assert launcher.wait(timeout=30) == -9


def test_a_process_that_ends_on_sigterm_is_not_waited_for():
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    started = time.monotonic()
    stop_tree(proc.pid, grace_s=20)
    assert time.monotonic() - started < 10
    assert proc.wait(timeout=30) == -15
