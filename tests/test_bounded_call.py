"""hybrid.bounded_call: a call's value or error within its deadline, or StillRunning without waiting longer."""

import threading
import time

import pytest

from hybrid.bounded_call import StillRunning, call_within


def test_a_call_that_returns_in_time_gives_its_value_and_its_error():
    assert call_within(5.0, lambda: 42, name="hybrid-test") == 42
    with pytest.raises(KeyError, match="missing"):
        call_within(5.0, lambda: {}["missing"], name="hybrid-test")


def test_a_call_still_running_at_its_deadline_is_abandoned_on_a_daemon_thread():
    release = threading.Event()
    started = time.perf_counter()
    try:
        with pytest.raises(StillRunning, match=r"hybrid-test-stuck: still running after 0\.3 s"):
            call_within(0.3, release.wait, name="hybrid-test-stuck")
        assert time.perf_counter() - started < 1.5
        (abandoned,) = [t for t in threading.enumerate() if t.name == "hybrid-test-stuck"]
        assert abandoned.daemon  # it never keeps the process from exiting
    finally:
        release.set()
    assert issubclass(StillRunning, TimeoutError)
