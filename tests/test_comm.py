import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid.comm import Communicator
from hybrid.distributed import DistributedEnvError, init_distributed, parse_env
from hybrid.topology import Topology
from tests.multiproc import ChildFailed, run_distributed


def _collectives():
    topo = Topology(tp=2)  # world 4: dp groups of 2
    comm = topo.comm
    r = topo.rank
    out = {}
    comm.reset_stats()
    x = torch.full((8,), float(r), dtype=torch.float32)
    h = comm.all_reduce(x, "world", async_op=True)
    h.wait()
    out["all_reduce"] = x[0].item()
    y = torch.full((4,), float(r))
    comm.all_reduce(y, "dp", op="avg")
    out["avg_dp"] = y[0].item()
    full = torch.arange(8, dtype=torch.bfloat16) + r
    part = torch.empty(4, dtype=torch.bfloat16)
    comm.reduce_scatter_tensor(part, full, "dp", async_op=True).wait()
    out["reduce_scatter"] = part.float().tolist()
    gathered = torch.empty(8, dtype=torch.float16)
    comm.all_gather_into_tensor(gathered, torch.full((4,), float(r), dtype=torch.float16), "dp")
    out["all_gather"] = gathered.float().tolist()
    m = torch.tensor([float(r)])
    comm.all_reduce(m, "world", op="max")
    out["max"] = m.item()
    b = torch.tensor([float(r) + 10])
    comm.broadcast(b, "tp", src=1)
    out["broadcast"] = b.item()
    out["report"] = comm.report()
    out["dp_ranks"] = topo.group_ranks("dp")
    out["tp_ranks"] = topo.group_ranks("tp")
    return out


def test_collectives_and_byte_accounting():
    results = run_distributed(_collectives, 4)
    for r, res in enumerate(results):
        dp = res["dp_ranks"]
        assert res["all_reduce"] == 0 + 1 + 2 + 3
        assert res["avg_dp"] == sum(dp) / 2
        pos = dp.index(r)
        expected_full = [sum(i + q for q in dp) for i in range(8)]
        assert res["reduce_scatter"] == expected_full[4 * pos: 4 * pos + 4]
        assert res["all_gather"] == [float(dp[0])] * 4 + [float(dp[1])] * 4
        assert res["max"] == 3.0
        assert res["broadcast"] == res["tp_ranks"][1] + 10
        rep = res["report"]
        # fp32 all-reduce of 8 elements over 4 ranks: payload 32 B, ring wire 2*(3/4)*32.
        assert rep["all_reduce/world"]["payload_bytes"] == 32 + 4
        assert rep["all_reduce/world"]["wire_bytes"] == pytest.approx(1.5 * 36)
        assert rep["reduce_scatter/dp"] == {"calls": 1, "payload_bytes": 16, "wire_bytes": 8.0, "inter_node_bytes": 0.0}
        assert rep["all_gather/dp"] == {"calls": 1, "payload_bytes": 16, "wire_bytes": 8.0, "inter_node_bytes": 0.0}
        assert rep["all_reduce/dp"]["payload_bytes"] == 16


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank one")
    return dist.get_rank()


def test_harness_reports_child_traceback():
    with pytest.raises(ChildFailed, match="boom from rank one"):
        run_distributed(_raise_on_rank_one, 2)


def _hang_on_rank_zero():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(60)


def test_harness_times_out_instead_of_hanging():
    # rank 1 returns at once, but on a loaded machine starting it can take the whole 8 s: it may be named too
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] never finished"):
        run_distributed(_hang_on_rank_zero, 2, timeout=8)


@pytest.mark.parametrize("env,match", [
    ({"RANK": "0"}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is outside"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "not a valid TCP port"),
    ({"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_RANK=1"),
])
def test_bad_environment_is_reported(env, match):
    with pytest.raises(DistributedEnvError, match=match):
        parse_env(env)


def test_single_process_without_torchrun():
    info = init_distributed(env={})
    assert (info.rank, info.world_size, info.backend) == (0, 1, None)
    assert parse_env({}) is None


_LONELY_RANK = """
import os, socket, sys
from hybrid.distributed import DistributedEnvError, init_distributed

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
try:
    init_distributed(timeout_s=2.0, backend="gloo")
except DistributedEnvError as e:
    print("ERROR", e)
    sys.exit(1)
"""


def test_a_rank_whose_peers_never_come_gets_one_line_naming_the_rendezvous():
    root = Path(__file__).resolve().parents[1]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _LONELY_RANK], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ERROR rank 0 of 2 could not rendezvous at 127.0.0.1:"), proc.stdout
    assert "--distributed-timeout-minutes" in proc.stdout and "\n" not in proc.stdout.strip()
    assert time.monotonic() - start < 60  # the 2 s timeout, not the default 600 s


def _timeout_child():
    import time

    import torch.distributed as dist

    # The world group waits a minute (run_distributed's collective_timeout_s); the tp group created by the
    # Topology must wait only its communicator's 2 s.
    topo = Topology(tp=2, timeout_s=2.0)
    if dist.get_rank() == 1:
        time.sleep(10)
        return None
    start = time.monotonic()
    try:
        topo.comm.all_reduce(torch.ones(1), "tp")
    except RuntimeError as e:
        return ("error", time.monotonic() - start, str(e)[:200])
    return ("no-error", time.monotonic() - start, "")


def test_lost_peer_ends_in_an_error_not_a_hang():
    """A blocking collective on a Topology's own group fails after the communicator's timeout."""
    results = run_distributed(_timeout_child, 2, timeout=90, collective_timeout_s=60.0)
    status, waited, _ = results[0]
    assert status == "error"
    assert waited < 9.0


def _pipeline_exchange():
    """TP=2 x PP=2: stage 0 sends activations forward, stage 1 sends gradients back, through the communicator."""
    import time

    # Creating the groups connects every pair of their ranks: on a loaded machine that alone can take seconds,
    # so the groups (and this communicator) get a minute; the lost receive below gets a 2 s communicator.
    topo = Topology(tp=2, pp=2, timeout_s=60.0)
    comm, stage, r = topo.comm, topo.pp_rank, topo.rank
    out = {"pp_ranks": topo.group_ranks("pp")}
    comm.reset_stats()
    if stage == 0:
        comm.send(torch.arange(6, dtype=torch.float32) + 100 * r, "pp", 1)
        grad = torch.empty(3, dtype=torch.bfloat16)
        comm.recv(grad, "pp", 1, async_op=True).wait()
        out["received"] = grad.float().tolist()
    else:
        act = torch.empty(6, dtype=torch.float32)
        comm.recv(act, "pp", 0)
        out["received"] = act.tolist()
        comm.send(torch.full((3,), float(r), dtype=torch.bfloat16), "pp", 0, async_op=True).wait()
    out["report"] = comm.report()
    try:
        comm.send(torch.ones(1), "pp", stage)
    except ValueError as e:
        out["self_send"] = str(e)
    # The last stage waits for a tensor that never comes: the communicator's timeout ends the wait, though the
    # group's own is a minute.
    if stage == 1:
        start = time.monotonic()
        try:
            Communicator(topo, timeout_s=2.0).recv(torch.empty(1), "pp", 0)
            out["lost"] = ("no-error", time.monotonic() - start)
        except RuntimeError:
            out["lost"] = ("error", time.monotonic() - start)
    return out


def test_point_to_point_between_pipeline_stages():
    results = run_distributed(_pipeline_exchange, 4, timeout=120)
    for r, res in enumerate(results):
        first, last = res["pp_ranks"]
        assert r in (first, last) and last == first + 2  # TP innermost: the next stage is tp ranks away
        rep = res["report"]
        if r == first:
            assert res["received"] == [float(last)] * 3
            assert rep == {"send/pp": {"calls": 1, "payload_bytes": 24, "wire_bytes": 24.0, "inter_node_bytes": 0.0},
                           "recv/pp": {"calls": 1, "payload_bytes": 6, "wire_bytes": 0.0, "inter_node_bytes": 0.0}}
            assert "lost" not in res
        else:
            assert res["received"] == [100.0 * first + i for i in range(6)]
            assert rep == {"recv/pp": {"calls": 1, "payload_bytes": 24, "wire_bytes": 0.0, "inter_node_bytes": 0.0},
                           "send/pp": {"calls": 1, "payload_bytes": 6, "wire_bytes": 6.0, "inter_node_bytes": 0.0}}
            status, waited = res["lost"]
            assert status == "error" and waited < 9.0
        assert "another rank of that group" in res["self_send"]


def test_point_to_point_needs_a_peer_in_the_group():
    comm = Topology().comm
    with pytest.raises(ValueError, match=r"cannot send to rank 0 of the pp group: .* \[0, 1\)"):
        comm.send(torch.ones(1), "pp", 0)
    with pytest.raises(ValueError, match="cannot receive from rank 1 of the tp group"):
        comm.recv(torch.ones(1), "tp", 1)


def _outputs_held_after_return(iterations):
    """How often a tensor-parallel mapping's output (an autograd output, its graph behind it) is still held by
    someone else the moment the caller drops it: every mapping whose forward runs a collective."""
    import weakref

    from hybrid.tensor_parallel import mappings

    topo = Topology(tp=2)
    held = {}
    for name in ("reduce_from_tp_region", "gather_from_tp_region", "gather_from_sequence_parallel_region",
                 "reduce_scatter_to_sequence_parallel_region"):
        fn = getattr(mappings, name)
        count = 0
        for _ in range(iterations):
            x = torch.ones(64, 256, requires_grad=True)
            y = fn(x * 2.0, topo)  # a graph with a saved tensor behind the output
            ref = weakref.ref(y)
            del y
            count += ref() is not None
        held[name] = count
    return held


def test_backend_threads_never_hold_an_autograd_output():
    """The communicator hands the backend detached aliases: whatever thread drops its reference last, the
    caller's tensor and its graph are freed when the caller drops them (a graph held on would move the
    memory peak under recomputation)."""
    for held in run_distributed(_outputs_held_after_return, 2, 200, timeout=120):
        assert held == {name: 0 for name in held}
