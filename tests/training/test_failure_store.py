"""The store a failing job's ranks talk through (hybrid.distributed.default_store), between real processes.

run_main takes it before it closes the process groups; on rank 0 (which hosts the store's server outside
torchrun) that reference must keep the server up, or the peers could not leave or read a record.
"""

import gc
import time

import torch.distributed as dist

from hybrid.distributed import default_store
from hybrid.training import failure
from tests.multiproc import run_distributed

LINE = f"{failure.PREFIX}--load runs/x: checksum mismatch in model_rank1.safetensors"


def _wait_for(store, key: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while store.add(key, 0) == 0:
        assert time.monotonic() < deadline, f"no {key!r} within {seconds:g} s"
        time.sleep(0.05)


def _record_after_rank_0_closed_its_groups():
    rank = dist.get_rank()
    store = failure._store()
    assert store is not None
    dist.barrier()  # both hold the store before rank 0 closes its groups
    if rank == 0:
        dist.destroy_process_group()
        gc.collect()
        store.add("test/closed", 1)
        return failure.peer_failure(store, 2, grace_s=60.0)
    _wait_for(store, "test/closed")
    failure.record(store, 1, 1, LINE)  # record() returns once the store has it
    return None


def test_rank_0s_store_outlives_its_closed_groups():
    found, _ = run_distributed(_record_after_rank_0_closed_its_groups, 2, timeout=150)
    assert found == (1, LINE, False)


def test_no_store_without_a_process_group():
    assert default_store() is None
    assert failure._store() is None
