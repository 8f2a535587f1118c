"""Part 3 of the GPU verification run: the engine's CUDA path at world 1 against plain torch.optim.AdamW.

What runs: gpt2-medium (~350M parameters, sequence 1024, micro batch 2, no dropout) for 20 steps in bf16
(bf16 weights and activations, fp32 master weights and Adam state) through ``hybrid.initialize`` in a
one-rank NCCL process group, at ZeRO stage 1, 2, 3, and stage 2 with the optimizer offloaded to the CPU
(pinned host twins, non-blocking copies) with the debug poisoning of the host twins on
(HYBRID_DEBUG_POISON_HOST=1: a copy that did not land before the host buffer is reused gives NaN).

What it is compared with: one plain single-process run of the same model from the same initial weights
on the same batches, in the same precision: bf16 model, fp32 master copies stepped by
``torch.optim.AdamW`` (same lr, betas, eps, weight decay, no decay on 1-D parameters), copied back to
bf16 after each step.

Tolerance (bf16 eps = 2^-8, the spacing of bf16 numbers in [1, 2)). Both runs do the same forward and
backward on the same bf16 weights; only the optimizer arithmetic differs (fused or CPU Adam vs torch's,
a few fp32 ulps apart), and that can only show where a master weight lies within those ulps of a bf16
rounding boundary: the bf16 copies then differ by one bf16 rounding (relative 2^-8). So each update
can add at most one bf16 rounding of relative divergence, and in the worst case these add up linearly:
  * loss of step k (k = 0, 1, ...; computed from the weights after k updates): |loss - ref| <=
    (k + 1) * 2^-8 * |ref|, one rounding for the forward itself plus one per update;
  * parameters after n steps: ||w - w_ref|| / ||w_ref - w_0|| <= n * 2^-8 (the error relative to the
    size of the reference's total update, so it does not vanish into the size of the weights).
A real mistake (a missing or stale gradient, a wrong sign or scale, a lost update or bias correction,
an unsynchronised copy) gives errors of order one, or NaN. The reference's loss must also fall, or the
comparison would prove little.

The premise "the same forward and backward" needs deterministic kernels, and on a GPU some are not
(flash attention's backward may accumulate in another order from run to run). So the reference runs
twice, and its own run-to-run difference (``noise``: the same two measures, the second run against the
first) widens each bound: an engine that is another run of the same arithmetic lies within about
``noise`` of the reference, so the bound is the rounding bound above plus ``NOISE_FACTOR * noise``. On
the CPU the reference repeats bit for bit (noise 0) and the rounding bound stands alone.

The compiled ops must really run: on a GPU each run records the ops this process loaded
(``hybrid.kernels.loaded_ops``) and whether the optimizer stepped with the compiled Adam (the CUDA one,
or the CPU one for the offloaded run), and a torch fallback fails the part (the parity is still
reported). The dry run: a two-layer tiny GPT, 4 steps, gloo, CPU.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.gpu import engine_setup as es  # noqa: E402
from benchmarks.gpu.results import PartResult, dry_run_choice, run_part  # noqa: E402

BF16_EPS = 2.0 ** -8
# A run of the same arithmetic differs from the reference by about the reference's own run-to-run difference
# (the two are alike draws); 3x leaves room for one draw being larger than the other without hiding a real
# mistake, which is of order one.
NOISE_FACTOR = 3.0
# The compiled ops a GPU run must load: the norms of every run, and Adam on the device or on the host.
GPU_OPS = ("cuda_norm", "cuda_adam")


def loss_rtol(step: int) -> float:
    """Allowed relative loss difference at step ``step`` (0-based): one bf16 rounding per update, plus one."""
    return (step + 1) * BF16_EPS


def param_rtol(steps: int) -> float:
    """Allowed ``||w - w_ref|| / ||w_ref - w_0||`` after ``steps`` updates."""
    return steps * BF16_EPS


def reference_adamw(factory: es.ModelFactory, micro: int, steps: int):
    """Plain single-process mixed precision: bf16 model, fp32 masters stepped by torch.optim.AdamW.

    Returns (losses per step, initial bf16 weights, final bf16 weights) keyed by parameter name."""
    from hybrid.engine.builders import exclude_1d_params

    cfg, device = factory.cfg, factory.device
    model = factory.build().to(torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    initial = {n: p.detach().clone() for n, p in named}
    masters = {n: p.detach().float().clone() for n, p in named}
    groups = [{"params": [masters[n] for n, p in named if not exclude_1d_params(n, p)],
               "weight_decay": es.WEIGHT_DECAY},
              {"params": [masters[n] for n, p in named if exclude_1d_params(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=es.LR, betas=es.BETAS, eps=es.EPS)
    losses = []
    for step in range(steps):
        x, y = es.batch(step, micro, cfg, device)
        loss = model(x, y)
        loss.backward()
        for n, p in named:
            masters[n].grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for n, p in named:
                p.copy_(masters[n])
        losses.append(loss.item())
    final = {n: p.detach() for n, p in named}
    return losses, initial, final


def engine_run(factory: es.ModelFactory, run: Dict, micro: int, steps: int):
    """The same training through hybrid.initialize; returns (losses, steps that updated, final weights, whether
    the optimizer stepped with the compiled Adam)."""
    cfg, device = factory.cfg, factory.device
    engine = es.build_engine(factory, run, micro)
    losses, updated = [], 0
    for step in range(steps):
        x, y = es.batch(step, micro, cfg, device)
        loss = engine(x, y)
        engine.backward(loss)
        updated += bool(engine.step())
        losses.append(loss.item())
    with engine.optimizer.gathered_parameters():
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    compiled = bool(getattr(engine.optimizer.inner, "compiled", False))
    es.close_engine(engine)
    return losses, updated, final, compiled


def loss_errors(losses: List[float], ref: List[float]) -> List[float]:
    """``|loss - ref| / |ref|`` per step; inf for a non-finite loss."""
    return [abs(a - b) / abs(b) if math.isfinite(a) else math.inf for a, b in zip(losses, ref)]


def param_error(final: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], initial: Dict[str, torch.Tensor]):
    """``||w - w_ref|| / ||w_ref - w_0||`` over all parameters (float64 sums); inf when w holds a NaN/inf."""
    num = den = 0.0
    for name, r in ref.items():
        w = final[name].double()
        if not torch.isfinite(w).all():
            return math.inf
        num += (w - r.double()).pow(2).sum().item()
        den += (r.double() - initial[name].double()).pow(2).sum().item()
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def body(res: PartResult) -> None:
    from hybrid.kernels import loaded_ops
    from hybrid.zero.offload import POISON_ENV

    dry = res.dry_run
    topo, info = es.world_one(dry)
    device = topo.device  # the GPU under NCCL, the CPU in the dry run
    cfg = es.model_config(dry, "gpt2-medium")
    steps, micro = dry_run_choice(dry, 20, 4), dry_run_choice(dry, 2, 2)
    res.info.update(model="tiny (dry run)" if dry else "gpt2-medium", steps=steps, micro_batch=micro,
                    seq_length=cfg.seq_length, backend=info.backend, world=info.world_size,
                    loss_rtol="(k+1) * 2^-8 at step k", param_rtol=param_rtol(steps))
    factory = es.ModelFactory(cfg, topo, device)
    (ref_losses, initial, ref_final), ref_s = es.timed(lambda: reference_adamw(factory, micro, steps), device)
    print(f"reference AdamW: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f} in {ref_s:.1f} s", flush=True)
    res.check("the reference's loss falls", ref_losses[-1] < ref_losses[0], f"{ref_losses[0]} -> {ref_losses[-1]}")
    # the reference again: its own run-to-run difference (0 where every kernel is deterministic)
    again_losses, _, again_final = reference_adamw(factory, micro, steps)
    # the loss noise up to step k (a difference, once there, does not shrink back), and the parameters'
    noise_losses = list(itertools.accumulate(loss_errors(again_losses, ref_losses), max))
    noise_params = param_error(again_final, ref_final, initial)
    del again_final
    res.info.update(noise_factor=NOISE_FACTOR, reference_noise_loss=noise_losses[-1],
                    reference_noise_param=noise_params)
    res.rows.append(dict(run="torch AdamW", losses=ref_losses, seconds=ref_s, noise_loss_rel=noise_losses,
                         noise_param_rel=noise_params))
    print(f"reference run to run: loss rel diff {noise_losses[-1]:.2e}, param rel diff {noise_params:.2e}",
          flush=True)
    last_s = ref_s
    worst: List[str] = []
    for name, run in es.ZERO_RUNS.items():
        # every run is one the part exists for: one that does not fit fails the part (the offload run is the
        # slowest: a margin over the last run)
        if not res.fits(name, 1.5 * last_s, required=True):
            continue
        poison = run.get("offload", "none") != "none"
        if poison:
            os.environ[POISON_ENV] = "1"
        try:
            (losses, updated, final, compiled), last_s = es.timed(lambda: engine_run(factory, run, micro, steps),
                                                                   device)
        finally:
            os.environ.pop(POISON_ENV, None)
        loss_errs = loss_errors(losses, ref_losses)
        loss_tols = [loss_rtol(k) + NOISE_FACTOR * noise_losses[k] for k in range(steps)]
        bad_steps = [k for k, e in enumerate(loss_errs) if not e <= loss_tols[k]]
        p_err = param_error(final, ref_final, initial)
        p_tol = param_rtol(steps) + NOISE_FACTOR * noise_params
        ops = loaded_ops()
        res.rows.append(dict(run=name, poisoned_host=poison, losses=losses, loss_rel_err=loss_errs,
                             loss_tol=loss_tols, max_loss_rel_err=max(loss_errs), param_rel_err=p_err,
                             param_tol=p_tol, updated_steps=updated, compiled_adam=compiled, ops_loaded=ops,
                             seconds=last_s))
        res.check(f"{name}: every step updated", updated == steps, f"{updated}/{steps}")
        res.check(f"{name}: loss within (k+1)*2^-8 + {NOISE_FACTOR:g} x noise of the reference", not bad_steps,
                  f"steps {bad_steps}, errors {[f'{loss_errs[k]:.2e}' for k in bad_steps]}")
        res.check(f"{name}: parameters within {p_tol:.3f}", p_err <= p_tol, f"{p_err:.3e}")
        if not dry:  # the dry run may use the torch paths (no compiler needed in CI)
            res.check(f"{name}: the compiled Adam stepped", compiled, "the optimizer fell back to torch's Adam")
            missing = [op for op in GPU_OPS + (("cpu_adam",) if poison else ()) if op not in ops]
            res.check(f"{name}: compiled ops loaded", not missing, f"not loaded: {missing}; loaded: {ops}")
        worst.append(f"{name} {max(loss_errs):.1e}/{p_err:.1e}")
        print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, worst loss rel err {max(loss_errs):.2e}, "
              f"param rel err {p_err:.2e} (tol {p_tol:.3f}), compiled Adam {compiled}, ops {ops} in {last_s:.1f} s",
              flush=True)
    res.headline = (f"{res.info['model']} {steps} steps bf16 vs torch AdamW, loss/param rel err: "
                    + ", ".join(worst))


if __name__ == "__main__":
    sys.exit(run_part(3, "engine", body, __doc__))
