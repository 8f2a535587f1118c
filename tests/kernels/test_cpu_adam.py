"""CPU Adam/AdamW op against torch.optim.AdamW / Adam, on every SIMD path this CPU has."""

from __future__ import annotations

import warnings
from typing import NamedTuple, Tuple

import pytest
import torch

import hybrid.kernels as hk
from tests.numerics import AdamBound, max_ratio

LENGTHS = [1, 7, 1023, 10**6 + 3]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


class _Reference(NamedTuple):
    """torch's optimizer in fp32 and in float64, and the derived bound on an fp32 run's error."""
    fp32: Tuple[torch.Tensor, ...]
    exact: Tuple[torch.Tensor, ...]
    bound: Tuple[torch.Tensor, ...]


def _run_pair(n, grad_dtype, weight_decay, *, adamw=True, steps=10, seed=0, lowp_dtype=None, grad_scale=1.0):
    """Runs our step next to torch's optimizer in fp32 and in float64; returns our states, the
    references (with the error bound of an fp32 trajectory) and the per-step copy-out checks."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kw = dict(lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], weight_decay=weight_decay,
              foreach=False)
    ref, ref64 = master.clone(), master.double()
    opt, opt64 = opt_cls([ref], **kw), opt_cls([ref64], **kw)
    m = torch.zeros(n)
    v = torch.zeros(n)
    bound = AdamBound(n, weight_decay=weight_decay, adamw=adamw, **HYPER)
    out = None if lowp_dtype is None else torch.empty(n, dtype=lowp_dtype)
    outs_ok = []
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        ref.grad = grad.float() * grad_scale
        ref64.grad = grad.double() * grad_scale
        prev = ref64.detach().clone()
        opt.step()
        opt64.step()
        bound.step(step, prev, ref64.grad, opt64.state[ref64], grad_scale != 1.0)
        hk.adam_step(master, grad, m, v, weight_decay=weight_decay, step=step, adamw=adamw, lowp_out=out,
                     grad_scale=grad_scale, **HYPER)
        if out is not None:
            outs_ok.append(torch.equal(out.view(torch.int16), master.to(lowp_dtype).view(torch.int16)))
    state, state64 = opt.state[ref], opt64.state[ref64]
    return ((master, m, v),
            _Reference((ref, state["exp_avg"], state["exp_avg_sq"]),
                       (ref64, state64["exp_avg"], state64["exp_avg_sq"]), (bound.p, bound.m, bound.v)),
            outs_ok)


def _assert_matches_torch(ours, ref: _Reference):
    """Our states and torch's fp32 ones each within the derived bound of torch's float64 run.

    Checking torch's own fp32 optimizer against the same bound keeps the bound honest: it must
    hold for another fp32 implementation with other roundings (torch's vectorized lerp uses an
    FMA where we multiply and add, and what it vectorizes depends on ATEN_CPU_CAPABILITY).
    """
    for name, a, b, want, bound in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref.fp32, ref.exact, ref.bound):
        for who, got in (("ours", a), ("torch fp32", b)):
            ratio = max_ratio(got, want, bound)
            assert ratio <= 1, f"{name} ({who}): error is {ratio:.3g} x its rounding bound"


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("weight_decay", [0.0, 0.01], ids=["wd0", "wd"])
def test_adamw_matches_torch(cpu_adam_op, kernel_env, n, grad_dtype, weight_decay):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    ours, ref, _ = _run_pair(n, grad_dtype, weight_decay)
    _assert_matches_torch(ours, ref)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_l2_matches_torch_adam(cpu_adam_op, kernel_env, weight_decay):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    ours, ref, _ = _run_pair(4099, torch.float32, weight_decay, adamw=False)
    _assert_matches_torch(ours, ref)


def test_grad_scale_multiplies_the_gradient(cpu_adam_op, kernel_env):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    ours, ref, _ = _run_pair(3001, torch.bfloat16, 0.01, grad_scale=0.37)
    _assert_matches_torch(ours, ref)


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lowp_copy_is_bit_identical_every_step(cpu_adam_op, kernel_env, lowp_dtype):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    ours, ref, outs_ok = _run_pair(70001, torch.bfloat16, 0.01, lowp_dtype=lowp_dtype)
    assert outs_ok and all(outs_ok)
    _assert_matches_torch(ours, ref)


def _edge_values() -> torch.Tensor:
    """fp32 values around every bf16/fp16 rounding case: ties to even/odd, overflow, denormals, inf."""
    bits = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x00008000,
            0x00018000, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x80000000, 0x00000000, 0x477FF000, 0x477FEFFF,
            0x38800000, 0x33800000, 0x33000001, 0x33000000, 0xC77FF000, 0x3F800FFF, 0x3F801000, 0x3F803000]
    base = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    randoms = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 1e4
    return torch.cat([base, randoms, base.flip(0)])


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_copy_out_rounding_edge_cases_on_every_path(cpu_adam_op, kernel_env, lowp_dtype):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    values = _edge_values()
    n = values.numel()
    for isa in cpu_adam_op.supported_isas():
        kernel_env.setenv("HYBRID_CPU_ADAM_ISA", isa)
        p = values.clone()
        out = torch.empty(n, dtype=lowp_dtype)
        # lr = 0 and no decay leave the weight unchanged, so the copy-out is a pure conversion.
        hk.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, step=1, lowp_out=out)
        assert torch.equal(p.view(torch.int32), values.view(torch.int32)), isa
        expected = values.to(lowp_dtype)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), isa


def test_nan_weights_copy_out_as_nan(cpu_adam_op, kernel_env):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    values = torch.tensor([float("nan"), 1.0, -float("nan")] * 11)
    for isa in cpu_adam_op.supported_isas():
        kernel_env.setenv("HYBRID_CPU_ADAM_ISA", isa)
        out = torch.empty(values.numel(), dtype=torch.bfloat16)
        hk.adam_step(values.clone(), torch.zeros(33), torch.zeros(33), torch.zeros(33), lr=0.0, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, lowp_out=out)
        assert torch.equal(out.float().isnan(), values.isnan()), isa


def test_every_supported_isa_path_is_bit_identical(cpu_adam_op, kernel_env):
    """Each path is forced in turn; all must agree to the bit and match torch within the rounding bound."""
    kernel_env.setenv("HYBRID_KERNELS", "require")
    isas = cpu_adam_op.supported_isas()
    assert "scalar" in isas
    lscpu_flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if " avx512f" in lscpu_flags:
        assert "avx512" in isas
    if " avx2" in lscpu_flags and " fma" in lscpu_flags and " f16c" in lscpu_flags:
        assert "avx2" in isas
    results = {}
    for isa in isas:
        for grad_dtype in GRAD_DTYPES:
            kernel_env.setenv("HYBRID_CPU_ADAM_ISA", isa)
            ours, ref, outs_ok = _run_pair(100_003, grad_dtype, 0.01, steps=3, seed=5,
                                           lowp_dtype=torch.bfloat16)
            _assert_matches_torch(ours, ref)
            assert all(outs_ok)
            results[(isa, grad_dtype)] = ours
    for (isa, grad_dtype), state in results.items():
        baseline = results[("scalar", grad_dtype)]
        for a, b in zip(state, baseline):
            assert torch.equal(a, b), f"{isa} differs from scalar for {grad_dtype}"


def test_thread_count_does_not_change_results(cpu_adam_op, kernel_env):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    before = torch.get_num_threads()
    states = []
    try:
        for threads in (1, max(2, before)):
            torch.set_num_threads(threads)
            ours, _, _ = _run_pair(200_011, torch.float32, 0.01, steps=2)
            states.append(ours)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_unknown_forced_isa_is_a_clear_error(cpu_adam_op, kernel_env):
    kernel_env.setenv("HYBRID_CPU_ADAM_ISA", "sse9")
    with pytest.raises(ValueError, match="HYBRID_CPU_ADAM_ISA"):
        hk.adam_step(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), weight_decay=0.0, step=1,
                     **HYPER)


@pytest.mark.parametrize("use_kernel,mode", [(False, "auto"), (True, "off")])
def test_torch_path_is_bit_identical_to_torch_adamw(kernel_env, use_kernel, mode):
    kernel_env.setenv("HYBRID_KERNELS", mode)
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(5000, generator=gen)
    ref = p.clone()
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1, foreach=False)
    m, v = torch.zeros(5000), torch.zeros(5000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither path may warn
        for step in range(1, 6):
            g = torch.randn(5000, generator=gen)
            ref.grad = g
            opt.step()
            hk.adam_step(p, g, m, v, weight_decay=0.1, step=step, use_kernel=use_kernel, **HYPER)
    assert torch.equal(p, ref)
    assert torch.equal(m, opt.state[ref]["exp_avg"]) and torch.equal(v, opt.state[ref]["exp_avg_sq"])


@pytest.mark.parametrize("bad,match", [
    (dict(param=torch.zeros(4, dtype=torch.float64)), "param must be float32"),
    (dict(grad=torch.zeros(5)), "grad has 5 elements"),
    (dict(exp_avg=torch.zeros(8)[::2]), "exp_avg must be contiguous"),
    (dict(grad=torch.zeros(4, dtype=torch.int32)), "grad must be float32, bfloat16, float16"),
    (dict(lowp_out=torch.zeros(4)), "lowp_out must be bfloat16 or float16"),
    (dict(step=0), "step must be >= 1"),
])
def test_bad_arguments_are_named(kernel_env, bad, match):
    args = dict(param=torch.zeros(4), grad=torch.zeros(4), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4),
                lowp_out=None, step=1)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        hk.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], lowp_out=args["lowp_out"],
                     weight_decay=0.0, step=args["step"], **HYPER)


def test_multi_tensor_adam_on_cpu_lists_matches_adam_step(cpu_adam_op, kernel_env):
    kernel_env.setenv("HYBRID_KERNELS", "require")
    gen = torch.Generator().manual_seed(2)
    sizes = [3, 1000, 17]
    params = [torch.randn(s, generator=gen) for s in sizes]
    grads = [torch.randn(s, generator=gen).bfloat16() for s in sizes]
    copies = [p.clone() for p in params]
    states = [(torch.zeros(s), torch.zeros(s)) for s in sizes]
    states2 = [(torch.zeros(s), torch.zeros(s)) for s in sizes]
    outs = [torch.empty(s, dtype=torch.bfloat16) if i != 1 else None for i, s in enumerate(sizes)]
    hk.multi_tensor_adam(params, grads, [m for m, _ in states], [v for _, v in states], outs, weight_decay=0.01,
                         step=1, **HYPER)
    for p, g, (m, v), o in zip(copies, grads, states2, outs):
        hk.adam_step(p, g, m, v, weight_decay=0.01, step=1, **HYPER)
    for a, b, o in zip(params, copies, outs):
        assert torch.equal(a, b)
        if o is not None:
            assert torch.equal(o, b.to(torch.bfloat16))
    with pytest.raises(ValueError, match="list lengths differ"):
        hk.multi_tensor_adam(params, grads[:2], [m for m, _ in states], [v for _, v in states], weight_decay=0.0,
                             step=1, **HYPER)
