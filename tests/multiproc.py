"""Multi-process test harness: run a function in N gloo processes on 127.0.0.1.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes,
initialises a gloo process group on a free loopback port through
:func:`hybrid.init_distributed`, calls ``fn(*args)`` in each and returns the
per-rank results in rank order. The first child exception fails the whole run
at once with that child's traceback; a run that outlives ``timeout`` is killed
and reported instead of hanging the suite.

``fn`` must be a module-level function (it is pickled by reference) and its
return value picklable.

Processes start from a fork server that has already imported torch and
hybrid (``start="forkserver"``): a spawned process spends seconds of CPU
importing them, which at world 4 on two cores was most of a short test's
time. Each child still gets the parent's environment as it is at the call,
as a spawned one would. Benchmarks whose published figures were measured with
fresh interpreters pass ``start="spawn"``.

The rendezvous store is served by this (the parent) process, as torchrun's
agent serves it, not by rank 0: a rank 0 that finishes first and exits would
otherwise take the store with it while other ranks still create their groups
through it. And a rank that finishes stays until every rank has (or the
timeout passes): one that left at once would close its connections while a
slower peer was still making them.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports once, so that its children start with them loaded.
_PRELOAD = ["torch", "hybrid", "tests.multiproc"]


class ChildFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_torchrun(argv: List[str], nproc: int) -> List[str]:
    """The command that runs ``argv`` (as torchrun takes it after its options) as one node of ``nproc``
    processes, rendezvousing on the loopback address only."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *argv]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
           results, child_env: Dict[str, str], timeout_s: float) -> None:
    try:
        # the parent's environment at the call (a fork server's children would otherwise see the server's)
        os.environ.clear()
        os.environ.update({**child_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        import torch

        # Several ranks share two cores: more intra-op threads only contend.
        torch.set_num_threads(1)
        import hybrid

        hybrid.init_distributed(timeout_s=timeout_s, backend="gloo" if world_size > 1 else None)
        out = fn(*args, **kwargs)
        results.put((rank, "ok", out))
        if world_size > 1:
            _wait_for_all(port, world_size, timeout_s)
        from hybrid.distributed import destroy_distributed

        destroy_distributed()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def _wait_for_all(port: int, world_size: int, timeout_s: float) -> None:
    """Return once every rank has called this (the parent's store counts them), or after ``timeout_s``."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    if store.add("harness/finished", 1) == world_size:
        store.set("harness/all_finished", "1")
    try:
        store.wait(["harness/all_finished"])
    except dist.DistStoreError:
        pass  # a rank that never finishes is the parent's to report


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    env: Optional[Dict[str, str]] = None, collective_timeout_s: Optional[float] = None,
                    start: str = "forkserver", **kwargs: Any) -> List[Any]:
    """``timeout`` bounds the whole run; ``collective_timeout_s`` (default: ``timeout``) each collective;
    ``env`` is added to the parent's environment in the children; ``start`` is the start method."""
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server first starts
    results = ctx.Queue()
    store = None
    if world_size > 1:
        # Held until every child is joined below; the children connect to it as clients (the variable is torch's).
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        port = store.port
        env = {**(env or {}), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    else:
        port = free_port()
    child_env = {**os.environ, **(env or {})}
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, kwargs, results,
                                               child_env, collective_timeout_s or timeout),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks timed out after {timeout:.0f}s; "
                                   f"ranks {missing} never finished")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise ChildFailed(f"rank(s) {dead} of {fn.__name__} died with exit codes "
                                      f"{[procs[r].exitcode for r in dead]} and no traceback")
                continue
            if status == "error":
                raise ChildFailed(f"rank {rank} of {fn.__name__} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    return [out[r] for r in range(world_size)]
