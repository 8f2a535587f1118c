"""CPU Adam/AdamW: hybrid's op against torch.optim.AdamW(fused=True), in paired rounds, next to a copy probe.

    python benchmarks/cpu_adam.py [--params 50000000] [--tensors 1] [--rounds 5] [--steps 10]
        [--threads N] [--bind close|none] [--deepspeed] [--json benchmarks/results/cpu_adam.json]

With ``--deepspeed`` and DeepSpeed importable (for example installed with
``DS_ACCELERATOR=cpu pip install --no-build-isolation --no-deps --target /tmp/dspkgs deepspeed hjson py-cpuinfo msgpack psutil``
and run with ``PYTHONPATH=/tmp/dspkgs DS_ACCELERATOR=cpu``) its DeepSpeedCPUAdam joins case 1.

Case 1: fp32 grads, fp32 params. Case 2 (the ZeRO-offload step): bf16 grads in, fp32 master,
bf16 weights out; torch needs the conversions a user would write around its fused step
(grad bf16 -> fp32 before, master fp32 -> bf16 after), ours does it in one pass.

How it times, so that other processes on a shared machine hit every contender alike:

* One thread pool for everything: ``torch.set_num_threads(--threads)`` sets the count for
  torch's ops and for ours (the op reads ``at::get_num_threads()``), and both run on the same
  OpenMP runtime, whose threads ``--bind close`` pins one per core (OMP_PROC_BIND/OMP_PLACES,
  set by re-executing this script before OpenMP starts).
* Every contender owns buffers of the same sizes, touched before timing (torch's optimizer
  state by its warm-up step).
* A round is a warm-up call of each contender, then ``--steps`` steps in which every contender
  (and the probes) runs once, in an order rotated by one each step; each contender's time
  for the round is its median over those steps. The paired ratio of a round is torch's
  median over ours; the acceptance figure is the minimum of the paired ratios over the
  rounds, next to their median.
* Effective bandwidth: an AdamW update must read the grad (4 B, or 2 in case 2), param, m,
  v (12 B) and write param, m, v (12 B; plus the 2 B copy-out in case 2): 28 B per param in
  both cases. The probes run in the same rounds on the same threads, over two arrays of 2
  floats per param each (the 16 B per param that Adam's four fp32 arrays occupy):
  ``copy b=a`` (counted as 8 B read + 8 B written per param, the STREAM convention; a store to
  a line not in cache also reads it first, which this count leaves out) and ``update a+=s*b``
  (16 B read + 8 B written per param; it writes the lines it has just read, as Adam does, so
  no extra read is hidden).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybrid.argument_parser import ArgumentParser  # noqa: E402
import hybrid.kernels as hk  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BYTES_PER_PARAM = 28  # read g, p, m, v and write p, m, v (fp32); case 2: 2 B grad + 2 B copy-out
PROBE_FLOATS_PER_PARAM = 2  # each probe array: 2 floats per param, so two arrays = Adam's 16 B
BIND_ENV = {"close": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, "none": {}}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed_rounds(contenders: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call for each contender, interleaved over ``rounds`` rounds after a warm-up."""
    for fn in contenders.values():
        fn()
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def paired_rounds(contenders: dict, rounds: int, steps: int) -> list[dict[str, list[float]]]:
    """Seconds per call of every contender, per round and step: ``result[round][name][step]``.

    A round warms every contender up once, then runs ``steps`` steps of one call each, the
    order rotated by one per step so no contender always follows the same neighbour.
    """
    names = list(contenders)
    result = []
    for _ in range(rounds):
        for fn in contenders.values():
            fn()
        times: dict[str, list[float]] = {name: [] for name in names}
        for step in range(steps):
            for k in range(len(names)):
                name = names[(step + k) % len(names)]
                start = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - start)
        result.append(times)
    return result


def split_sizes(n: int, tensors: int) -> list[int]:
    """``n`` params as ``tensors`` tensor sizes that differ by at most one."""
    return [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]


class OurStep:
    """hybrid.kernels.multi_tensor_adam over flat fp32 states, with an increasing step count."""

    def __init__(self, sizes: list[int], grad_dtype: torch.dtype, lowp: bool, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(s, generator=gen) for s in sizes]
        self.grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in sizes]
        self.exp_avgs = [torch.zeros(s) for s in sizes]
        self.exp_avg_sqs = [torch.zeros(s) for s in sizes]
        self.outs = [torch.empty(s, dtype=torch.bfloat16) for s in sizes] if lowp else None
        self.step = 0

    def __call__(self) -> None:
        self.step += 1
        hk.multi_tensor_adam(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.outs, step=self.step,
                             **HYPER)


def torch_params(sizes: list[int], seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def torch_fused(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                             weight_decay=HYPER["weight_decay"], fused=True)


def deepspeed_step(sizes: list[int], seed: int):
    """DeepSpeedCPUAdam's step, or the reason it is not available."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(torch_params(sizes, seed), lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                               eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
    except Exception as exc:  # not installed, or its op fails to build
        return None, f"not available ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"
    return opt.step, ""


def probes(n: int) -> dict:
    """Streaming kernels on the same threads: name -> (fn, bytes counted per param)."""
    size = PROBE_FLOATS_PER_PARAM * n
    a, b = torch.randn(size), torch.randn(size)
    array_bytes = 4 * PROBE_FLOATS_PER_PARAM  # per param, per array
    return {"copy b=a": (lambda: b.copy_(a), 2 * array_bytes),  # read a, write b
            "update a+=s*b": (lambda: a.add_(b, alpha=1e-3), 3 * array_bytes)}  # read a and b, write a


def step_ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """Median over a round's steps of slow's time over fast's in the same step."""
    return statistics.median(s / f for s, f in zip(times[slow], times[fast]))


def report_case(title: str, timed: list[dict[str, list[float]]], ours: str, baseline: str, n: int,
                probe_bytes: dict[str, int]) -> dict:
    """Prints the per-round table of one case and returns its figures.

    Times are per-round medians; the paired ratio of a round is the median of the per-step
    ratios (the two calls of a step run back to back, so load that lasts longer than a step
    cancels out of each ratio).
    """
    rounds = len(timed)
    medians = {name: [statistics.median(t[name]) for t in timed] for name in timed[0]}
    ratios = [step_ratio(t, baseline, ours) for t in timed]
    ours_gbs = [BYTES_PER_PARAM * n / t / 1e9 for t in medians[ours]]
    probe_gbs = {name: [b * n / t / 1e9 for t in medians[name]] for name, b in probe_bytes.items()}
    others = [name for name in medians if name not in (ours, baseline) and name not in probe_bytes]
    print(f"\n{title}")
    header = f"{'round':<7}{'ours ms':>9}{'torch ms':>10}{'torch/ours':>12}"
    header += "".join(f"{name + ' ms':>{max(12, len(name) + 5)}}" for name in others)
    header += f"{'ours GB/s':>11}" + "".join(f"{name + ' GB/s':>{len(name) + 7}}" for name in probe_bytes)
    header += f"{'ours/copy':>11}"
    print(header)
    for r in range(rounds):
        row = f"{r + 1:<7}{1e3 * medians[ours][r]:>9.1f}{1e3 * medians[baseline][r]:>10.1f}{ratios[r]:>11.3f}x"
        row += "".join(f"{1e3 * medians[name][r]:>{max(12, len(name) + 5)}.1f}" for name in others)
        row += f"{ours_gbs[r]:>11.1f}" + "".join(f"{probe_gbs[name][r]:>{len(name) + 7}.1f}" for name in probe_bytes)
        row += f"{ours_gbs[r] / probe_gbs['copy b=a'][r]:>10.2f}x"
        print(row)
    summary = {"ratio_min": min(ratios), "ratio_median": statistics.median(ratios),
               "ours_gbs_median": statistics.median(ours_gbs),
               "probe_gbs_median": {name: statistics.median(v) for name, v in probe_gbs.items()}}
    share = [ours_gbs[r] / probe_gbs["copy b=a"][r] for r in range(rounds)]
    print(f"torch/ours paired ratio: min {summary['ratio_min']:.3f}x, median {summary['ratio_median']:.3f}x "
          f"over {rounds} rounds")
    print(f"ours {summary['ours_gbs_median']:.1f} GB/s ({BYTES_PER_PARAM} B/param) = "
          f"{statistics.median(share):.2f}x the copy probe's "
          f"{summary['probe_gbs_median']['copy b=a']:.1f} GB/s (medians over rounds; "
          f"update probe {summary['probe_gbs_median']['update a+=s*b']:.1f} GB/s)")
    for name in others:
        rel = [step_ratio(t, name, ours) for t in timed]
        print(f"{name}/ours paired ratio: min {min(rel):.3f}x, median {statistics.median(rel):.3f}x")
    return {"title": title, "round_median_ms": {k: [1e3 * t for t in v] for k, v in medians.items()},
            "paired_ratio": ratios, **summary,
            "step_ms": [{k: [round(1e3 * x, 3) for x in v] for k, v in t.items()} for t in timed]}


def rebind(bind: str) -> None:
    """Re-executes this script with the OpenMP binding environment unless it is already set."""
    env = BIND_ENV[bind]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.environ.update(env)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--tensors", type=int, default=1, help="split the params into this many tensors")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="calls of each contender per round")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads, for all")
    parser.add_argument("--bind", choices=sorted(BIND_ENV), default="close", help="OpenMP thread binding")
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeedCPUAdam to case 1")
    parser.add_argument("--no-case2", action="store_true", help="skip the bf16 case")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.params < 1 or args.tensors < 1 or args.rounds < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--params, --tensors, --rounds, --steps and --threads must be >= 1")
    rebind(args.bind)
    torch.set_num_threads(args.threads)
    n = args.params
    sizes = split_sizes(n, args.tensors)

    hk.default_registry().load("cpu_adam")  # build first, outside the timings
    isa = hk.default_registry().load("cpu_adam").default_isa()
    load_start = os.getloadavg()
    bind_text = ", ".join(f"{k}={v}" for k, v in BIND_ENV[args.bind].items()) or "unbound"
    print(f"CPU Adam benchmark: {n:,} params in {args.tensors} tensor(s), {torch.get_num_threads()} threads "
          f"({bind_text}), {cpu_name()}, path {isa}, {args.rounds} rounds x {args.steps} steps, "
          f"load average {load_start[0]:.1f} at start")
    probe_fns = probes(n)
    probe_bytes = {name: b for name, (_, b) in probe_fns.items()}
    probe_calls = {name: fn for name, (fn, _) in probe_fns.items()}

    # Case 1: fp32 grads.
    contenders = {"ours": OurStep(sizes, torch.float32, False, 0), "torch": torch_fused(torch_params(sizes, 1)).step}
    if args.deepspeed:
        ds_step, why = deepspeed_step(sizes, 3)
        if ds_step is None:
            print(f"DeepSpeedCPUAdam {why}")
        else:
            contenders["DeepSpeedCPUAdam"] = ds_step
    case1 = report_case(f"case 1: fp32 grads, fp32 params ({BYTES_PER_PARAM} B/param); per-round medians",
                        paired_rounds({**contenders, **probe_calls}, args.rounds, args.steps), "ours", "torch", n,
                        probe_bytes)
    del contenders
    cases = [case1]

    if not args.no_case2:
        # Case 2: bf16 grads in, bf16 weights out.
        params = torch_params(sizes, 4)
        fused = torch_fused(params)
        gen = torch.Generator().manual_seed(5)
        grads_bf16 = [torch.randn(s, generator=gen).bfloat16() for s in sizes]
        weights_bf16 = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]

        def fused_with_conversions():
            for p, g in zip(params, grads_bf16):
                p.grad.copy_(g)
            fused.step()
            for w, p in zip(weights_bf16, params):
                w.copy_(p.detach())

        contenders = {"ours": OurStep(sizes, torch.bfloat16, True, 6), "torch": fused_with_conversions}
        cases.append(report_case("case 2: bf16 grads -> fp32 master -> bf16 copy-out (28 B/param); "
                                 "torch = fused + conversions", paired_rounds({**contenders, **probe_calls},
                                                                              args.rounds, args.steps),
                                 "ours", "torch", n, probe_bytes))
    load_end = os.getloadavg()
    print(f"load average {load_end[0]:.1f} at end (other processes on this machine slow every contender alike "
          f"within a step, not across rounds)")
    if args.json:
        meta = {"command": "python " + " ".join(sys.argv), "cpu": cpu_name(), "logical_cpus": os.cpu_count(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "bind": BIND_ENV[args.bind],
                "isa": isa, "params": n, "tensors": args.tensors, "rounds": args.rounds, "steps": args.steps,
                "load_average_before": load_start, "load_average_after": load_end,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "gbps_counts": f"Adam {BYTES_PER_PARAM} B/param; probes {probe_bytes} B/param "
                               f"over two arrays of {PROBE_FLOATS_PER_PARAM} floats per param"}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
