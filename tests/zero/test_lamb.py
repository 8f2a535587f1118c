"""LAMB (DeepSpeed's ``"type": "Lamb"``, optimizer.type lamb) against its formula in float64, written here from
DeepSpeed's FusedLamb kernel: m, v as Adam's; ``update = m / (sqrt(v) + eps) + wd w``; each parameter's trust
ratio ``||w|| / ||update||`` clamped to [min_coeff, max_coeff] (1 where a norm is 0); ``w -= step_size x ratio x
update`` with ``step_size = lr sqrt(1 - b2^t) / (1 - b1^t)``, or lr without bias correction. The model's loss
``sum(p * c)`` has the gradient ``c`` exactly (tests/zero/test_bias_correction.py), so only the update rounds."""

import pytest
import torch

from hybrid.config import ConfigError, from_deepspeed
from tests.multiproc import run_distributed
from tests.zero.test_bias_correction import BETAS, EPS, LR, SHAPES, STEPS, UNIT, WD, _decays, _train, gradients, \
    max_error


def reference_lamb(start: dict, grads: list, *, bias_correction: bool, max_coeff: float, min_coeff: float):
    """(final weights, a bound on hybrid's fp32 rounding). The bound per step: the update's dozen fp32 operations
    (16 roundings of its size, and the moments' growing 6 t), the trust ratio's sums of n squares (gamma(n), n the
    largest parameter, plus 8 for the square roots and the division), and 2 of the weight's; summed over steps."""
    b1, b2 = BETAS
    p = {n: t.double() for n, t in start.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    biggest = max(t.numel() for t in p.values())
    bound, ratios = 0.0, []
    for t, step_grads in enumerate(grads, start=1):
        step_size = LR * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) if bias_correction else LR
        biggest_update, biggest_weight = 0.0, 0.0
        for n in p:
            g = step_grads[n].double()
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            update = m[n] / (v[n].sqrt() + EPS) + (WD if _decays(n) else 0.0) * p[n]
            w_norm, u_norm = float(p[n].norm()), float(update.norm())
            ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            ratios.append(ratio)
            p[n] = p[n] - step_size * ratio * update
            biggest_update = max(biggest_update, step_size * ratio * float(update.abs().max()))
            biggest_weight = max(biggest_weight, float(p[n].abs().max()))
        bound += (16 + 6 * t + biggest + 8) * UNIT * biggest_update + 2 * UNIT * biggest_weight
    return p, bound, ratios


@pytest.mark.parametrize("stage,max_coeff,bias_correction", [(0, 10.0, True), (1, 10.0, False), (0, 0.3, True)])
def test_lamb_is_the_formula(stage, max_coeff, bias_correction):
    start, got = _train(stage, "lamb", bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=0.01)
    grads = [gradients(s) for s in range(STEPS)]
    want, bound, ratios = reference_lamb(start, grads, bias_correction=bias_correction, max_coeff=max_coeff,
                                         min_coeff=0.01)
    assert max_error(got, want) <= bound, (max_error(got, want), bound)
    # the ratios differ per parameter, and the clamp binds where the formula says (so neither is a no-op here)
    assert len({round(r, 6) for r in ratios}) > 4 and (max(ratios) == max_coeff) == (max_coeff == 0.3)
    adam_like, _, _ = reference_lamb(start, grads, bias_correction=bias_correction, max_coeff=1.0, min_coeff=1.0)
    assert max_error(got, adam_like) > 1000 * bound  # a ratio fixed at 1 is another update, far beyond rounding


def _two_rank_zero2():
    out = _train(2, "lamb", bias_correction=True)
    return tuple({n: t.numpy() for n, t in weights.items()} for weights in out)


@pytest.mark.slow  # two processes: ~15 s on the shared machine
def test_two_ranks_at_zero_2_sum_each_parameters_norms_over_dp():
    """Each rank steps its chunk of the partition; the per-parameter sums of squares are all-reduced over dp, so
    both ranks end with the formula's weights."""
    results = [tuple({n: torch.from_numpy(a) for n, a in weights.items()} for weights in rank)
               for rank in run_distributed(_two_rank_zero2, 2, timeout=120)]
    start = results[0][0]
    want, bound, _ = reference_lamb(start, [gradients(s) for s in range(STEPS)], bias_correction=True,
                                    max_coeff=10.0, min_coeff=0.01)
    for _, got in results:
        assert max_error(got, want) <= bound, (max_error(got, want), bound)


def test_deepspeeds_lamb_config_maps_to_it():
    cfg = from_deepspeed({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {
        "lr": 0.011, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01}}})
    opt = cfg.optimizer
    assert (opt.type, opt.lr, opt.weight_decay, opt.bias_correction, opt.max_coeff, opt.min_coeff) == \
        ("lamb", 0.011, 0.01, False, 0.3, 0.01)
    with pytest.raises(ConfigError, match=r"'optimizer.type' lamb: LAMB runs at ZeRO stages 0-2"):
        from_deepspeed({"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 3}})
