"""Multi-process test harness: run a function in N gloo processes on 127.0.0.1.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes,
initialises a gloo process group on a free loopback port through
:func:`hybrid.init_distributed`, calls ``fn(*args)`` in each and returns the
per-rank results in rank order. The first child exception fails the whole run
at once with that child's traceback; a run that outlives ``timeout`` is killed
and reported instead of hanging the suite.

``fn`` must be a module-level function (it is pickled by reference) and its
return value picklable.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch.multiprocessing as mp


class ChildFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
           results, extra_env: Dict[str, str], timeout_s: float) -> None:
    try:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra_env})
        import torch

        # Several ranks share two cores: more intra-op threads only contend.
        torch.set_num_threads(1)
        import hybrid

        hybrid.init_distributed(timeout_s=timeout_s, backend="gloo" if world_size > 1 else None)
        out = fn(*args, **kwargs)
        results.put((rank, "ok", out))
        from hybrid.distributed import destroy_distributed

        destroy_distributed()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    env: Optional[Dict[str, str]] = None, collective_timeout_s: Optional[float] = None,
                    **kwargs: Any) -> List[Any]:
    """``timeout`` bounds the whole run; ``collective_timeout_s`` (default: ``timeout``) each collective."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, kwargs, results,
                                               env or {}, collective_timeout_s or timeout),
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
    return [out[r] for r in range(world_size)]
