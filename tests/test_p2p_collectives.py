"""The point-to-point reduce-scatter and all-gather the communicator runs on gloo (hybrid.p2p_collectives).

Each rank's input is made from (seed, rank) alone, so every rank can build every other rank's
input and the exact sum. Both shapes (direct inside a node, the ring across nodes) add n fp32
numbers in one fixed order per chunk; the error of such a sum is at most (n-1) eps * sum|x| (each
addition rounds once), which is the bound used. Gathers must be exact.
"""

import pytest
import torch

from hybrid.topology import Topology
from tests.multiproc import run_distributed

K = 1000  # elements per chunk


def _input(rank: int, n: int, tag: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * tag + rank)
    return torch.randn(n * K, generator=g, dtype=torch.float64).to(dtype)


def _rings(tp: int):
    """Several reduce-scatters over 'dp', interleaved with other collectives and waited out of order."""
    topo = Topology(tp=tp)
    comm, n, me = topo.comm, topo.size("dp"), topo.rank_in("dp")
    ranks = topo.group_ranks("dp")
    out = {"n": n, "me": me, "ranks": ranks, "results": {}, "shape": comm._p2p("dp")}
    # 1: blocking, separate output
    a = _input(topo.rank, n, 1)
    part = torch.empty(K)
    comm.reduce_scatter_tensor(part, a, "dp")
    out["results"][1] = part
    again = torch.empty(K)
    comm.reduce_scatter_tensor(again, a, "dp")
    out["deterministic"] = torch.equal(part, again)
    # 2 and 3: async, in flight together with an all-reduce, waited in reverse order; 3 in place
    b, c = _input(topo.rank, n, 2), _input(topo.rank, n, 3)
    pb = torch.empty(K)
    hb = comm.reduce_scatter_tensor(pb, b, "dp", async_op=True)
    pc = c[me * K: (me + 1) * K]
    hc = comm.reduce_scatter_tensor(pc, c, "dp", async_op=True)
    x = torch.ones(7)
    comm.all_reduce(x, "world")
    hc.wait()
    hb.wait()
    out["results"][2], out["results"][3] = pb, pc.clone()
    out["allreduce"] = x[0].item()
    # 4: average, bf16
    d = _input(topo.rank, n, 4, torch.bfloat16)
    pd = torch.empty(K, dtype=torch.bfloat16)
    comm.reduce_scatter_tensor(pd, d, "dp", op="avg")
    out["results"][4] = pd
    # 5: segments (stage 3's buckets of units) reduce exactly as their interleaving does, bit for bit: the
    # same ring, the same order of additions; the ring reads them in place
    e = _input(topo.rank, n, 5)
    segments = [e[: n * 300], e[n * 300: n * 400], e[n * 400:]]
    pe, pi = torch.empty(K), torch.empty(K)
    comm.reduce_scatter_tensor(pe, segments, "dp")
    comm.reduce_scatter_tensor(pi, torch.cat([s.view(n, -1) for s in segments], 1).view(-1), "dp")
    out["segments_equal"] = torch.equal(pe, pi)
    out["results"][5] = pe
    # 6: all-gathers, one in flight with a reduce-scatter and waited after it (their tags must not mix), one
    # in place (the input is this rank's own chunk of the output)
    f = _input(topo.rank, n, 6)[:K]
    gathered = torch.empty(n * K)
    hg = comm.all_gather_into_tensor(gathered, f, "dp", async_op=True)
    pr = torch.empty(K)
    hr = comm.reduce_scatter_tensor(pr, _input(topo.rank, n, 7), "dp", async_op=True)
    hr.wait()
    hg.wait()
    inplace = torch.empty(n * K)
    inplace[me * K: (me + 1) * K] = _input(topo.rank, n, 8)[:K]
    comm.all_gather_into_tensor(inplace, inplace[me * K: (me + 1) * K], "dp")
    out["gathered"], out["inplace"] = gathered.tolist(), inplace.tolist()
    out["results"][7] = pr
    # Plain lists: tensors returned from a child process travel as shared-memory handles that die with it.
    out["results"] = {t: v.double().tolist() for t, v in out["results"].items()}
    out["report"] = comm.report()
    out["blocked"] = comm.blocked_seconds()
    return out


# rings of 3 and 4 ranks inside a node (direct messages), and 4 over two nodes of 2 (the ring); dp=2 runs in every
# ZeRO test
@pytest.mark.parametrize("world,tp,per_node,shape", [(3, 1, None, "direct"), (4, 1, None, "direct"),
                                                     (4, 1, 2, "ring")])
def test_p2p_reduce_scatter_and_all_gather_match_a_float64_reference(world, tp, per_node, shape):
    env = {"LOCAL_WORLD_SIZE": str(per_node)} if per_node else None
    results = run_distributed(_rings, world, tp, env=env)
    for res in results:
        n, me, ranks = res["n"], res["me"], res["ranks"]
        assert res["shape"] == shape
        gathered = torch.cat([_input(r, n, 6)[:K] for r in ranks])
        assert torch.tensor(res["gathered"], dtype=torch.float32).equal(gathered)
        assert torch.tensor(res["inplace"], dtype=torch.float32).equal(torch.cat([_input(r, n, 8)[:K] for r in ranks]))
        for tag in (1, 2, 3, 4, 5, 7):
            dtype = torch.bfloat16 if tag == 4 else torch.float32
            inputs = [_input(r, n, tag, dtype).double() for r in ranks]
            if tag == 5:  # the segments interleaved chunk by chunk
                inputs = [torch.cat([x[: n * 300].view(n, -1), x[n * 300: n * 400].view(n, -1),
                                     x[n * 400:].view(n, -1)], 1).view(-1) for x in inputs]
            exact = sum(inputs)[me * K: (me + 1) * K]
            scale = sum(x.abs() for x in inputs)[me * K: (me + 1) * K]
            got = torch.tensor(res["results"][tag], dtype=torch.float64)
            if tag == 4:
                exact, scale = exact / n, scale / n
            eps = torch.finfo(dtype).eps
            # n-1 roundings in the sum (one more for bf16's final division, exact for n a power of 2 but not 3)
            bound = (n + 1) * eps * scale
            assert torch.all((got - exact).abs() <= bound), (tag, (got - exact).abs().max())
        assert res["allreduce"] == world
        assert res["deterministic"]  # one fixed order of additions per chunk
        # Either shape sends (n-1)/n of the buffer per rank, the ideal volume.
        rep = res["report"]["reduce_scatter/dp"]
        assert res["segments_equal"]
        assert rep["calls"] == 8
        assert rep["wire_bytes"] == pytest.approx(rep["payload_bytes"] * (n - 1) / n)
        assert res["blocked"] > 0.0
