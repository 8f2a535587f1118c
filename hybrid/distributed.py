"""Process start-up from torchrun's environment."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from hybrid.comm_handle import backend_cause

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedEnvError(RuntimeError):
    """torchrun's environment is missing or inconsistent."""


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: Optional[str]  # None when running as one process without a process group
    device: torch.device


def _read_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistributedEnvError(f"environment variable {key}={env[key]!r} is not an integer") from None


def parse_env(env: Mapping[str, str]) -> Optional[dict]:
    """Validate torchrun's variables. Returns None for a plain single-process run."""
    present = [k for k in _REQUIRED if k in env]
    if not present:
        return None
    missing = [k for k in _REQUIRED if k not in env]
    if missing:
        raise DistributedEnvError(
            f"incomplete distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing; start the job with torchrun, or unset them all "
            f"to run as a single process")
    rank, world = _read_int(env, "RANK"), _read_int(env, "WORLD_SIZE")
    local_rank = _read_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    if world < 1:
        raise DistributedEnvError(f"WORLD_SIZE={world} must be >= 1")
    if not 0 <= rank < world:
        raise DistributedEnvError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    if local_rank < 0 or local_rank > rank:
        raise DistributedEnvError(f"LOCAL_RANK={local_rank} must be in [0, RANK={rank}]")
    port = _read_int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise DistributedEnvError(f"MASTER_PORT={port} is not a valid TCP port")
    return {"rank": rank, "world_size": world, "local_rank": local_rank}


def init_distributed(timeout_s: float = 600.0, backend: Optional[str] = None,
                     env: Optional[Mapping[str, str]] = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment.

    Picks NCCL when CUDA is available and gloo otherwise (``backend`` overrides),
    binds the CUDA device to ``LOCAL_RANK``, and applies ``timeout_s`` to every
    collective so a lost peer ends in an error instead of a hang. Without
    torchrun's variables it runs as one process and creates no process group.
    Calling it again after the group exists returns the current state.
    """
    env = os.environ if env is None else env
    if dist.is_available() and dist.is_initialized():
        return _current_info(env)
    parsed = parse_env(env)
    cuda = torch.cuda.is_available()
    if parsed is None or (parsed["world_size"] == 1 and backend is None):
        # One process: nothing to rendezvous with.
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        return DistInfo(0, 1, 0, None, device)
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        if not cuda:
            raise DistributedEnvError("backend 'nccl' needs CUDA, which is not available; use gloo")
        if parsed["local_rank"] >= torch.cuda.device_count():
            raise DistributedEnvError(
                f"LOCAL_RANK={parsed['local_rank']} but only {torch.cuda.device_count()} CUDA devices "
                f"are visible; start at most that many processes per node")
        torch.cuda.set_device(parsed["local_rank"])
    try:
        dist.init_process_group(backend=backend, rank=parsed["rank"], world_size=parsed["world_size"],
                                timeout=datetime.timedelta(seconds=timeout_s))
    except (dist.DistStoreError, dist.DistNetworkError) as e:  # the rendezvous, not a bug: say which and why
        where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
        raise DistributedEnvError(
            f"rank {parsed['rank']} of {parsed['world_size']} could not rendezvous at {where} within {timeout_s:g} s "
            f"({backend_cause(e)}); start all {parsed['world_size']} processes with the same MASTER_ADDR and MASTER_PORT "
            f"(torchrun does), or allow longer with --distributed-timeout-minutes") from None
    # Scripts that never call destroy_distributed() still destroy the default group before the
    # interpreter's own teardown (unregister first: registering twice would run it twice).
    atexit.unregister(destroy_distributed)
    atexit.register(destroy_distributed)
    return _current_info(env)


def _current_info(env: Mapping[str, str]) -> DistInfo:
    backend = dist.get_backend()
    rank = dist.get_rank()
    local_rank = int(env.get("LOCAL_RANK", rank))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return DistInfo(rank, dist.get_world_size(), local_rank, backend, device)


def default_store() -> Optional[dist.Store]:
    """The default process group's store (the rendezvous TCPStore, under torch's key prefix), or None when
    there is no process group.

    The ranks' one channel that still works once collectives have failed (see
    :mod:`hybrid.training.failure`). Where a rank hosts the store's server
    (rank 0 outside torchrun; under torchrun its agent does), the server would
    go with the destroyed process groups: holding the returned object keeps it
    serving. Read through the public ``ProcessGroup.get_group_store``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD.get_group_store()


def destroy_distributed() -> None:
    """Destroy the default process group (and any group still alive); a no-op when there is none.

    Close each :class:`~hybrid.topology.Topology` first (:meth:`~hybrid.topology.Topology.close`) so its
    in-flight work is waited for; at interpreter exit both happen in that order by themselves.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
