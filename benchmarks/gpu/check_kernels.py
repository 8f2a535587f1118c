"""GPU check of hybrid's CUDA kernels: build, verify against torch, time against torch.

    python benchmarks/gpu/check_kernels.py [--json PATH] [--skip-timing] [--dry-run-cpu]

Part 2 of the GPU verification run (benchmarks/gpu/run_all.sh), and a command of its own.
One self-contained run (about 5 minutes on one H200 without --budget):
  1. builds the ``cuda_adam``, ``cuda_norm`` and ``cuda_quantize`` ops through hybrid.kernels (JIT, ninja);
  2. measures the device's copy bandwidth (device-to-device copy, bytes read + written);
  3. checks the kernels on fresh random inputs of several sizes and dtypes, with every
     output poisoned (NaN) before each run: multi-tensor Adam/AdamW against
     ``torch.optim.AdamW`` / ``Adam`` (fp32/bf16/fp16 grads, bf16/fp16 copy-out, aligned and
     misaligned tensors), LayerNorm/RMSNorm forward and backward against a float64
     reference (error also shown for torch's own kernel in the same dtype), and the blockwise
     quantization kernels (int8, int4, 1-bit: pack, unpack, unpack_sum) bit for bit against the
     torch path of hybrid.kernels.quantize on the same device (outputs poisoned with NaN first);
  4. times them against the torch natives (``aten::native_layer_norm`` and its backward,
     ``F.rms_norm``, ``torch.optim.AdamW(fused=True)``) and reports each kernel's effective
     bandwidth as a fraction of the copy bandwidth (the quantization kernels against the torch path).
Prints a table last; exits 1 if any check failed. With $OUT set, the full results are
also written to $OUT/check_kernels.json (run_all.sh names $OUT/part2_kernels.json instead).
``--budget SECONDS``: the timing sections run only while the budget has room (the rest are recorded
as skipped); the checks always run. In the dry run the compiled CPU ops stand in (cpu_adam for Adam,
cpu_quantize for quantization) and a torch stand-in for the norm op.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu.results import PartStopped, stop_on_sigterm  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402

GiB = 1024 ** 3


class Target:
    """Where the check runs. On a GPU: the compiled CUDA ops at full size. With --dry-run-cpu:
    the same code path on CPU at small sizes, with a torch stand-in for the norm op and the
    CPU Adam op, so the script itself can be exercised without a GPU."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self._norm_op = None

    @property
    def norm_op(self):
        if self._norm_op is None:
            if self.dry_run:
                from tests.kernels.test_cuda_glue import StandInNormOp

                self._norm_op = StandInNormOp()
            else:
                from hybrid.kernels.registry import default_registry

                self._norm_op = default_registry().get("cuda_norm")
        return self._norm_op

    def stream(self) -> int:
        return 0 if self.dry_run else torch.cuda.current_stream().cuda_stream

    def size(self, gpu: int, cpu: int) -> int:
        return cpu if self.dry_run else gpu


def _setup_env() -> None:
    major, minor = torch.cuda.get_device_capability(0)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    os.environ.setdefault("HYBRID_KERNELS_CACHE", "/tmp/hybrid-kernels-gpu-check")
    os.environ["HYBRID_KERNELS"] = "require"


def bench_ms(tgt: Target, fn, warmup: int = 3, iters: int = 20) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events (host clock on CPU; the dry run
    times 1 warm-up and 3 calls: it checks the code, its figures mean nothing)."""
    if tgt.dry_run:
        warmup, iters = 1, 3
    for _ in range(warmup):
        fn()
    if tgt.dry_run:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error; NaN anywhere counts as infinite."""
    a64, r64 = a.double(), ref.double()
    if not torch.isfinite(a64).all():
        return float("inf")
    denom = r64.norm().item()
    diff = (a64 - r64).norm().item()
    return diff if denom < 1e-9 else diff / denom


class Report:
    def __init__(self):
        self.checks: list[dict] = []
        self.timings: list[dict] = []
        self.notes: list[str] = []
        self.failed = 0

    def check(self, group: str, case: str, ok: bool, err: float, torch_err: float | None = None, detail: str = ""):
        self.checks.append(dict(group=group, case=case, ok=bool(ok), err=err, torch_err=torch_err, detail=detail))
        if not ok:
            self.failed += 1
            print(f"FAIL {group} {case}: err {err:.3e} {detail}", flush=True)

    def error(self, section: str, exc: BaseException) -> None:
        self.failed += 1
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.notes.append(f"{section} raised: {text}")
        print(f"ERROR in {section}:\n{text}", flush=True)


# ----------------------------------------------------------------- build --

# The op each section runs: a section whose op did not build is skipped (and the build's failure already fails
# the part), so one op's build error still leaves the others checked.
SECTION_OPS = {"adam": "cuda_adam", "norm": "cuda_norm", "quantize": "cuda_quantize"}


def build_ops(report: Report) -> dict:
    """Build (or load, from run_all.sh's background builds) each CUDA op; ``{op: seconds}`` for those built."""
    import hybrid.kernels as hk

    timings = {}
    for name in SECTION_OPS.values():
        start = time.perf_counter()
        # no retry: run_all.sh's background build already tried, and compiling a failed op again would spend the
        # part's budget on the same error
        outcome = hk.build([name], retry_failed=False)[name]
        timings[name] = time.perf_counter() - start
        print(f"build {name}: {outcome.splitlines()[0]} ({timings[name]:.1f} s)", flush=True)
        if outcome != "built":
            report.failed += 1
            report.notes.append(f"build {name}: {outcome}")
            del timings[name]
    return timings


def copy_bandwidth(tgt: Target) -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    nbytes = tgt.size(2 * GiB, 64 * 1024 ** 2)
    src = torch.randn(nbytes // 4, device=tgt.device)
    dst = torch.empty_like(src)
    ms = bench_ms(tgt, lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / (ms * 1e-3)


# ------------------------------------------------------------- Adam check --

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def _adam_tensors(tgt: Target, sizes, grad_dtype, out_dtype, misaligned: bool, gen):
    """Params/grads/state as views into flat buffers (offset by one element when misaligned)."""
    offset = 1 if misaligned else 0
    total = sum(sizes) + offset
    flat_p = torch.randn(total, device=tgt.device, generator=gen)
    flat_g = torch.empty(total, device=tgt.device, dtype=grad_dtype)
    flat_m = torch.zeros(total, device=tgt.device)
    flat_v = torch.zeros(total, device=tgt.device)
    flat_o = None if out_dtype is None else torch.empty(total, device=tgt.device, dtype=out_dtype)
    views = []
    pos = offset
    for n in sizes:
        sl = slice(pos, pos + n)
        views.append((flat_p[sl], flat_g[sl], flat_m[sl], flat_v[sl], None if flat_o is None else flat_o[sl]))
        pos += n
    return views, flat_g, flat_o


def check_adam(report: Report, tgt: Target) -> None:
    import hybrid.kernels as hk

    sizes = [1, 7, 1023, 16384, 16385, tgt.size(100_003, 20_003), tgt.size(1_000_003, 40_003)]
    gen = torch.Generator(device=tgt.device).manual_seed(0)
    modes = [(True, 0.01, 1.0), (False, 0.01, 1.0), (True, 0.0, 0.37)]
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for out_dtype in (None, torch.bfloat16, torch.float16):
            for adamw, wd, scale in modes:
                for misaligned in (False, True):
                    views, flat_g, flat_o = _adam_tensors(tgt, sizes, grad_dtype, out_dtype, misaligned, gen)
                    refs = [p.detach().clone() for p, *_ in views]
                    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
                    opt = opt_cls(refs, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                                  weight_decay=wd, foreach=False)
                    worst, copy_ok = 0.0, True
                    tensors = [(v[0], v[2], v[3]) for v in views]
                    for step in range(1, 4):
                        flat_g.copy_(torch.randn(flat_g.shape, device=tgt.device, generator=gen))
                        if flat_o is not None:
                            flat_o.fill_(float("nan"))  # poison the copy-out
                        for ref, (_, g, *_rest) in zip(refs, views):
                            ref.grad = g.float() * scale
                        opt.step()
                        hk.multi_tensor_adam([v[0] for v in views], [v[1] for v in views], [v[2] for v in views],
                                             [v[3] for v in views], None if flat_o is None else [v[4] for v in views],
                                             weight_decay=wd, step=step, adamw=adamw, grad_scale=scale, **ADAM)
                        # Relative to |expected| + rms over all tensors (one-element tensors have no scale).
                        for k, key in enumerate((None, "exp_avg", "exp_avg_sq")):
                            ours_all = torch.cat([t[k] for t in tensors])
                            want = torch.cat([ref if key is None else opt.state[ref][key] for ref in refs])
                            scale_t = want.abs() + want.pow(2).mean().sqrt()
                            worst = max(worst, ((ours_all - want).abs() / scale_t).max().item())
                        for p, *_rest, o in views:
                            if o is not None:
                                copy_ok &= torch.equal(o.view(torch.int16), p.to(out_dtype).view(torch.int16))
                    case = (f"grad={str(grad_dtype)[6:]} out={str(out_dtype)[6:] if out_dtype else '-'} "
                            f"{'adamw' if adamw else 'adam-l2'} wd={wd} scale={scale} "
                            f"{'misaligned' if misaligned else 'aligned'}")
                    report.check("multi_tensor_adam", case, worst <= 1e-6 and copy_ok, worst,
                                 detail="" if copy_ok else "copy-out not bit-identical to master.to(dtype)")


# ------------------------------------------------------------- norm check --

def _norm_reference(x, w, b, eps, rms):
    """torch's formulation; in float64 the RMSNorm cast-back is the identity, so this is exact math."""
    if rms:
        if x.dtype == torch.float64:
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        from hybrid.kernels import rms_norm_reference

        return rms_norm_reference(x, w, eps)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _norm_case(tgt: Target, report: Report, rms: bool, dtype, w_dtype, with_bias: bool, rows: int, hidden: int,
               misaligned: bool, gen) -> None:
    eps = 1e-6 if rms else 1e-5
    buf = torch.randn(rows * hidden + 1, device=tgt.device, generator=gen).to(dtype)
    x = (buf[1:] if misaligned else buf[:-1]).view(rows, hidden)
    w = (1 + 0.2 * torch.randn(hidden, device=tgt.device, generator=gen)).to(w_dtype)
    b = (0.2 * torch.randn(hidden, device=tgt.device, generator=gen)).to(w_dtype) if with_bias else None
    y_dtype = torch.promote_types(dtype, w_dtype) if rms else dtype
    dy = torch.randn(rows, hidden, device=tgt.device, generator=gen).to(y_dtype)

    nan = float("nan")
    y = torch.full((rows, hidden), nan, device=tgt.device, dtype=y_dtype)
    mean = None if rms else torch.full((rows,), nan, device=tgt.device)
    rstd = torch.full((rows,), nan, device=tgt.device)
    op = tgt.norm_op
    stream = tgt.stream()
    op.norm_forward(x, w, b, y, mean, rstd, eps, rms, stream)
    dx = torch.full_like(x, nan)
    dw = torch.full_like(w, nan)
    db = torch.full_like(w, nan) if with_bias else None
    op.norm_backward(dy, x, w, mean, rstd, dx, dw, db, rms, stream)

    # float64 reference, and torch's own kernels in the working dtype for scale.
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if with_bias else None
    ref = _norm_reference(x64, w64, b64, eps, rms)
    inputs64 = [t for t in (x64, w64, b64) if t is not None]
    grads64 = torch.autograd.grad(ref, inputs64, dy.double())
    ours = [y, dx, dw] + ([db] if with_bias else [])
    refs = [ref, *grads64]
    errs = [rel_err(a, r) for a, r in zip(ours, refs)]
    try:
        xt = x.detach().clone().requires_grad_()
        wt = w.detach().clone().requires_grad_()
        bt = b.detach().clone().requires_grad_() if with_bias else None
        out_t = _norm_reference(xt, wt, bt, eps, rms)
        grads_t = torch.autograd.grad(out_t, [t for t in (xt, wt, bt) if t is not None], dy)
        torch_errs = [rel_err(a, r) for a, r in zip([out_t, *grads_t], refs)]
    except RuntimeError:  # torch may not support this dtype mix; judge by the tolerance alone
        torch_errs = [float("nan")] * len(errs)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    # Our error may not exceed the tolerance, nor be far worse than torch's own in this dtype.
    ok = all(e <= tol or (t == t and e <= 2 * t + 1e-6) for e, t in zip(errs, torch_errs)) and max(errs) < 0.1
    ok = ok and torch.isfinite(rstd).all().item() and (rms or torch.isfinite(mean).all().item())
    case = (f"{'rms' if rms else 'ln'} x={str(dtype)[6:]} w={str(w_dtype)[6:]} bias={int(with_bias)} "
            f"{rows}x{hidden}{' misaligned' if misaligned else ''}")
    report.check("rms_norm" if rms else "layer_norm", case, ok, max(errs), max(torch_errs),
                 detail=f"y/dx/dw/db errs {['%.1e' % e for e in errs]} torch {['%.1e' % e for e in torch_errs]}")


def check_norms(report: Report, tgt: Target) -> None:
    import hybrid.kernels as hk

    gen = torch.Generator(device=tgt.device).manual_seed(1)
    hiddens = [1, 7, 37, 768, 1000, 4096, 8192, 16384]
    for rms in (False, True):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for w_dtype in sorted({dtype, torch.float32}, key=str):
                for with_bias in ((True, False) if not rms else (False,)):
                    for hidden in hiddens:
                        rows = 200 if hidden <= 1024 else tgt.size(64, 8)
                        _norm_case(tgt, report, rms, dtype, w_dtype, with_bias, rows, hidden, False, gen)
                    _norm_case(tgt, report, rms, dtype, w_dtype, with_bias, tgt.size(50, 8), 4096, True, gen)
    # The public autograd wrappers on a 3-D input.
    x = torch.randn(4, 33, 4096, device=tgt.device, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(4096, device=tgt.device, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(4096, device=tgt.device, generator=gen).bfloat16().requires_grad_()
    for rms in (False, True):
        y = hk.rms_norm(x, w, 1e-6) if rms else hk.layer_norm(x, w, b, 1e-5)
        ins = [x, w] if rms else [x, w, b]
        grads = torch.autograd.grad(y, ins, torch.ones_like(y))
        x64 = [t.detach().double().requires_grad_() for t in ins]
        ref = _norm_reference(x64[0], x64[1], None if rms else x64[2], 1e-6 if rms else 1e-5, rms)
        ref_grads = torch.autograd.grad(ref, x64, torch.ones_like(ref))
        errs = [rel_err(y, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
        report.check("autograd wrapper", f"{'rms_norm' if rms else 'layer_norm'} bf16 [4,33,4096]",
                     max(errs) < 2e-2, max(errs))


# --------------------------------------------------------- quantize check --

def check_quantize(report: Report, tgt: Target) -> None:
    """The compiled quantization op (cuda_quantize; cpu_quantize in the dry run) bit for bit against the
    torch path on the same device, on the tests' adversarial inputs (denormals, near FLT_MAX, NaN, inf,
    zero blocks), every output poisoned with NaN before the call."""
    from hybrid.kernels import quantize as Q
    from tests.kernels.test_quantize import FORMATS, _adversarial, same_bits

    nan = float("nan")
    for bits, block in FORMATS + [(8, 4096), (1, Q.MAX_CUDA_1BIT_BLOCK)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            bad = []
            sizes = [(1, 1), (3, block - 1), (4, 6 * block + 3)] + ([] if tgt.dry_run else [(2, 100_003)])
            for rows, k in sizes:
                x = _adversarial(rows, k, block, dtype, seed=rows + k).to(tgt.device)
                want = Q.pack(x, bits, block, use_kernel=False)
                wire = Q.pack(x, bits, block)
                if not torch.equal(wire, want):
                    bad.append(f"pack {rows}x{k}")
                out = torch.full((rows, k), nan, device=tgt.device)
                if not same_bits(Q.unpack(wire, k, bits, block, out=out), Q.unpack(want, k, bits, block,
                                                                                  use_kernel=False)):
                    bad.append(f"unpack {rows}x{k}")
                for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                    got = Q.unpack_sum(wire, k, bits, block, torch.full((k,), nan, device=tgt.device, dtype=out_dtype))
                    ref = Q.unpack_sum(want, k, bits, block, torch.empty(k, device=tgt.device, dtype=out_dtype),
                                       use_kernel=False)
                    if not same_bits(got, ref):
                        bad.append(f"unpack_sum->{str(out_dtype)[6:]} {rows}x{k}")
            report.check("quantize (bit-identical)", f"int{bits} block {block} x={str(dtype)[6:]}", not bad,
                         float(len(bad)), detail="; ".join(bad))


def time_quantize(report: Report, copy_bw: float, tgt: Target) -> None:
    """pack and unpack_sum of [4, n] bf16 rows: the compiled op against the torch path."""
    from hybrid.kernels import quantize as Q

    rows, n = 4, tgt.size(16 * 2**20, 2**18)
    x = torch.randn(rows, n, device=tgt.device, dtype=torch.bfloat16)
    for bits in (8, 1):
        wire = Q.pack(x, bits)
        wire_bytes = wire.numel()
        ours = bench_ms(tgt, lambda: Q.pack(x, bits))
        theirs = bench_ms(tgt, lambda: Q.pack(x, bits, use_kernel=False))
        report.timings.append(_timing(f"quantize pack int{bits}", f"{rows}x{n} bf16", ours, theirs, "torch path",
                                      x.numel() * x.element_size() + wire_bytes, copy_bw))
        out = torch.empty(n, device=tgt.device)
        ours = bench_ms(tgt, lambda: Q.unpack_sum(wire, n, bits, out=out))
        theirs = bench_ms(tgt, lambda: Q.unpack_sum(wire, n, bits, out=out, use_kernel=False))
        report.timings.append(_timing(f"quantize unpack_sum int{bits}", f"{rows}x{n} -> fp32", ours, theirs,
                                      "torch path", wire_bytes + 4 * n, copy_bw))


# ----------------------------------------------------------------- timing --

def time_norms(report: Report, copy_bw: float, tgt: Target) -> None:
    for rows, hidden in ((tgt.size(32768, 128), 4096), (tgt.size(16384, 64), 8192)):
        _time_norm_shape(report, copy_bw, tgt, rows, hidden, torch.bfloat16)
        if not tgt.dry_run:
            torch.cuda.empty_cache()


def _time_norm_shape(report: Report, copy_bw: float, tgt: Target, rows: int, hidden: int, dtype) -> None:
    from hybrid.kernels import rms_norm_reference

    op = tgt.norm_op
    stream = tgt.stream()
    x = torch.randn(rows, hidden, device=tgt.device, dtype=dtype)
    w = torch.randn(hidden, device=tgt.device, dtype=dtype)
    b = torch.randn(hidden, device=tgt.device, dtype=dtype)
    dy = torch.randn_like(x)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    mean = torch.empty(rows, device=tgt.device)
    rstd = torch.empty(rows, device=tgt.device)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    n = rows * hidden
    esize = x.element_size()
    shape = f"{rows}x{hidden} {str(dtype)[6:]}"

    ours = bench_ms(tgt, lambda: op.norm_forward(x, w, b, y, mean, rstd, 1e-5, False, stream))
    _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, [hidden], w, b, 1e-5)
    theirs = bench_ms(tgt, lambda: torch.ops.aten.native_layer_norm(x, [hidden], w, b, 1e-5))
    report.timings.append(_timing("layer_norm fwd", shape, ours, theirs, "aten native_layer_norm",
                                  2 * n * esize, copy_bw))
    op.norm_forward(x, w, b, y, mean, rstd, 1e-5, False, stream)
    ours = bench_ms(tgt, lambda: op.norm_backward(dy, x, w, mean, rstd, dx, dw, db, False, stream))
    theirs = bench_ms(tgt, lambda: torch.ops.aten.native_layer_norm_backward(
        dy, x, [hidden], t_mean, t_rstd, w, b, [True, True, True]))
    report.timings.append(_timing("layer_norm bwd", shape, ours, theirs, "aten native_layer_norm_backward",
                                  3 * n * esize, copy_bw))

    ours = bench_ms(tgt, lambda: op.norm_forward(x, w, None, y, None, rstd, 1e-6, True, stream))
    theirs = bench_ms(tgt, lambda: F.rms_norm(x, (hidden,), w, 1e-6))
    eager = bench_ms(tgt, lambda: rms_norm_reference(x, w, 1e-6))
    report.timings.append(_timing("rms_norm fwd", shape, ours, theirs, "F.rms_norm", 2 * n * esize, copy_bw,
                                  extra=f"eager fp32-cast formula {eager:.3f} ms"))
    op.norm_forward(x, w, None, y, None, rstd, 1e-6, True, stream)
    ours = bench_ms(tgt, lambda: op.norm_backward(dy, x, w, None, rstd, dx, dw, None, True, stream))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = F.rms_norm(xg, (hidden,), wg, 1e-6)
    theirs = bench_ms(tgt, lambda: torch.autograd.grad(out, (xg, wg), dy, retain_graph=True))
    report.timings.append(_timing("rms_norm bwd", shape, ours, theirs, "F.rms_norm autograd",
                                  3 * n * esize, copy_bw))


def time_adam(report: Report, copy_bw: float, tgt: Target) -> None:
    for layout, count in (("1 flat tensor", 1), ("100 tensors", 100)):
        _time_adam_layout(report, copy_bw, tgt, layout, count)
        if not tgt.dry_run:
            torch.cuda.empty_cache()


def _time_adam_layout(report: Report, copy_bw: float, tgt: Target, layout: str, count: int) -> None:
    import hybrid.kernels as hk

    total = tgt.size(50_000_000, 500_000)
    sizes = [total // count] * count
    params = [torch.randn(s, device=tgt.device) for s in sizes]
    grads32 = [torch.randn(s, device=tgt.device) for s in sizes]
    grads16 = [g.bfloat16() for g in grads32]
    ms = [torch.zeros(s, device=tgt.device) for s in sizes]
    vs = [torch.zeros(s, device=tgt.device) for s in sizes]
    outs = [torch.empty(s, device=tgt.device, dtype=torch.bfloat16) for s in sizes]
    tparams = [torch.nn.Parameter(p.clone()) for p in params]
    for tp, g in zip(tparams, grads32):
        tp.grad = g.clone()
    step = [0]

    def ours(grads, lowp):
        step[0] += 1
        hk.multi_tensor_adam(params, grads, ms, vs, lowp, weight_decay=0.01, step=step[0], **ADAM)

    fused = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=0.01, fused=True)
    foreach = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=0.01, foreach=True)
    t_ours = bench_ms(tgt, lambda: ours(grads32, None))
    t_fused = bench_ms(tgt, fused.step)
    t_foreach = bench_ms(tgt, foreach.step)
    report.timings.append(_timing("adamw fp32", f"{total / 1e6:.0f}M, {layout}", t_ours, t_fused, "AdamW(fused=True)",
                                  28 * total, copy_bw, extra=f"foreach {t_foreach:.3f} ms"))
    low_tp = [torch.empty(s, device=tgt.device, dtype=torch.bfloat16) for s in sizes]
    fp32_grads = [tp.grad for tp in tparams]
    masters = [tp.detach() for tp in tparams]

    def fused_with_conversions():
        torch._foreach_copy_(fp32_grads, grads16)  # bf16 grads -> fp32
        fused.step()
        torch._foreach_copy_(low_tp, masters)  # fp32 master -> bf16 weights

    t_ours = bench_ms(tgt, lambda: ours(grads16, outs))
    t_theirs = bench_ms(tgt, fused_with_conversions)
    report.timings.append(_timing("adamw bf16 grad+copy-out", f"{total / 1e6:.0f}M, {layout}", t_ours, t_theirs,
                                  "fused + conversions", 28 * total, copy_bw))


def _timing(name, shape, ours_ms, torch_ms, contender, useful_bytes, copy_bw, extra=""):
    ours_bw = useful_bytes / (ours_ms * 1e-3)
    torch_bw = useful_bytes / (torch_ms * 1e-3)
    row = dict(kernel=name, shape=shape, ours_ms=ours_ms, torch_ms=torch_ms, contender=contender,
               speedup=torch_ms / ours_ms, ours_gbs=ours_bw / 1e9, ours_frac=ours_bw / copy_bw,
               torch_frac=torch_bw / copy_bw, extra=extra)
    print(f"timed {name} {shape}: ours {ours_ms:.3f} ms, {contender} {torch_ms:.3f} ms {extra}", flush=True)
    return row


# ------------------------------------------------------------------ main --

def print_summary(report: Report, info: dict) -> None:
    print("\n" + "=" * 100)
    print(f"hybrid GPU kernel check: {info['device']}, torch {info['torch']}, CUDA {info['cuda']}")
    print("build: " + ", ".join(f"{k} {v:.1f} s" for k, v in info.get("build_s", {}).items()))
    if "copy_bw" in info:
        print(f"copy bandwidth: {info['copy_bw'] / 1e12:.2f} TB/s (2 GiB device-to-device, read + write)")
    groups: dict[str, list] = {}
    for c in report.checks:
        groups.setdefault(c["group"], []).append(c)
    print(f"\n{'correctness':<22}{'cases':>7}{'failed':>8}{'worst err':>12}{'torch same-dtype':>18}")
    for name, rows in groups.items():
        torch_errs = [r["torch_err"] for r in rows if r["torch_err"] is not None]
        print(f"{name:<22}{len(rows):>7}{sum(not r['ok'] for r in rows):>8}{max(r['err'] for r in rows):>12.2e}"
              f"{(max(torch_errs) if torch_errs else float('nan')):>18.2e}")
    if report.timings:
        print(f"\n{'timing (median of 20)':<26}{'shape':<22}{'ours ms':>9}{'torch ms':>10}{'speedup':>9}"
              f"{'ours GB/s':>11}{'ours %copy':>11}{'torch %copy':>12}  contender")
        for t in report.timings:
            print(f"{t['kernel']:<26}{t['shape']:<22}{t['ours_ms']:>9.3f}{t['torch_ms']:>10.3f}{t['speedup']:>8.2f}x"
                  f"{t['ours_gbs']:>11.0f}{100 * t['ours_frac']:>10.0f}%{100 * t['torch_frac']:>11.0f}%  "
                  f"{t['contender']}{'; ' + t['extra'] if t['extra'] else ''}")
    print(f"\n{'ALL CHECKS PASSED' if report.failed == 0 else f'{report.failed} CHECK(S) FAILED'} "
          f"in {info['wall_s']:.0f} s")


def main() -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write full results here (default: $OUT/check_kernels.json if $OUT is set)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="exercise this script on CPU (small sizes, torch stand-in for the norm op)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: run the timing sections only while this budget has room")
    parser.add_argument("--grace", type=float, default=0.0,
                        help="run_all.sh's seconds between the budget and its hard stop (unused: the sections "
                             "plan within the budget)")
    args = parser.parse_args()
    tgt = Target(args.dry_run_cpu)
    if not tgt.dry_run and not torch.cuda.is_available():
        print("check_kernels: no CUDA device; nothing to check (CUDA kernels compiled, not run)")
        return 2
    started = time.perf_counter()
    report = Report()
    skipped: list[str] = []
    info: dict = dict(device="CPU (dry run)" if tgt.dry_run else torch.cuda.get_device_name(0),
                      torch=torch.__version__, cuda=torch.version.cuda)
    timed_out = False
    # run_all.sh's `timeout` sends SIGTERM first: it ends the sections, and what they found is still written
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        if tgt.dry_run:
            os.environ["HYBRID_KERNELS"] = "require"
            info["build_s"] = {}
            built = set(SECTION_OPS.values())  # the dry run's stand-ins
        else:
            _setup_env()
            try:
                info["build_s"] = build_ops(report)
            except Exception as exc:  # keep going: later sections report what they can
                report.error("build", exc)
                info["build_s"] = {}
            built = set(info["build_s"])
        runnable = {section for section, op in SECTION_OPS.items() if op in built}
        skipped += [f"{section} check and timing: {op} did not build" for section, op in SECTION_OPS.items()
                    if section not in runnable]
        try:
            info["copy_bw"] = copy_bandwidth(tgt)
            print(f"copy bandwidth {info['copy_bw'] / 1e12:.2f} TB/s", flush=True)
        except Exception as exc:
            report.error("copy bandwidth", exc)
        for section, fn in (("adam", check_adam), ("norm", check_norms), ("quantize", check_quantize)):
            if section not in runnable:
                continue
            try:
                fn(report, tgt)
            except Exception as exc:
                report.error(f"{section} check", exc)
        last_s = None
        if not args.skip_timing and "copy_bw" in info:
            for section, fn in (("norm", time_norms), ("adam", time_adam), ("quantize", time_quantize)):
                if section not in runnable:
                    continue
                elapsed = time.perf_counter() - started
                # start a timing section only if one as long as the last (a tenth of the budget for the first)
                # still fits
                if args.budget is not None and elapsed + (last_s or 0.1 * args.budget) > args.budget:
                    skipped.append(f"{section} timing: {args.budget - elapsed:.0f} s left of the "
                                   f"{args.budget:.0f} s budget")
                    print(f"skipped {section} timing (budget)", flush=True)
                    continue
                try:
                    fn(report, info["copy_bw"], tgt)
                except Exception as exc:
                    report.error(f"{section} timing", exc)
                last_s = time.perf_counter() - started - elapsed
    except PartStopped as exc:
        timed_out = True
        report.error("time limit", exc)
    info["wall_s"] = time.perf_counter() - started
    path = args.json or (os.path.join(os.environ["OUT"], "check_kernels.json") if os.environ.get("OUT") else None)
    if path:
        failed = sum(not c["ok"] for c in report.checks)
        headline = (f"{len(report.checks) - failed}/{len(report.checks)} correctness cases pass; "
                    f"{len(report.timings)} timings" + (f"; {len(report.notes)} error(s)" if report.notes else ""))
        status = "timeout" if timed_out else "ok" if report.failed == 0 else "failed"
        with open(path, "w") as fh:
            json.dump(dict(part=2, name="kernels", status=status, headline=headline,
                           wall_s=info["wall_s"], budget_s=args.budget, dry_run=tgt.dry_run, skipped=skipped,
                           info=info, checks=report.checks, timings=report.timings, notes=report.notes),
                      fh, indent=1)
    print_summary(report, info)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
