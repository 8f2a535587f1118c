"""ZeroOptimizer in one process (dp=1): the inner optimizers, state round trip and argument errors."""

import math

import pytest
import torch

from hybrid import Topology
from hybrid.zero import LossScaler, ZeroConfigError
from hybrid.zero.inner import compiled_adam_available
from tests.zero.common import TiedMLP, make_zero, max_rel_diff, no_decay, numpy_params, token_batch, train_zero


def _torch_reference(kind, steps, lr, wd, momentum):
    torch.manual_seed(0)
    model = TiedMLP()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": wd},
              {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}]
    opt = {"adamw": lambda: torch.optim.AdamW(groups, lr=lr, foreach=False),
           "adam": lambda: torch.optim.Adam(groups, lr=lr, foreach=False),
           "sgd": lambda: torch.optim.SGD(groups, lr=lr, momentum=momentum, foreach=False)}[kind]()
    losses = []
    for s in range(steps):
        x, y = token_batch(s, 4)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, numpy_params(model)


@pytest.mark.parametrize("kind,lr,momentum,kernels", [("adamw", 1e-2, 0.0, True), ("adamw", 1e-2, 0.0, False),
                                                      ("adam", 1e-2, 0.0, True), ("adam", 1e-2, 0.0, False),
                                                      ("sgd", 0.5, 0.9, True)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_inner_optimizers_match_torch(kind, lr, momentum, kernels, stage):
    ref_losses, ref_params = _torch_reference(kind, 4, lr, 0.1, momentum)
    torch.manual_seed(0)
    model = TiedMLP()
    topo = Topology.local()
    opt = make_zero(model, topo, stage=stage, optimizer=kind, lr=lr, weight_decay=0.1, momentum=momentum,
                        no_weight_decay=no_decay, bucket_size=700, gradient_accumulation_steps=2,
                        use_fused_kernels=kernels)
    assert opt.inner.compiled == (kernels and kind != "sgd" and compiled_adam_available(torch.device("cpu")))
    out = train_zero(model, opt, topo, 4, micro=2, gas=2)
    assert max(abs(a - b) / b for a, b in zip(out["losses"], ref_losses)) < 1e-6
    assert max_rel_diff(numpy_params(model), ref_params) < 1e-6
    assert opt.global_steps == 4 and opt.skipped_steps == 0


def test_bf16_parameters_compiled_and_torch_paths_agree():
    # bf16 weights: the compiled kernel reads bf16 gradients and writes the rounded weights itself;
    # the torch path converts and copies. Both must leave the same fp32 master and bf16 weights.
    results = []
    for kernels in (True, False):
        torch.manual_seed(0)
        model = TiedMLP().to(torch.bfloat16)
        opt = make_zero(model, Topology.local(), stage=1, lr=1e-2, weight_decay=0.1, no_weight_decay=no_decay,
                            use_fused_kernels=kernels)
        train_zero(model, opt, opt.topology, 3, micro=4, gas=1)
        masters = torch.cat([p.master_flat() for p in opt.partitions])
        results.append((masters, numpy_params(model)))
    (m_kernel, p_kernel), (m_torch, p_torch) = results
    assert torch.allclose(m_kernel, m_torch, rtol=1e-5, atol=1e-7)
    # bf16 weights are the rounded masters: equal except where a master sits on a rounding boundary
    assert max_rel_diff(p_kernel, p_torch) <= 2 ** -8


def test_state_dict_round_trip_continues_identically():
    def build():
        torch.manual_seed(0)
        m = TiedMLP()
        return m, make_zero(m, Topology.local(), stage=1, lr=1e-2, weight_decay=0.1,
                                no_weight_decay=no_decay, bucket_size=700)

    m1, o1 = build()
    train_zero(m1, o1, o1.topology, 3, micro=4, gas=1)
    sd = o1.state_dict()
    assert sd["step"] == 3 and sd["groups"][0]["exp_avg"].numel() == sd["groups"][0]["partition_numel"]
    assert [r["name"] for r in sd["param_index"]][:2] == ["embed.weight", "fc1.weight"]
    m2, o2 = build()
    with torch.no_grad():
        for p in m2.parameters():
            if p.requires_grad:
                p.add_(1.0)  # make sure the load really overwrites the trained weights
    o2.load_state_dict(sd)
    a = train_zero(m1, o1, o1.topology, 2, micro=4, gas=1)
    b = train_zero(m2, o2, o2.topology, 2, micro=4, gas=1)
    assert a["losses"] == b["losses"]
    assert max_rel_diff(numpy_params(m2), numpy_params(m1)) == 0.0


@pytest.mark.parametrize("stage", [0, 1])
def test_model_zero_grad_instead_of_the_optimizers_still_trains_correctly(stage):
    # model.zero_grad() sets every .grad to None, detaching it from the flat gradient buffer; the
    # hook must take the fresh gradient and point .grad back at the buffer.
    ref_losses, ref_params = _torch_reference("adamw", 3, 1e-2, 0.1, 0.0)
    torch.manual_seed(0)
    model = TiedMLP()
    opt = make_zero(model, Topology.local(), stage=stage, lr=1e-2, weight_decay=0.1,
                        no_weight_decay=no_decay, gradient_accumulation_steps=2)
    for s in range(3):
        x, y = token_batch(s, 4)
        for k in range(2):
            opt.backward(model(x[2 * k: 2 * k + 2], y[2 * k: 2 * k + 2]))
            assert model.fc1.weight.grad.data_ptr() == opt.reducer.views[0][1].data_ptr()
        opt.step()
        model.zero_grad(set_to_none=True)
    assert max_rel_diff(numpy_params(model), ref_params) < 1e-6


class _SharedInTwoCheckpoints(torch.nn.Module):
    """A weight used in two re-entrant checkpointed regions: its gradient arrives twice per backward."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(8, 8)
        self.middle = torch.nn.Linear(8, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, x, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(self.middle(h)), use_reentrant=True)
        return h.pow(2).mean()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_gradient_arriving_after_its_bucket_left_is_an_error_not_a_silent_loss(stage):
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(0)
    model = _SharedInTwoCheckpoints()
    opt = make_zero(model, Topology.local(), stage=stage)
    with pytest.raises(RuntimeError, match="overlap_comm=False"):
        opt.backward(model(x))
    # reducing after backward (overlap_comm=False) includes both contributions, like plain torch
    torch.manual_seed(0)
    ref = _SharedInTwoCheckpoints()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    torch.manual_seed(0)
    model = _SharedInTwoCheckpoints()
    opt = make_zero(model, Topology.local(), stage=stage, lr=1e-2, overlap_comm=False)
    for _ in range(3):
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(model(x))
        opt.step()
        opt.zero_grad()
    assert max_rel_diff(numpy_params(model), numpy_params(ref)) < 1e-6


def test_non_finite_gradients_skip_the_step_and_are_counted():
    torch.manual_seed(0)
    model = TiedMLP()
    opt = make_zero(model, Topology.local(), stage=2, lr=1e-2, loss_scaler=LossScaler(dynamic=False))
    before = numpy_params(model)
    x, y = token_batch(0, 2)
    opt.backward(model(x, y) * float("nan"))
    assert opt.step() is False
    assert opt.skipped_steps == 1 and opt.global_steps == 1 and math.isnan(opt.get_grad_norm())
    assert max_rel_diff(numpy_params(model), before) == 0.0


def _model():
    torch.manual_seed(0)
    return TiedMLP()


@pytest.mark.parametrize("kwargs,match", [
    ({"stage": 5}, "zero.stage must be 0, 1, 2 or 3"),
    ({"bucket_size": 0}, "zero.bucket_size"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"clip_grad": -1.0}, "clip_grad must be >= 0"),
    ({"optimizer": "lion"}, "optimizer.type"),
    ({"betas": (0.9, 1.5)}, "betas"),
    ({"lr": -1.0}, "optimizer.params.lr"),
    ({"momentum": 1.0}, "momentum"),
    ({"master_dtype": torch.int32}, "master_dtype"),
    ({"loss_scaler": 2.0}, "LossScaler"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ZeroConfigError, ValueError), match=match):
        make_zero(_model(), Topology.local(), **kwargs)


def test_wrong_call_order_is_explained():
    model = _model()
    opt = make_zero(model, Topology.local(), gradient_accumulation_steps=2)
    x, y = token_batch(0, 2)
    opt.backward(model(x, y))
    with pytest.raises(RuntimeError, match="after 1 backward"):
        opt.step()
    opt.backward(model(x, y))
    with pytest.raises(RuntimeError, match="call step\\(\\) once every 2"):
        opt.backward(model(x, y))
    with pytest.raises(ValueError, match="scalar"):
        make_zero(_model(), Topology.local()).backward(torch.ones(3, requires_grad=True))
