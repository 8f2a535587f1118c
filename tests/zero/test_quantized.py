"""ZeRO stages 0-3 with quantized gradients and weights over 4 gloo ranks (dp=4), against the unquantized run.

Quantization changes the numbers, so this is not a parity test: it checks that
every data-parallel replica still holds the same weights, that training still
learns (the copy task of :func:`tests.zero.common.token_batch`), close to the
unquantized loss curve, and that the data-parallel traffic shrinks.
All runs share one spawn of 4 processes.
"""

import numpy as np
import pytest
import torch

from tests.multiproc import run_distributed
from tests.zero.common import TiedMLP, no_decay, numpy_params, train_zero

WORLD = 4
STEPS = 20
VOCAB, SEQ = 32, 8
SETTINGS = {
    "plain": {},
    "grads-int8": {"quantized_gradients": "int8"},
    "grads-int4": {"quantized_gradients": "int4"},
    "weights-int8": {"quantized_weights": "int8"},
    "both": {"quantized_gradients": "int4", "quantized_weights": "int8"},
    # the 4 ranks as 2 nodes of 2: reduce inside the node, then across on half the bytes
    "two-level": {"two_level_reduce": True},
    "two-level-int4": {"two_level_reduce": True, "quantized_gradients": "int4"},
}
GRADIENT_OPS = ("reduce_scatter/", "all_reduce/")


def _dp_bytes(report, op):
    return sum(v["wire_bytes"] for k, v in report.items() if k == f"{op}/dp")


def _run(stage, settings):
    from hybrid import Topology
    from tests.zero.common import make_zero

    torch.manual_seed(0)
    model = TiedMLP(hidden=32)
    topo = Topology(ranks_per_node=2)
    opt = make_zero(model, topo, stage=stage, lr=3e-3, weight_decay=0.0, no_weight_decay=no_decay,
                    bucket_size=2000, quantization_block=64, gradient_accumulation_steps=2, **settings)
    out = train_zero(model, opt, topo, STEPS, micro=2, gas=2, copy=True)
    report = opt.comm_report()  # the last step's traffic
    with opt.gathered_parameters():
        params = numpy_params(model)
    opt.remove_hooks()
    return {"losses": out["losses"], "params": params,
            "grad_inter_node": sum(v["inter_node_bytes"] for k, v in report.items() if k.startswith(GRADIENT_OPS)),
            "grad_bytes": _dp_bytes(report, "all_reduce") + _dp_bytes(report, "reduce_scatter"),
            "gather_bytes": _dp_bytes(report, "all_gather")}


def _suite():
    res = {}
    for stage in (0, 1, 2, 3):
        for name, settings in SETTINGS.items():
            if stage == 0 and "quantized_weights" in settings:
                continue
            res[(stage, name)] = _run(stage, settings)
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_suite, WORLD, timeout=400)


def _cases(results):
    return [key for key in results[0] if key[1] != "plain"]


def test_every_replica_holds_the_same_weights(results):
    for key in results[0]:
        for r in results[1:]:
            for name, value in r[key]["params"].items():
                assert np.array_equal(value, results[0][key]["params"][name]), (key, name)


def test_quantized_training_learns_like_the_unquantized_run(results):
    for stage, name in _cases(results):
        plain = np.mean([r[(stage, "plain")]["losses"] for r in results], axis=0)
        quant = np.mean([r[(stage, name)]["losses"] for r in results], axis=0)
        assert plain[-1] < 0.1 * plain[0], "the copy task must be learnable in this many steps"
        # the loss falls as far: the last five steps' mean within 2% of the unquantized run's fall
        fall = plain[0] - plain[-5:].mean()
        assert abs(quant[-5:].mean() - plain[-5:].mean()) <= 0.02 * fall, (stage, name, quant, plain)


def _ceiling(bits: int) -> float:
    """Packed bytes over fp32 bytes at block 64 (a 4-byte scale per 64 values), plus 5% for the partial last
    block of each chunk and the padding of stage 0's all-reduce to a multiple of the group."""
    return (bits / 8 + 4 / 64) / 4 * 1.05


def test_quantized_gradients_send_a_fraction_of_the_gradient_bytes(results):
    for stage in (0, 1, 2, 3):
        plain = results[0][(stage, "plain")]
        for name, bits in (("grads-int8", 8), ("grads-int4", 4)):
            ratio = results[0][(stage, name)]["grad_bytes"] / plain["grad_bytes"]
            assert ratio <= _ceiling(bits), (stage, name, ratio)


def test_quantized_weights_send_a_fraction_of_the_gather_bytes(results):
    for stage in (1, 2, 3):
        plain = results[0][(stage, "plain")]["gather_bytes"]
        ratio = results[0][(stage, "weights-int8")]["gather_bytes"] / plain
        assert ratio <= _ceiling(8), (stage, ratio)


def test_two_level_reduction_sends_one_share_across_nodes(results):
    """dp=4 as 2 nodes x 2 ranks (l = 2). Quantized: the flat all-to-all sends every rank's packed chunk to both
    ranks of the other node; two levels send one chunk across, so half (1/l), up to the padding of blocks.
    Unquantized: the flat ring's crossing hops send 3 of the 4 chunks per node, two levels 2 of 4."""
    def crossing(stage, name):  # summed over the ranks: what both nodes' links carried
        return sum(r[(stage, name)]["grad_inter_node"] for r in results)

    for stage in (1, 2, 3):
        quantized = crossing(stage, "two-level-int4") / crossing(stage, "grads-int4")
        plain = crossing(stage, "two-level") / crossing(stage, "plain")
        assert quantized <= 0.5 * 1.05, (stage, quantized)
        assert plain <= 2 / 3 * 1.01, (stage, plain)
