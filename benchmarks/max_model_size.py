"""The largest GPT each data-parallel trainer fits in this machine's memory (world 4, gloo), and the planner's bet.

For every contender -- torch DDP, hybrid ZeRO stages 0/1/2/3, stage 3 with
CPU offload, torch FSDP2 (and DeepSpeed ZeRO-3 when importable) -- the search
looks for the largest model (sequence ``--seq``, micro batch 1, fp32 AdamW)
at which 4 gloo ranks train 3 steps while their resident peaks, summed, stay
under ``--budget``. The model grows one of two ways:

* ``--vary hidden`` (wide, the default): ``--layers`` layers, the hidden size
  in steps of ``--step`` (128);
* ``--vary layers`` (deep): hidden size ``--hidden``, the number of layers in
  steps of ``--step`` (1).

The deep shape is the fairer comparison of what ZeRO partitions. At a fixed
width every contender trains the same layers, so what does not scale with the
parameter count -- one layer's activations and gradients, and a stage-3
*unit* (one module's weights, gathered whole: at most ``4h^2`` elements) with
its staged gradient -- is the same for all of them, and only the per-parameter
state (20 bytes for DDP, ``16/N_d`` for stage 3) decides how many layers fit.
A wide 2-layer model instead makes the units grow with the model (71M elements
at hidden 4224), so stage 3's transient grows with its parameters. The
parameter count is what the table compares ('vs DDP' is a ratio of
parameters, never of hidden sizes or layers), and one layer adds a fixed
``12h^2`` parameters, a finer step than 128 in hidden.

``--bucket`` (``zero.bucket_size``, and DDP's bucket cap) and ``--prefetch``
(``zero.prefetch_bucket_size``) are what a memory-bound stage-3 run tunes:
the bucket bounds the gradient reductions in flight
(:mod:`hybrid.zero.inflight`) and the prefetch the weights gathered ahead.

Each attempt starts 4 fresh rank processes (gloo on loopback); a monitor
reads each rank's resident peak (``VmHWM``) every 50 ms and kills them the
moment the peaks' sum crosses the budget (the kernel's OOM killer counts as a
failure too). A rank's peak is what the planner predicts, and a high-water
mark misses nothing between two readings, so an attempt measures the same to
about a MiB from run to run (a sampled sum of RSS varied by 0.3%). glibc's
adaptive mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``) so that freed
tensors return to the system and RSS follows the live bytes.

The search starts at the planner's prediction and walks up or down from it
one step, then in doubling strides, then bisects between the largest fit and
the smallest failure: two attempts when the prediction is right, and the
table says whether the planner's largest is the one found ('exact') or how
many steps it missed. The planner's prediction for a contender is the largest
size whose predicted peak per rank (``hybrid.plan.estimate_memory`` with the
CPU device profile: tensors plus gloo's private copies, and host memory for
offload), plus what a rank holds beyond those tensors, times 4 fits the
budget. That last part is measured once, on the smallest model (see
``calibrate``): for the hybrid stages on stage 0, which is not judged, and for
each of torch's trainers on itself. Every attempt and the final table print
the planner's summed figure beside the measured one. torch's trainers are
predicted with the hybrid stage holding the same state (DDP as stage 0 plus
DDP's separate gradient buckets, with no gradient beside the activations;
FSDP2 and DeepSpeed as stage 3): the planner models hybrid, so those rows are
rougher. Stages 0-2 build the model whole
before flattening it, which the prediction adds as a construction peak (two
copies of the fp32 weights); stage 3 and FSDP2 build on ``meta`` and
materialise only each rank's shard.

Reproduce (from the repository root; hold ``flock /work/bench.lock`` on a shared machine)::

    python benchmarks/max_model_size.py                      # all contenders, 20 GiB budget, ~25 minutes
    python benchmarks/max_model_size.py --budget 16GiB --max-attempts 4   # the wide run in docs/planner.md
    python benchmarks/max_model_size.py --vary layers --hidden 768 --budget 6GiB,7GiB,8GiB,10GiB,12GiB \
        --bucket 2000000 --prefetch 2000000 --only "torch DDP,hybrid zero-3"   # the deep runs in docs/planner.md
    python benchmarks/max_model_size.py --only "zero-3" --budget 6GiB --max-attempts 3   # a quick look
    python benchmarks/max_model_size.py --only "zero-3" --predict 4224,4352   # the planner's figures only
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Dict, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hybrid.argument_parser import ArgumentParser  # noqa: E402

WORLD = 4
VOCAB = 1024
# A fixed mmap threshold turns off glibc's adaptive one, so freed tensors go back to the system and
# resident memory follows live tensor bytes (the same setting for every contender).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # hybrid | ddp | fsdp2 | deepspeed
    stage: int = 0
    offload: str = "none"


CONTENDERS = [
    Contender("torch DDP", "ddp"),
    Contender("hybrid zero-0", "hybrid", 0),
    Contender("hybrid zero-1", "hybrid", 1),
    Contender("hybrid zero-2", "hybrid", 2),
    Contender("hybrid zero-3", "hybrid", 3),
    Contender("hybrid zero-3 + offload", "hybrid", 3, "cpu"),
    Contender("torch FSDP2", "fsdp2"),
    Contender("DeepSpeed ZeRO-3", "deepspeed", 3),
]


def gpt_config(size: int, args):
    """The GPT of search size ``size``: its hidden size (``--vary hidden``) or its layers (``--vary layers``)."""
    from model_zoo import GPTConfig

    hidden, layers = (size, args.layers) if args.vary == "hidden" else (args.hidden, size)
    return GPTConfig(vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                     seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0)


def n_params(size: int, args) -> int:
    from model_zoo import count_parameters

    return count_parameters(gpt_config(size, args))


def zero_knobs(args) -> Dict:
    """The ``zero`` settings every hybrid contender gets from the command line (the rest keep their defaults)."""
    knobs = {"bucket_size": args.bucket}
    if args.prefetch is not None:
        knobs["prefetch_bucket_size"] = args.prefetch
    return knobs


# ---- availability ------------------------------------------------------------------------------------
def unavailable(c: Contender) -> Optional[str]:
    """Why a contender cannot run here, or None."""
    if c.kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    if c.kind == "hybrid":
        from hybrid.config.schema import ZERO_STAGES, ZeroConfig

        if c.stage not in ZERO_STAGES:
            return f"hybrid has no ZeRO stage {c.stage} yet"
        if c.offload != "none" and "offload_optimizer" not in {f.name for f in dataclasses.fields(ZeroConfig)}:
            return "hybrid has no zero.offload_optimizer yet"
    return None


# ---- one attempt, inside each rank -------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _build(c: Contender, size: int, args):
    """The training step of contender ``c`` on this rank, as a function of (x, y)."""
    import torch

    from hybrid import Topology
    from model_zoo import GPTModel

    cfg = gpt_config(size, args)
    if c.kind == "hybrid" and c.stage == 3 and importlib.util.find_spec("hybrid.zero.sharded_init"):
        from hybrid.config import OptimizerConfig, ZeroConfig
        from hybrid.zero.sharded_init import zero3_from_meta

        # Sharded deferred init: built on meta, each rank materialises only its own partition.
        model = GPTModel(cfg, Topology(tp=1), device="meta")
        model.check_inputs = False
        opt = zero3_from_meta(model, model.topology, model.seed,
                              ZeroConfig(stage=3, offload_optimizer=c.offload, **zero_knobs(args)),
                              OptimizerConfig(lr=1e-4))

        def step(x, y):
            opt.backward(model(x, y))
            opt.step()
            opt.zero_grad()
        return step
    if c.kind == "hybrid":
        import hybrid

        topo = Topology(tp=1)
        model = GPTModel(cfg, topo)
        model.check_inputs = False
        zero = {"stage": c.stage, **zero_knobs(args)}
        if c.offload != "none":
            zero["offload_optimizer"] = c.offload
        engine = hybrid.initialize(model, {"zero": zero, "optimizer": {"type": "adamw", "lr": 1e-4},
                                           "micro_batch_size": 1, "steps_per_print": 0}, topology=topo)

        def step(x, y):
            engine.backward(engine(x, y))
            engine.step()
        return step
    if c.kind == "deepspeed":
        import deepspeed

        model = GPTModel(cfg, Topology.local())
        model.check_inputs = False
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": args.bucket,
                                  **({} if args.prefetch is None else {"stage3_prefetch_bucket_size": args.prefetch})},
            "steps_per_print": 10**9})

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return step
    if c.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = GPTModel(cfg, Topology.local())  # TP size 1: plain layers, no collectives inside
        model.check_inputs = False
        model = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:  # FSDP2: built on meta and materialised shard by shard, as FSDP2 is meant to be used
        from torch.distributed.fsdp import fully_shard

        model = GPTModel(cfg, Topology.local(), device="meta")
        model.check_inputs = False
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)  # values do not matter here, only the bytes
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(x, y):
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def rank_main(spec: str) -> None:
    """Entry point of one rank of one attempt (RANK etc. in the environment): train, print one JSON line."""
    import torch

    import hybrid
    from hybrid.distributed import destroy_distributed

    d = json.loads(spec)
    c, size, args = Contender(**d["contender"]), d["size"], argparse.Namespace(**d["args"])
    torch.set_num_threads(1)  # 4 ranks share the cores
    hybrid.init_distributed(timeout_s=args.attempt_timeout, backend="gloo")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS
    base_kib = _status_kib("VmRSS")
    torch.manual_seed(0)
    step = _build(c, size, args)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    t0 = time.time()
    for _ in range(args.steps):
        x = torch.randint(0, VOCAB, (1, args.seq), generator=g)
        step(x, x)
    print("RESULT " + json.dumps({"base_mib": base_kib / 1024, "peak_mib": _status_kib("VmHWM") / 1024,
                                  "train_s": time.time() - t0}), flush=True)
    destroy_distributed()


# ---- the parent: run attempts under the memory monitor ---------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_kib(pid: int, last: int) -> int:
    """Rank ``pid``'s resident peak (VmHWM, KiB) so far; ``last`` once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:  # the rank just exited: its peak is the last one read
        pass
    return last


def run_attempt(c: Contender, size: int, args) -> Dict:
    """``{"ok": bool, "why": str, "peak_sum": bytes, "seconds": float}`` for one model size.

    An attempt that fails for another reason than memory (a rendezvous port
    taken in the meantime, say) is run once more.
    """
    result = _run_attempt_once(c, size, args)
    if result["why"].startswith("failed"):
        result = _run_attempt_once(c, size, args)
    return result


def _run_attempt_once(c: Contender, size: int, args) -> Dict:
    spec = json.dumps({"contender": dataclasses.asdict(c), "size": size, "args": vars(args)})
    port = _free_port()
    t0 = time.time()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **MALLOC_ENV)
        if c.kind == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", spec], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    peaks, peak, why = [0] * WORLD, 0, ""
    while any(p.poll() is None for p in procs):
        # Each rank's own high-water mark, summed: what the planner predicts (a rank's peak, times the ranks), and
        # unlike a sampled sum of RSS it misses no short peak, so the same attempt measures the same to a MiB.
        peaks = [_peak_kib(p.pid, last) for p, last in zip(procs, peaks)]
        peak = sum(peaks) * 1024
        if peak > args.budget:
            why = f"over budget ({peak / 2**30:.2f} GiB)"
        elif time.time() - t0 > args.attempt_timeout:
            why = "timed out"
        elif any(p.returncode not in (None, 0) for p in procs):
            why = "a rank died"
        if why:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            break
        time.sleep(0.05)
    outputs = [p.communicate() for p in procs]
    seconds = time.time() - t0
    results = [json.loads(line[len("RESULT "):]) for out, _ in outputs for line in out.splitlines()
               if line.startswith("RESULT ")]
    if why or len(results) != WORLD:
        if not why or why == "a rank died":
            dead = [(p.returncode, err) for p, (_, err) in zip(procs, outputs) if p.returncode not in (0, -9)]
            if dead:
                tail = (dead[0][1].strip().splitlines() or ["no output"])[-1]
                why = f"failed (exit {dead[0][0]}): {tail[:100]}"
            else:
                why = "killed by the system (out of memory)"
        return {"ok": False, "why": why, "peak_sum": peak, "seconds": seconds}
    # Each rank's own last reading is its final peak; one reached after the monitor's last look still counts.
    peak = sum(r["peak_mib"] for r in results) * 2**20
    if peak > args.budget:
        return {"ok": False, "why": f"over budget ({peak / 2**30:.2f} GiB)", "peak_sum": peak, "seconds": seconds}
    return {"ok": True, "why": "", "peak_sum": peak, "seconds": seconds,
            "base_mib": max(r["base_mib"] for r in results), "train_s": max(r["train_s"] for r in results)}


# ---- the planner's prediction ----------------------------------------------------------------------
def predicted_rank_bytes(c: Contender, size: int, args) -> int:
    """Predicted peak bytes of one rank: the planner's training peak, or the construction peak if larger."""
    from hybrid.plan import CPU, Candidate, ParallelLayout, TrainingSetup, ZeroStage, estimate_memory, shard_shapes

    cfg = gpt_config(size, args)
    # torch's trainers are predicted as the hybrid stage that holds the same state.
    same_state = {"ddp": ZeroStage.DISABLED, "fsdp2": ZeroStage.PARAMETERS, "deepspeed": ZeroStage.PARAMETERS}
    parallel = ParallelLayout(tp=1, dp=WORLD, zero_stage=same_state.get(c.kind, c.stage), precision="fp32")
    candidate = Candidate(parallel, offload=c.offload, micro_batch=1)
    knobs = {} if args.prefetch is None else {"stage3_prefetch": args.prefetch}
    est = estimate_memory(cfg, candidate, TrainingSetup(bucket_size=args.bucket, weight_decay=False, profile=CPU,
                                                        **knobs), micro_batches=1)  # one micro-batch per step
    weights = 4 * sum(s.numel for s in shard_shapes(cfg, 1))
    peak = est.resident_peak + est.host
    whole = not candidate.traits.parameters
    if c.kind == "ddp":
        # DDP's gradients are freed every step (zero_grad(set_to_none=True)) and come back in backward as the
        # activations go, so where hybrid keeps its gradient buffer beside the activations DDP holds neither at
        # once; its buckets are a second copy of the gradients, held throughout.
        peak = max(est.step_peak, est.forward_peak - est.grads, est.backward_peak - est.grads) + est.untracked
        peak += est.host + weights
    if c.kind == "hybrid" and whole:
        peak = max(peak, 2 * weights)  # the model is built whole, then copied into the flat buffer
    if c.kind == "hybrid" and not whole and not importlib.util.find_spec("hybrid.zero.sharded_init"):
        peak = max(peak, weights + est.persistent)  # without sharded init every rank builds the whole model
    return peak


def predicted_sum(c: Contender, size: int, args, base_bytes: float) -> float:
    """The planner's resident bytes summed over the ranks (what the monitor compares with the budget)."""
    return WORLD * (base_bytes + predicted_rank_bytes(c, size, args))


def predicted_size(c: Contender, args, base_bytes: float) -> int:
    """The largest size (a multiple of ``--step``) whose predicted summed RSS fits the budget."""
    best = args.step
    for size in range(args.step, 1024 * args.step + 1, args.step):
        if predicted_sum(c, size, args, base_bytes) > args.budget:
            break
        best = size
    return best


# ---- the search ------------------------------------------------------------------------------------------
def search(c: Contender, args, base_bytes: float, log) -> Dict:
    guess = predicted_size(c, args, base_bytes)
    fit, fail, tried = None, None, {}

    def probe(h: int) -> bool:
        r = run_attempt(c, h, args)
        tried[h] = r
        log(f"  {c.name:26s} {args.vary} {h:5d} ({n_params(h, args) / 1e6:7.1f}M params): "
            f"{'fits' if r['ok'] else r['why']:32s} peak RSS sum {r['peak_sum'] / 2**30:5.2f} GiB "
            f"(planner {predicted_sum(c, h, args, base_bytes) / 2**30:5.2f}), {r['seconds']:5.1f}s")
        return r["ok"]

    h, step, stride = guess, args.step, args.step
    while len(tried) < args.max_attempts and h not in tried and h >= step:
        if probe(h):
            fit = h if fit is None else max(fit, h)
        else:
            fail = h if fail is None else min(fail, h)
        if fit is not None and fail is not None:
            if fail - fit <= step:
                break
            h = (fit + fail) // 2 // step * step
        elif fail is None:  # still fitting: walk up, faster each time
            h, stride = fit + stride, 2 * stride
        else:  # still failing: walk down
            h, stride = fail - stride, 2 * stride
    exact = fit is not None and fail is not None and fail - fit <= args.step
    return {"size": fit, "exact": exact, "predicted": guess, "fail": fail, "attempts": tried}


def print_table(rows: Dict[str, Dict], args, bases: Dict[str, float]) -> None:
    ddp = rows.get("torch DDP", {})
    ddp_params = n_params(ddp["size"], args) if ddp.get("size") else None
    name = "layers" if args.vary == "layers" else "hidden"
    head = (f"{'contender':26s} {'max ' + name:>10s} {'params':>10s} {'vs DDP':>7s} {'peak RSS sum':>12s} "
            f"{'planner RSS':>11s} {'planner ' + name:>14s} {'planner params':>14s} {'planner vs search':>17s}")
    print(head)
    print("-" * len(head))
    for c in CONTENDERS:
        r = rows.get(c.name)
        if r is None:
            continue
        if "unavailable" in r:
            print(f"{c.name:26s} {'not available: ' + r['unavailable']}")
            continue
        h = r["size"]
        params = n_params(h, args) if h else 0
        ratio = f"{params / ddp_params:.2f}x" if ddp_params and h else ""
        peak = r["attempts"][h]["peak_sum"] / 2**30 if h else 0
        planned = predicted_sum(c, h, args, bases[c.name]) / 2**30 if h else 0
        # '>=': the largest tried fit; none fit: below the smallest failure
        found = ("" if r["exact"] else ">=") + str(h) if h else (f"<{r['fail']}" if r["fail"] else "-")
        print(f"{c.name:26s} {found:>10s} {params / 1e6:9.1f}M {ratio:>7s} {peak:8.2f} GiB "
              f"{planned:7.2f} GiB {r['predicted']:14d} {n_params(r['predicted'], args) / 1e6:13.1f}M "
              f"{verdict(r, args):>17s}")
    shape = (f"{args.layers} layers, hidden in steps of {args.step}" if args.vary == "hidden"
             else f"hidden {args.hidden}, layers in steps of {args.step}")
    knobs = f"gradient bucket {args.bucket} elements" + (
        "" if args.prefetch is None else f", stage-3 prefetch {args.prefetch} elements")
    print(f"\nbudget {args.budget / 2**30:.1f} GiB: the {WORLD} gloo ranks' resident peaks, summed; GPT with {shape}, "
          f"vocab {VOCAB}, seq {args.seq}, micro batch 1, fp32 AdamW, {args.steps} steps; {knobs}. '>=': the largest "
          f"size tried fit (search capped); '<N': no size tried fit, N the smallest that failed; 'vs DDP' = "
          f"parameters over DDP's; 'planner RSS': the planner's summed peak at the size found; 'planner vs search': "
          f"'exact' when the planner's largest is the largest that fit, else by how many steps it missed (+: too "
          f"large).")


def verdict(row: Dict, args) -> str:
    """Whether the planner's largest size is the one the search found, or how many steps away it is."""
    if not row["exact"]:
        return "search capped"
    off = (row["predicted"] - row["size"]) // args.step
    return "exact" if off == 0 else f"{off:+d} step" + ("s" if abs(off) > 1 else "")


# ---- what a rank holds beyond the planner's tensors ------------------------------------------------------
def calibrate(contenders, args, log) -> Dict[str, float]:
    """Per contender, the bytes a rank holds beyond the planner's tensors, measured on the smallest model.

    That is the idle process (torch, gloo) plus what training adds beyond its tensors: allocator slack, the
    autograd engine's and gloo's own buffers. For the hybrid stages it is one run of stage 0, which is not being
    judged, so no stage's prediction is fitted to its own measurement. torch's trainers are predicted as the
    hybrid stage holding the same state, so each is measured once on its own (DDP, say, keeps some 70 MiB of
    its own from construction on, whatever the model).
    """
    hybrid_calibration = Contender("hybrid zero-0 (calibration)", "hybrid", 0)
    runs = {c.name: (c if c.kind != "hybrid" else hybrid_calibration) for c in contenders}
    measured: Dict[str, float] = {}
    for probe in {c.name: c for c in runs.values()}.values():
        r = run_attempt(probe, args.step, args)
        if not r["ok"]:
            raise SystemExit(f"the calibration run ({probe.name}, {args.vary} {args.step}) failed: {r['why']}")
        idle = r["base_mib"] * 2**20
        beyond = max(0.0, r["peak_sum"] / WORLD - idle - predicted_rank_bytes(probe, args.step, args))
        measured[probe.name] = idle + beyond
        log(f"calibration, {probe.name}: an idle rank holds {idle / 2**20:.0f} MiB resident, a training one "
            f"{beyond / 2**20:.1f} MiB more than the planner's tensors; both are added per rank")
    return {name: measured[probe.name] for name, probe in runs.items()}


def main(argv=None) -> None:
    from hybrid.plan import parse_size

    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    ap.add_argument("--budget", default="20GiB",
                    help="what the ranks' resident peaks, summed, may reach; several, comma-separated, search at each")
    ap.add_argument("--vary", choices=("hidden", "layers"), default="hidden",
                    help="what the search grows: the hidden size of a --layers model (wide), or the number of "
                         "layers of a --hidden model (deep)")
    ap.add_argument("--layers", type=int, default=2, help="layers (with --vary hidden)")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size, a multiple of 64 (with --vary layers)")
    ap.add_argument("--seq", type=int, default=32,
                    help="sequence length: compute grows with it, memory hardly (32 keeps the largest "
                         "attempts near a minute on 2 cores)")
    ap.add_argument("--step", type=int, default=None,
                    help="granularity of the search: hidden size (a multiple of 64; default 128) or layers "
                         "(default 1)")
    ap.add_argument("--steps", type=int, default=3, help="training steps an attempt must complete")
    ap.add_argument("--bucket", type=int, default=25_000_000, help="gradient bucket, elements (zero.bucket_size)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="stage 3: elements gathered ahead (zero.prefetch_bucket_size; default: the config's)")
    ap.add_argument("--max-attempts", type=int, default=4, help="attempts per contender")
    ap.add_argument("--attempt-timeout", type=float, default=400.0, help="seconds before an attempt is abandoned")
    ap.add_argument("--only", default="", help="comma-separated substrings of contender names")
    ap.add_argument("--predict", default="",
                    help="comma-separated sizes (hidden or layers, see --vary): print the planner's summed RSS for "
                         "each and stop (no search)")
    ap.add_argument("--json", help="also write every attempt, the calibration and the planner's figures here")
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args.rank)
        return
    if args.step is None:
        args.step = 128 if args.vary == "hidden" else 1
    if args.vary == "hidden" and args.step % 64:
        ap.error("--step must be a multiple of 64 (the head dimension) with --vary hidden")
    if args.vary == "layers" and args.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (the head dimension)")
    budgets = [parse_size(b.strip(), "--budget") for b in args.budget.split(",")]
    args.budget = max(budgets)  # the calibration's limit
    chosen = [c for c in CONTENDERS if not args.only or any(s.strip() in c.name for s in args.only.split(","))]
    t0 = time.time()
    log = lambda s: print(f"[{time.time() - t0:6.0f}s] {s}", flush=True)  # noqa: E731
    missing = {c.name: unavailable(c) for c in chosen}  # why a contender cannot run here, or None
    available = [c for c in chosen if not missing[c.name]]
    bases = calibrate(available, args, log)
    runs = []
    for args.budget in budgets:
        if args.predict:
            print(f"budget {args.budget / 2**30:.2f} GiB")
            for c in available:
                sizes = [int(h) for h in args.predict.split(",")]
                figures = ", ".join(f"{h} ({n_params(h, args) / 1e6:.1f}M): "
                                    f"{predicted_sum(c, h, args, bases[c.name]) / 2**30:.2f} GiB" for h in sizes)
                print(f"{c.name:26s} planner: largest {args.vary} {predicted_size(c, args, bases[c.name])}; "
                      f"summed peaks {figures}")
            continue
        rows: Dict[str, Dict] = {}
        for c in chosen:
            if missing[c.name]:
                rows[c.name] = {"unavailable": missing[c.name]}
                log(f"{c.name}: not available ({missing[c.name]})")
                continue
            rows[c.name] = search(c, args, bases[c.name], log)
            rows[c.name]["planner_sum"] = {h: predicted_sum(c, h, args, bases[c.name])
                                           for h in rows[c.name]["attempts"]}
        print()
        print_table(rows, args, bases)
        print()
        runs.append({"budget": args.budget, "rows": rows})
    if len(runs) > 1:
        print("the planner against the search, by budget: " + "; ".join(
            f"{c.name}: " + ", ".join(f"{run['budget'] / 2**30:g} GiB {verdict(run['rows'][c.name], args)}"
                                      for run in runs) for c in available))
    if args.json and runs:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "args": vars(args),
                       "per_rank_beyond_tensors": bases, "budgets": runs}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
