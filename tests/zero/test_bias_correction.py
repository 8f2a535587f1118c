"""Adam/AdamW without bias correction (optimizer.bias_correction: false, DeepSpeed's
``optimizer.params.bias_correction: false``) against a float64 reference of the formula:

    m <- b1 * m + (1 - b1) * g,  v <- b2 * v + (1 - b2) * g^2
    p <- p * (1 - lr * wd)  (AdamW)                  p <- p - lr * m / (sqrt(v) + eps)

with no 1 / (1 - b1^t) and no 1 / (1 - b2^t); Adam (L2) adds wd * p to g instead of decaying p.
The default (bias_correction: true) still matches the corrected formula. The gradients are exact: the model's
loss is sum(p * c) for given fp32 tensors c, whose gradient is c itself, so only the optimizer's fp32 rounding
separates hybrid from the reference.
"""

import pytest
import torch

from hybrid import Topology
from hybrid.config.schema import OptimizerConfig, ZeroConfig
from hybrid.zero import build_zero_optimizer
from hybrid.zero.inner import InnerOptimizer, _inner_adam_step, torch_adam_step
from tests.multiproc import run_distributed
from tests.zero.common import no_decay

LR, BETAS, EPS, WD, STEPS = 1e-2, (0.9, 0.999), 1e-8, 0.1, 6
SHAPES = {"w1": (8, 6), "b1": (6,), "w2": (5, 8), "b2": (5,)}
UNIT = 2.0 ** -24  # fp32's unit roundoff


class ExactGrads(torch.nn.Module):
    """Parameters of SHAPES whose loss ``sum(p * c)`` has the gradient ``c`` exactly."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=g)))

    def forward(self, coeffs: dict) -> torch.Tensor:
        return sum((getattr(self, n) * c).sum() for n, c in coeffs.items())


def gradients(step: int) -> dict:
    """The fp32 gradient of every parameter at ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(shape, generator=g) for n, shape in SHAPES.items()}


def reference(start: dict, grads: list, *, kind: str, bias_correction: bool, grad_factor: float = 1.0,
              decays=lambda name: True):
    """The formula in float64 from fp32 ``start`` weights; returns (final weights, a bound on hybrid's fp32
    rounding error). The bound: each step's update (a dozen fp32 operations) is off by at most 16 units of
    roundoff of its size plus 2 of the weight's, and the moments' own rounding, growing by a few units a step,
    scales the update too: summed over the steps."""
    b1, b2 = BETAS
    p = {n: t.double() for n, t in start.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    bound = 0.0
    for t, step_grads in enumerate(grads, start=1):
        biggest_update, biggest_weight = 0.0, 0.0
        for n in p:
            g = step_grads[n].double() * grad_factor
            wd = WD if decays(n) else 0.0
            if kind == "adam":
                g = g + wd * p[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            if kind == "adamw":
                p[n] = p[n] * (1 - LR * wd)
            m_hat, v_hat = (m[n] / (1 - b1 ** t), v[n] / (1 - b2 ** t)) if bias_correction else (m[n], v[n])
            update = LR * m_hat / (v_hat.sqrt() + EPS)
            p[n] = p[n] - update
            biggest_update = max(biggest_update, float(update.abs().max()))
            biggest_weight = max(biggest_weight, float(p[n].abs().max()))
        bound += (16 + 6 * t) * UNIT * biggest_update + 2 * UNIT * biggest_weight
    return p, bound


def max_error(got: dict, want: dict) -> float:
    return max(float((got[n].double() - want[n]).abs().max()) for n in want)


# ---- the inner step on flat chunks ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_the_inner_step_without_bias_correction_is_the_formula(kind):
    """One flat group of four chunks, the gradients scaled on the fly (grad_factor), a bf16 copy-out."""
    start = {n: torch.randn(SHAPES[n], generator=torch.Generator().manual_seed(1)).flatten() for n in SHAPES}
    masters = [start[n].clone() for n in SHAPES]
    lowp = [torch.empty_like(t, dtype=torch.bfloat16) for t in masters]
    inner = InnerOptimizer(kind, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, bias_correction=False)
    inner.add_group(masters, decay=True, lowp=lowp)
    assert inner.compiled is False  # the compiled kernel always corrects: torch's ops run instead
    grads = [gradients(s) for s in range(STEPS)]
    for step_grads in grads:
        inner.step([[step_grads[n].flatten().clone() for n in SHAPES]], grad_factor=0.5)
    want, bound = reference(start, [{n: g[n].flatten() for n in g} for g in grads], kind=kind,
                            bias_correction=False, grad_factor=0.5)
    got = dict(zip(SHAPES, masters))
    assert max_error(got, want) <= bound, (max_error(got, want), bound)
    assert all(torch.equal(lo, hi.to(torch.bfloat16)) for lo, hi in zip(lowp, masters))
    corrected, _ = reference(start, [{n: g[n].flatten() for n in g} for g in grads], kind=kind,
                             bias_correction=True, grad_factor=0.5)
    assert max_error(got, corrected) > 1000 * bound  # the switch changes the update, far beyond rounding


def test_the_kernels_that_always_correct_refuse_the_switch():
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    with pytest.raises(ValueError, match="fused Adam op always corrects the moments' bias"):
        torch_adam_step([p], [g], [m], [v], lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0, step=1,
                        adamw=True, grad_factor=1.0, fused=True, bias_correction=False)
    with pytest.raises(ValueError, match="compiled Adam kernel always corrects the moments' bias"):
        _inner_adam_step([p], [g], [m], [v], None, lr=LR, beta1=0.9, beta2=0.999, eps=EPS, weight_decay=0.0,
                         step=1, adamw=True, grad_factor=1.0, compiled=True, bias_correction=False)


# ---- the ZeRO optimizer -----------------------------------------------------------------------------------

def _train(stage: int, kind: str, bias_correction: bool, use_fused_kernels: bool = True, **optimizer):
    """STEPS updates of ExactGrads by the ZeRO optimizer on this process's topology; (start, final) weights."""
    model = ExactGrads()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = OptimizerConfig(type=kind, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             bias_correction=bias_correction, **optimizer)
    opt = build_zero_optimizer(model, Topology.local() if not torch.distributed.is_initialized() else Topology(),
                               ZeroConfig(stage=stage), config, no_weight_decay=no_decay,
                               use_fused_kernels=use_fused_kernels)
    assert opt.inner.bias_correction is bias_correction
    if not bias_correction:
        assert opt.inner.compiled is False
    for s in range(STEPS):
        opt.backward(model(gradients(s)))
        assert opt.step()
        opt.zero_grad()
    opt.remove_hooks()
    return start, {n: p.detach().clone() for n, p in model.named_parameters()}


def _decays(name: str) -> bool:
    return len(SHAPES[name]) >= 2  # no_decay exempts parameters of at most one dimension


@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("stage", [0, 1])
def test_zero_without_bias_correction_is_the_formula(stage, kind):
    start, got = _train(stage, kind, bias_correction=False)
    grads = [gradients(s) for s in range(STEPS)]
    want, bound = reference(start, grads, kind=kind, bias_correction=False, decays=_decays)
    assert max_error(got, want) <= bound, (max_error(got, want), bound)
    corrected, _ = reference(start, grads, kind=kind, bias_correction=True, decays=_decays)
    assert max_error(got, corrected) > 1000 * bound


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("stage", [0, 1])
def test_the_default_still_corrects_the_bias(stage, kernels):
    assert OptimizerConfig().bias_correction is True
    start, got = _train(stage, "adamw", bias_correction=True, use_fused_kernels=kernels)
    want, bound = reference(start, [gradients(s) for s in range(STEPS)], kind="adamw", bias_correction=True,
                            decays=_decays)
    assert max_error(got, want) <= bound, (max_error(got, want), bound)


def test_onebit_adams_warm_up_follows_the_switch():
    """1-bit Adam's warm-up is the inner AdamW: without bias correction, the same formula (stage 0, dp 1)."""
    start, got = _train(0, "onebit_adam", bias_correction=False, freeze_step=10_000)
    want, bound = reference(start, [gradients(s) for s in range(STEPS)], kind="adamw", bias_correction=False,
                            decays=_decays)
    assert max_error(got, want) <= bound, (max_error(got, want), bound)


def _two_rank_zero1():
    # numpy arrays: torch tensors would travel as shared memory the exiting child takes with it
    return tuple({n: t.numpy() for n, t in weights.items()} for weights in _train(1, "adamw", bias_correction=False))


def test_two_ranks_at_zero_1_without_bias_correction_are_the_formula():
    """Each rank updates its half of the partition; both end with the formula's weights (the two ranks' equal
    gradients average to the same gradient exactly)."""
    results = [tuple({n: torch.from_numpy(a) for n, a in weights.items()} for weights in rank)
               for rank in run_distributed(_two_rank_zero1, 2, timeout=120)]
    for start, got in results:
        want, bound = reference(start, [gradients(s) for s in range(STEPS)], kind="adamw", bias_correction=False,
                                decays=_decays)
        assert max_error(got, want) <= bound, (max_error(got, want), bound)
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in SHAPES)
