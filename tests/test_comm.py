import pytest
import torch

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
        assert rep["reduce_scatter/dp"] == {"calls": 1, "payload_bytes": 16, "wire_bytes": 8.0}
        assert rep["all_gather/dp"] == {"calls": 1, "payload_bytes": 16, "wire_bytes": 8.0}
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
    with pytest.raises(TimeoutError, match="ranks \\[0\\] never finished"):
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


def _timeout_child():
    import time

    import torch.distributed as dist

    topo = Topology()
    if dist.get_rank() == 1:
        time.sleep(10)
        return None
    start = time.monotonic()
    try:
        topo.comm.all_reduce(torch.ones(1), "world")
    except RuntimeError as e:
        return ("error", time.monotonic() - start, str(e)[:200])
    return ("no-error", time.monotonic() - start, "")


def test_lost_peer_ends_in_an_error_not_a_hang():
    results = run_distributed(_timeout_child, 2, timeout=60, collective_timeout_s=2.0)
    status, waited, _ = results[0]
    assert status == "error"
    assert waited < 9.0
