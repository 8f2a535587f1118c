"""zero.master_precision bf16 (DeepSpeed's bf16_master_weights_and_grads with bf16_optimizer_states): the bf16
parameters are their own masters and Adam's moments are bf16. Each step is compared with AdamW computed in float64
from the same bf16 state and gradient.

The bound: the step computes in fp32 (torch's fused AdamW on bf16 tensors works in fp32 and stores bf16) and
rounds each stored value once to bf16 (unit roundoff u = 2^-8): a moment is within u of its exact value; the
weight is within u |w'| plus the update's own error, where the moments the update reads carry up to one bf16
rounding each (m by u, sqrt(v) by u/2): 1.5 u of lr |m_hat / (sqrt(v_hat) + eps)|, plus fp32's roundings (8 U32 of
each term, far below). Without the fused op (torch's foreach path on bf16 tensors rounds each of its ~6 ops to
bf16) the bound is gamma(6, u) per quantity instead; the test takes the path this torch runs."""

import pytest
import torch
import torch.nn.functional as F

import hybrid
from hybrid.zero.inner import fused_adam_op
from tests.engine.test_engine_single import MLP, batches
from tests.numerics import U32, gamma, unit_roundoff

UB = unit_roundoff(torch.bfloat16)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def reference_adamw(w, m, v, g, t):
    """AdamW in float64 from the state before the step: (w', m', v')."""
    w, m, v, g = (x.double() for x in (w, m, v, g))
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    update = (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
    return w * (1 - LR * WD) - LR * update, m, v, update


def test_bf16_masters_and_moments_step_within_one_bf16_rounding():
    torch.manual_seed(0)
    model = MLP()
    engine = hybrid.initialize(model, {"precision": "bf16", "zero": {"stage": 1, "master_precision": "bf16"},
                                       "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS,
                                                     "weight_decay": WD}, "steps_per_print": 0})
    inner = engine.optimizer.inner
    assert all(t.dtype == torch.bfloat16 for g in inner.groups for t in g.state.values())
    assert all(m.dtype == torch.bfloat16 for g in inner.groups for m in g.masters)
    assert engine.memory_report()["master"] == 0  # the parameters are the masters: no second copy
    fused = fused_adam_op(True) is not None
    rel = (UB + 8 * U32, 1.5 * UB + 8 * U32) if fused else (gamma(6, UB), gamma(6, UB))
    seen, step = [], inner.step

    def recording(grads, grad_factor, lr=None):
        before = [[torch.cat(list(t)).clone() for t in (g.masters, g.views["exp_avg"], g.views["exp_avg_sq"])]
                  for g in inner.groups]
        used = [torch.cat([c.float() for c in chunks]) * grad_factor for chunks in grads]
        step(grads, grad_factor, lr)
        seen.append((before, used, inner.step_count, [g.decays for g in inner.groups]))

    inner.step = recording
    x, y = batches(1, 16)[0]
    for _ in range(4):
        engine.backward(F.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    assert len(seen) == 4
    for t, (before, used, count, decays) in enumerate(seen, 1):
        assert count == t
        for group, (w, m, v), g, decays_ in zip(inner.groups, before, used, decays):
            if not decays_:
                continue  # the no-decay group: same update without the decay term; the decaying one suffices
            # the state after this step: the next step's "before", or the live state after the last
            after = seen[t][0][inner.groups.index(group)] if t < len(seen) else \
                [torch.cat(list(x)) for x in (group.masters, group.views["exp_avg"], group.views["exp_avg_sq"])]
            w_ref, m_ref, v_ref, update = reference_adamw(w, m, v, g, t)
            assert (after[1].double() - m_ref).abs().le(rel[0] * m_ref.abs() + 1e-30).all()
            assert (after[2].double() - v_ref).abs().le(rel[0] * v_ref.abs() + 1e-30).all()
            bound = rel[0] * w_ref.abs() + rel[1] * LR * update.abs() + 8 * U32 * (w.double().abs() + LR * update.abs())
            assert (after[0].double() - w_ref).abs().le(bound).all(), t


def test_the_mode_needs_bf16_parameters():
    from hybrid.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"'zero.master_precision' bf16 keeps the bf16 parameters as their own "
                                          r"masters: it needs 'precision' bf16 without 'autocast'"):
        config_from_dict({"precision": "fp16", "zero": {"master_precision": "bf16"}})
