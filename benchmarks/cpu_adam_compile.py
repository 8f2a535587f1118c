"""Does a torch.library registration of the CPU Adam op help torch.compile on the optimizer step?

Issue 51 item 3 asks to register the compiled CPU Adam op as a custom op only if that helps a
compiled optimizer step. This script times one Adam step over the same fp32 tensors four ways,
in interleaved rounds (each round runs every contender once per step, order rotated):

* ``eager kernel``   -- ``hybrid.kernels.multi_tensor_adam`` (the pybind op), as the ZeRO inner step calls it;
* ``compiled, break`` -- ``torch.compile`` of that same call: dynamo cannot trace the pybind call, so the
  graph breaks there (what a compiled step gets without a registration);
* ``compiled, op``   -- ``torch.compile(fullgraph=True)`` of a step calling the op registered here as a
  mutating custom op over the lists (``hybrid_bench::cpu_adam_``: params, exp_avgs, exp_avg_sqs written in
  place; its body is the eager call above), the registration under test;
* ``eager torch fused`` -- ``torch._fused_adamw_``, torch's own one-pass kernel.

Two layouts: one flat partition (what ZeRO hands the step) and many small tensors (where per-call
overhead counts). The step number changes every call, as in training.

    python benchmarks/cpu_adam_compile.py [--flat 4000000] [--tensors 64 --size 16384] [--rounds 3] [--steps 20] [--threads N]

Prints, per layout and round, each contender's median ms per step and its paired ratio: the
median over the round's steps of the eager kernel's time over the contender's in the same step
(other jobs on the machine slow both alike within one step, not across steps).

Not timed: ``torch.compile`` of the pure-torch step (``hybrid.kernels.torch_adam_step``). It
specializes on the step number (``float(step)`` feeds Python-float bias corrections), so it
recompiles every step until dynamo's cache limit and then runs eager.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import List

import torch

import hybrid.kernels as hk
from hybrid.argument_parser import ArgumentParser
from hybrid.kernels.registry import default_registry

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@torch.library.custom_op("hybrid_bench::cpu_adam_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def cpu_adam_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
              exp_avg_sqs: List[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, step: int) -> None:
    """The compiled CPU Adam op (AdamW, fp32, no copy-out) over lists, in place: the eager body below."""
    hk.multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, step=step)


@cpu_adam_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
    return None


def step_kernel(ps, gs, ms, vs, step):
    hk.multi_tensor_adam(ps, gs, ms, vs, step=step, **HYPER)


def step_op(ps, gs, ms, vs, step):
    cpu_adam_(ps, gs, ms, vs, HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], step)


def step_torch_fused(ps, gs, ms, vs, step):
    steps = [torch.tensor(float(step))] * len(ps)
    torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
                        **{"lr": HYPER["lr"], "beta1": HYPER["beta1"], "beta2": HYPER["beta2"],
                           "weight_decay": HYPER["weight_decay"], "eps": HYPER["eps"]})


def make_state(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    gs = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    ms = [torch.zeros(n) for n in sizes]
    vs = [torch.zeros(n) for n in sizes]
    return ps, gs, ms, vs


def run_layout(name, sizes, rounds, steps):
    contenders = {
        "eager kernel": step_kernel,
        "compiled, break": torch.compile(step_kernel),
        "compiled, op": torch.compile(step_op, fullgraph=True),
        "eager torch fused": step_torch_fused,
    }
    states = {c: make_state(sizes, seed=i) for i, c in enumerate(contenders)}
    # Warm-up: compile (steps 1-3 reach dynamo's dynamic int) and touch every buffer.
    t0 = time.perf_counter()
    for c, fn in contenders.items():
        for s in (1, 2, 3):
            fn(*states[c], s)
    warm = time.perf_counter() - t0
    # The registered op gives the kernel's bits: check it against the eager kernel on the same inputs.
    a, b = make_state(sizes, 99), make_state(sizes, 99)
    for s in (4, 5):
        step_kernel(*a, s)
        contenders["compiled, op"](*b, s)
    assert all(torch.equal(x, y) for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3])), "op differs from kernel"
    names = list(contenders)
    per_round = {c: [] for c in names}
    ratios = {c: [] for c in names}
    step_no = 4
    for r in range(rounds):
        times = {c: [] for c in names}
        for i in range(steps):
            order = names[i % len(names):] + names[:i % len(names)]
            for c in order:
                t = time.perf_counter()
                contenders[c](*states[c], step_no)
                times[c].append(time.perf_counter() - t)
            step_no += 1
        for c in names:
            per_round[c].append(statistics.median(times[c]) * 1e3)
            ratios[c].append(statistics.median(k / t for k, t in zip(times["eager kernel"], times[c])))
    numel = sum(sizes)
    print(f"\n{name}: {len(sizes)} tensor(s), {numel:,} params; warm-up incl. compile {warm:.1f} s; "
          f"{rounds} rounds x {steps} steps; median ms per step (paired ratio eager kernel / contender)")
    print(f"{'contender':20s}" + "".join(f"  {'round ' + str(r + 1):>17s}" for r in range(rounds))
          + "  ratio min..max")
    for c in names:
        cells = "".join(f"  {ms:8.3f} ({q:5.3f}x)" for ms, q in zip(per_round[c], ratios[c]))
        print(f"{c:20s}{cells}  {min(ratios[c]):.3f}..{max(ratios[c]):.3f}x")


def main():
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flat", type=int, default=4_000_000, help="params of the one-partition layout")
    ap.add_argument("--tensors", type=int, default=64, help="tensors of the many-tensor layout")
    ap.add_argument("--size", type=int, default=16384, help="params per tensor of the many-tensor layout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (our op reads it too); 0 keeps "
                    "torch's default. 1 avoids OpenMP barriers stalling when other jobs hold the cores")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if default_registry().get("cpu_adam") is None:
        raise SystemExit("cpu_adam is not available here (python -m hybrid.kernels report): nothing to compare")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    run_layout("one flat partition", [args.flat], args.rounds, args.steps)
    run_layout("many small tensors", [args.size] * args.tensors, args.rounds, args.steps)
    print(f"load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
