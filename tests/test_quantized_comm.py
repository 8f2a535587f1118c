"""Quantized collectives of the communicator over 4 gloo ranks (one spawn; each test checks one slice).

The reference for every result is computed on each rank from every rank's
input (all inputs are seeded), with the codec of :mod:`hybrid.kernels.quantize`
applied row by row and the rows added in fp32 in group-rank order.
"""

import numpy as np
import pytest
import torch

from tests.multiproc import run_distributed

WORLD = 4
K = 1000  # elements per rank's chunk: not a multiple of the block, so the last block is partial
BLOCK = 256


def _inputs(n: int, numel: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # each rank's values at a different scale, so blocks differ in absmax
    return [torch.randn(numel, generator=g) * (10.0 ** (r - 1)) for r in range(n)]


def _dequantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    from hybrid.kernels import quantize

    rows = x.reshape(1, -1)
    return quantize.unpack(quantize.pack(rows, bits, BLOCK), rows.shape[1], bits, BLOCK)[0]


def _suite():
    from hybrid import Topology
    from hybrid.compression import Quantization

    topo = Topology(dp=WORLD, ranks_per_node=2)
    comm, me = topo.comm, topo.dp_rank
    res = {}
    xs = _inputs(WORLD, WORLD * K)
    for bits in (8, 4):
        q = Quantization(bits, BLOCK)
        comm.reset_stats()
        out = torch.empty(K)
        comm.reduce_scatter_tensor(out, xs[me].clone(), "dp", quant=q)
        quant_report = comm.report()["reduce_scatter/dp"]
        expected = torch.zeros(K)
        for x in xs:
            expected += _dequantized(x[me * K: (me + 1) * K], bits)
        exact = sum(x[me * K: (me + 1) * K].double() for x in xs)
        bound = sum(_bound(x[me * K: (me + 1) * K], bits) for x in xs)
        res[("rs", bits)] = {"bitwise": torch.equal(out, expected),
                             "within_bound": bool(((out.double() - exact).abs() <= bound + 1e-6 * exact.abs()).all()),
                             "report": quant_report}
        # async, avg
        out2 = torch.empty(K)
        h = comm.reduce_scatter_tensor(out2, xs[me].clone(), "dp", op="avg", async_op=True, quant=q)
        h.wait()
        res[("rs_avg", bits)] = torch.equal(out2, expected / WORLD)
    comm.reset_stats()
    out = torch.empty(K)
    comm.reduce_scatter_tensor(out, xs[me].clone(), "dp")
    res["plain_rs_report"] = comm.report()["reduce_scatter/dp"]

    # all-gather: every rank ends with the same dequantized chunks, its own included
    q8 = Quantization(8, BLOCK)
    chunk = xs[me][:K].clone()
    gathered = torch.empty(WORLD * K)
    comm.all_gather_into_tensor(gathered, chunk, "dp", quant=q8)
    res["ag_expected"] = torch.equal(gathered, torch.cat([_dequantized(x[:K], 8) for x in xs]))
    res["ag"] = gathered.numpy()  # tensors do not survive the trip back from the child
    # in place, bf16 output: the dtype the stage-3 parameters have
    buf = torch.zeros(WORLD * K, dtype=torch.bfloat16)
    buf[me * K: (me + 1) * K] = xs[me][:K].to(torch.bfloat16)
    h = comm.all_gather_into_tensor(buf, buf[me * K: (me + 1) * K], "dp", async_op=True, quant=q8)
    h.wait()
    res["ag_bf16"] = buf.float().numpy()

    # all-reduce of a tensor whose size is not a multiple of the group: padded, the same result on every rank
    t = xs[me][: 4 * K + 3].clone().view(-1)
    h = comm.all_reduce(t, "dp", async_op=True, quant=q8)
    h.wait()
    exact = sum(x[: 4 * K + 3].double() for x in xs)
    res["ar"] = t.numpy()
    res["ar_err"] = float((t.double() - exact).abs().max() / exact.abs().max())

    # a NaN in one rank's block reaches the block's owner as NaN, and only that block
    y = torch.ones(WORLD * K)
    if me == 2:
        y[5] = float("nan")  # chunk 0, block 0
    out = torch.empty(K)
    comm.reduce_scatter_tensor(out, y, "dp", quant=q8)
    res["nan"] = (me, bool(out[:BLOCK].isnan().all()), bool(out[BLOCK:].isnan().any()))
    # two levels (2 nodes x 2 ranks): the exact sum up to fp32 rounding of 4 terms
    topo.enable_node_axes()
    out = torch.empty(K)
    h = comm.reduce_scatter_tensor(out, xs[me].clone(), "dp", async_op=True, two_level=True)
    h.wait()
    exact = sum(x[me * K: (me + 1) * K].double() for x in xs)
    scale = sum(x[me * K: (me + 1) * K].double().abs() for x in xs)
    res["two_level_rs"] = bool(((out.double() - exact).abs() <= 4 * 2.0 ** -24 * scale).all())
    t = xs[me][: 4 * K + 3].clone()
    comm.all_reduce(t, "dp", op="avg", two_level=True)
    exact = sum(x[: 4 * K + 3].double() for x in xs) / WORLD
    scale = sum(x[: 4 * K + 3].double().abs() for x in xs) / WORLD
    res["two_level_ar"] = t.numpy()
    res["two_level_ar_ok"] = bool(((t.double() - exact).abs() <= 4 * 2.0 ** -24 * scale).all())
    return res


def _bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    from hybrid.kernels import quantize

    return quantize.error_bound(x.reshape(1, -1), bits, BLOCK)[0].double()


@pytest.fixture(scope="module")
def results():
    return run_distributed(_suite, WORLD)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reduce_scatter_sums_dequantized_rows_in_fp32(results, bits):
    for res in results:
        assert res[("rs", bits)]["bitwise"]
        assert res[("rs", bits)]["within_bound"]
        assert res[("rs_avg", bits)]


@pytest.mark.parametrize("bits,ceiling", [(8, 0.27), (4, 0.15)])
def test_quantized_reduce_scatter_sends_a_fraction_of_the_bytes(results, bits, ceiling):
    for res in results:
        q, plain = res[("rs", bits)]["report"], res["plain_rs_report"]
        assert q["wire_bytes"] <= ceiling * plain["wire_bytes"]
        assert q["calls"] == plain["calls"] == 1


def test_quantized_all_gather_gives_every_rank_the_same_values(results):
    assert all(r["ag_expected"] for r in results)
    for r in results[1:]:
        assert np.array_equal(r["ag"], results[0]["ag"])
        assert np.array_equal(r["ag_bf16"], results[0]["ag_bf16"])


def test_quantized_all_reduce_pads_and_agrees_across_ranks(results):
    for r in results:
        assert np.array_equal(r["ar"], results[0]["ar"])
        # two quantizations of int8, each within absmax/254 of its block: well under 2% of the largest sum
        assert r["ar_err"] < 0.02


def test_a_nan_is_not_hidden_by_quantization(results):
    for me, block_nan, rest_nan in (r["nan"] for r in results):
        assert block_nan == (me == 0)
        assert not rest_nan


def test_two_level_reduction_is_the_sum_up_to_rounding(results):
    assert all(r["two_level_rs"] and r["two_level_ar_ok"] for r in results)
    for r in results[1:]:
        assert np.array_equal(r["two_level_ar"], results[0]["two_level_ar"])
