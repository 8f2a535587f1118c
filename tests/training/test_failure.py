"""How a failing rank ends (hybrid.training.failure.run_main), against a real in-process store.

The store is the one channel left once collectives fail: each rank records its failure there, a cause or
a consequence (a broken collective), and rank 0 prints the cause. These tests play one rank of two, the
other rank's record written into the store beforehand as that rank would write it.
"""

import signal

import pytest
import torch.distributed as dist

from hybrid.comm import CollectiveError
from hybrid.config.errors import ConfigError
from hybrid.training import failure


@pytest.fixture
def store(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(failure, "_store", lambda: store)
    monkeypatch.setattr(failure, "_break_collectives", lambda: None)
    monkeypatch.setattr(failure, "_settle", lambda store, rank, world: None)  # the other rank is not there
    monkeypatch.setenv("WORLD_SIZE", "2")
    # run_main ignores SIGTERM once it is ending with a store: give the test process (and the processes that
    # later tests start, which inherit it) its handler back
    previous = signal.getsignal(signal.SIGTERM)
    yield store
    signal.signal(signal.SIGTERM, previous)


def _raise(exc):
    def body():
        raise exc
    return body


def test_a_bug_keeps_its_traceback_though_a_peer_recorded_the_collective_it_broke(store, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    broken = CollectiveError("all_reduce over 'dp' (global ranks [0, 1]) did not complete: a peer has stopped")
    failure.record(store, 1, 1, failure.error_line(broken), consequence=True)
    with pytest.raises(FileExistsError):
        failure.run_main(_raise(FileExistsError("runs/tb is a file")))
    assert "did not complete" not in capsys.readouterr().err
    # and it is recorded as the cause, which the peers take over rank 1's consequence
    code, line, consequence = failure.peer_failure(store, 2, grace_s=0.1)
    assert (code, consequence) == (1, False)
    assert line == (f"{failure.PREFIX}rank 0 failed with FileExistsError: runs/tb is a file "
                    f"(its traceback is in its output)")


def test_rank_0_names_a_peers_bug_rather_than_the_collective_it_broke(store, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    failure.record(store, 1, 1, f"{failure.PREFIX}rank 1 failed with FileExistsError: runs/tb is a file", False)
    with pytest.raises(SystemExit) as ended:
        failure.run_main(_raise(CollectiveError("all_reduce over 'dp' did not complete: a peer has stopped")))
    assert ended.value.code == 1
    assert capsys.readouterr().err.strip() == f"{failure.PREFIX}rank 1 failed with FileExistsError: runs/tb is a file"


def test_a_cause_wins_over_a_lower_ranks_consequence(store, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    failure.record(store, 1, 1, f"{failure.PREFIX}all_reduce over 'dp' did not complete", consequence=True)
    failure.record(store, 2, 1, f"{failure.PREFIX}--load runs/x: checksum mismatch in model_rank2.safetensors")
    with pytest.raises(SystemExit):
        failure.run_main(_raise(CollectiveError("all_reduce over 'tp' did not complete")))
    assert "checksum mismatch" in capsys.readouterr().err


def test_a_user_error_prints_one_line_and_is_recorded_as_a_cause(store, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as ended:
        failure.run_main(_raise(ConfigError("--zero-stage 7: must be 0, 1, 2 or 3")))
    assert ended.value.code == 1
    assert capsys.readouterr().err == f"{failure.PREFIX}--zero-stage 7: must be 0, 1, 2 or 3\n"
    assert failure.peer_failure(store, 2, grace_s=0.1) == (1, f"{failure.PREFIX}--zero-stage 7: must be 0, 1, 2 or 3",
                                                           False)
