"""The offload debug mode (HYBRID_DEBUG_POISON_HOST=1): host twins poisoned between steps, on a CPU model.

A correct run is bit-identical with and without the poisoning (the same kernels in the same order, only
through separate host buffers); a gradient copy that never lands turns the weights into NaN under the
poisoning, where without it the optimizer would silently step on the previous step's gradient.
"""

import pytest
import torch

from hybrid.zero import offload
from tests.zero.common import TiedMLP, make_zero, numpy_params, train_zero

STEPS = 4


def _run(monkeypatch, poison: bool, stage: int = 2):
    from hybrid import Topology

    monkeypatch.setenv(offload.POISON_ENV, "1" if poison else "0")
    torch.manual_seed(0)
    model = TiedMLP().to(torch.bfloat16)
    topo = Topology.local()
    opt = make_zero(model, topo, stage=stage, lr=1e-2, weight_decay=0.1, offload_optimizer="cpu", bucket_size=500,
                   gradient_accumulation_steps=2)
    out = train_zero(model, opt, topo, STEPS, micro=4, gas=2)
    return out, numpy_params(model), opt


@pytest.mark.parametrize("stage", [1, 2])
def test_poisoned_run_is_bit_identical_and_stages_through_separate_twins(monkeypatch, stage):
    plain, plain_params, plain_opt = _run(monkeypatch, poison=False, stage=stage)
    poisoned, params, opt = _run(monkeypatch, poison=True, stage=stage)
    assert all(off.same for off in plain_opt._offload)  # a CPU model normally stages nothing
    assert all(not off.same and off.poison for off in opt._offload)
    assert poisoned["losses"] == plain["losses"]
    for name, ref in plain_params.items():
        assert (params[name] == ref).all(), name
    # between steps the gradient twins hold only NaN: nothing stale is left for the next update
    assert all(torch.isnan(g.float()).all() for off in opt._offload for g in off.grads)


def test_a_gradient_copy_that_never_lands_is_caught(monkeypatch):
    # Streaming copies that are "started" but never land, as an unsynchronised copy would look.
    monkeypatch.setattr(offload.ChunkOffload, "grad_to_host", lambda self, segment: self._streamed.add(segment))
    out, params, _ = _run(monkeypatch, poison=True)
    assert any(not torch.isfinite(torch.from_numpy(p)).all() for p in params.values())
    # Without the poisoning the same fault goes unnoticed: every number stays finite.
    out, params, _ = _run(monkeypatch, poison=False)
    assert all(torch.isfinite(torch.from_numpy(p)).all() for p in params.values())


def test_the_switch_is_checked():
    assert offload.poison_requested({offload.POISON_ENV: "1"})
    assert not offload.poison_requested({})
    with pytest.raises(ValueError, match="HYBRID_DEBUG_POISON_HOST='yes please' is not a switch"):
        offload.poison_requested({offload.POISON_ENV: "yes please"})
