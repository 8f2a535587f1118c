"""torch's private fused Adam op, which hybrid names in one place only (:func:`hybrid.zero.inner.fused_adam_op`).

* The op must still exist: when a torch upgrade drops ``torch._fused_adamw_``
  or ``torch._fused_adam_``, the first test here fails, naming the version, so
  the upgrade is noticed rather than silently running the slower public path.
* The public fallback (``torch.optim.adamw.adamw`` / ``torch.optim.adam.adam``,
  foreach) agrees with the fused op after one update from the same inputs,
  element by element, within the bound derived below.

The bound. Both paths evaluate, in fp32, from the same ``p, g, m, v`` (``f`` the
gradient factor, ``t`` the step)::

    g' = f g  (+ wd p for Adam)           m' = b1 m + (1 - b1) g'      v' = b2 v + (1 - b2) g'^2
    d  = sqrt(v' / c2) + eps              U  = lr m' / (c1 d)          p' = p (1 - lr wd for AdamW) - U
    c1 = 1 - b1^t,  c2 = 1 - b2^t

with every operation rounded once (unit roundoff ``u = 2^-24``), in an order
each chooses (the fused op divides by ``1/f``, the fallback multiplies by
``f``; ``m'`` may be formed as a lerp). Bounding each rounding by ``u`` times
the magnitude it acts on (``G = |f g| (+ wd |p|)``, ``M = |m| + (1 - b1) G``,
``V = b2 v + (1 - b2) G^2``, all >= the terms they bound) gives, for one path:

* ``|dm| <= 5 u M`` (scaling, decay term, two products, the sum);
* ``|dv| <= 10 u V`` (``g'`` carries ``3 u G``, squared ``7 u G^2``; two products, the sum);
* ``c1, c2`` may come from ``b^t`` rounded to fp32: ``|dc| <= u (2 b^t + c)``;
* ``|dd| <= |dv| / (2 c2 sqrt(v'/c2)) + sqrt(v'/c2) |dc2| / (2 c2) + 3 u d`` (division, sqrt, the ``eps`` sum);
* ``|dU| <= lr |dm| / (c1 d) + |U| (|dc1| / c1 + |dd| / d + 3 u)`` (the step size ``lr / c1``, the product, the quotient);
* ``|dp| <= 3 u |p| + u |U| + |dU|`` (the decay factor and its product, the subtraction).

Two paths each within that of the exact result differ by at most twice it.
The bound is evaluated in float64 from the inputs; the test also checks that
it is tight enough to mean something (its update part is at most a few hundred
``u`` of ``lr M / (c1 d)``, the largest update those magnitudes allow).
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid.zero.inner import fused_adam_op, torch_adam_step

U = 2.0 ** -24  # fp32 unit roundoff
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_torch_still_has_the_private_fused_adam_op(adamw):
    name = "_fused_adamw_" if adamw else "_fused_adam_"
    assert hasattr(torch, name), (
        f"torch {torch.__version__} has no torch.{name}: hybrid.zero.inner.torch_adam_step now runs the public "
        f"foreach fallback (same results within rounding, several passes over memory instead of one); measure the "
        f"step time, then retire the private op from hybrid.zero.inner.fused_adam_op and update the tested torch "
        f"version in pyproject.toml and README.md")
    assert fused_adam_op(adamw) is getattr(torch, name)


def _inputs(seed: int, first_step: bool):
    """Two 1-D chunks (a flat partition's segments) of parameters, gradients spanning five decades, and state."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (1031, 37)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-4, 1, generator=gen) for n in sizes]
    if first_step:
        exp_avgs = [torch.zeros(n) for n in sizes]
        exp_avg_sqs = [torch.zeros(n) for n in sizes]
    else:
        exp_avgs = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
        exp_avg_sqs = [torch.rand(n, generator=gen) * 0.01 for n in sizes]
    return params, grads, exp_avgs, exp_avg_sqs


def _step(inputs, fused: bool, **hyper):
    p, g, m, v = ([t.clone() for t in ts] for ts in inputs)
    torch_adam_step(p, g, m, v, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, fused=fused, **hyper)
    return torch.cat(p), torch.cat(m), torch.cat(v)


def _bounds(inputs, *, weight_decay, step, adamw, grad_factor):
    """The derived bounds on |fused - fallback| for p', m', v' (float64, per element)."""
    p, g, m, v = (torch.cat(ts).double() for ts in inputs)
    g1 = grad_factor * g + (0.0 if adamw else weight_decay * p)
    big_g = (grad_factor * g).abs() + (0.0 if adamw else weight_decay * p.abs())
    m1 = BETA1 * m + (1 - BETA1) * g1
    v1 = BETA2 * v + (1 - BETA2) * g1 ** 2
    big_m = m.abs() + (1 - BETA1) * big_g
    big_v = BETA2 * v + (1 - BETA2) * big_g ** 2
    c1, c2 = 1 - BETA1 ** step, 1 - BETA2 ** step
    dc1, dc2 = U * (2 * BETA1 ** step + c1), U * (2 * BETA2 ** step + c2)
    root = (v1 / c2).sqrt()
    d = root + EPS
    upd = LR * m1 / (c1 * d)
    dm, dv = 5 * U * big_m, 10 * U * big_v
    dd = dv / (2 * c2 * root) + root * dc2 / (2 * c2) + 3 * U * d
    du = LR * dm / (c1 * d) + upd.abs() * (dc1 / c1 + dd / d + 3 * U)
    dp = 3 * U * p.abs() + U * upd.abs() + du
    # the largest update these magnitudes allow, what the bound's update part is measured against
    upd_scale = LR * big_m / (c1 * d)
    return 2 * dp, 2 * dm, 2 * dv, 2 * (dp - 3 * U * p.abs()) / upd_scale


CASES = [(adamw, wd, f, step, first)
         for adamw in (True, False) for wd in (0.0, 0.1) for f in (1.0, 0.37)
         for step, first in ((1, True), (2, False), (10, False), (1000, False))]


@pytest.mark.parametrize("adamw,weight_decay,grad_factor,step,first_step", CASES)
def test_the_public_fallback_matches_the_fused_op(adamw, weight_decay, grad_factor, step, first_step):
    if fused_adam_op(adamw) is None:
        pytest.fail(f"torch {torch.__version__} has no fused op to compare the fallback with (see the test above)")
    inputs = _inputs(seed=step + 7 * adamw, first_step=first_step)
    hyper = dict(weight_decay=weight_decay, step=step, adamw=adamw, grad_factor=grad_factor)
    p_fused, m_fused, v_fused = _step(inputs, True, **hyper)
    p_public, m_public, v_public = _step(inputs, False, **hyper)
    bound_p, bound_m, bound_v, update_part = _bounds(inputs, **hyper)
    for name, a, b, bound in (("param", p_fused, p_public, bound_p), ("exp_avg", m_fused, m_public, bound_m),
                              ("exp_avg_sq", v_fused, v_public, bound_v)):
        diff = (a.double() - b.double()).abs()
        worst = int((diff - bound).argmax())
        assert bool((diff <= bound).all()), (
            f"{name}[{worst}]: fused {a[worst].item()!r} vs public {b[worst].item()!r} differ by "
            f"{diff[worst].item():.3g} > the derived bound {bound[worst].item():.3g}")
    # The bound means something: its update part is a few hundred roundings of the largest update the
    # inputs allow (the bias corrections' own rounding dominates at t = 1, 2), never a fraction of it.
    assert float(update_part.max()) < 1e-3
    # and the two paths did run the update: the parameters moved
    assert not torch.equal(p_fused, torch.cat(inputs[0]))


def test_forcing_the_fused_op_without_one_says_so(monkeypatch):
    monkeypatch.delattr(torch, "_fused_adamw_")
    assert fused_adam_op(True) is None
    p, g, m, v = ([t.clone() for t in ts] for ts in _inputs(0, True))
    with pytest.raises(RuntimeError, match="has no fused AdamW op"):
        torch_adam_step(p, g, m, v, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0, step=1,
                        adamw=True, grad_factor=1.0, fused=True)
    # fused=None then takes the public path, and still updates
    before = torch.cat(p).clone()
    torch_adam_step(p, g, m, v, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0, step=1,
                    adamw=True, grad_factor=1.0)
    assert not torch.equal(torch.cat(p), before)
    assert math.isfinite(float(torch.cat(p).abs().max()))
