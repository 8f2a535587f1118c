"""hybrid ZeRO-3 against torch DDP and FSDP2 (reshard after forward), with a breakdown of stage 3's step.

The contenders train the same small GPT as ``benchmarks/zero_vs_peers.py``
(its model, batches and parameter groups are imported from there) on 4 gloo
ranks; hybrid runs through ``hybrid.initialize`` with stage 3 and its default
ZeRO settings (``--reuse N``: also with ``zero.max_reuse_distance = N``, which matters above the prefetch
window: the defaults already keep every unit it covers, this whole model). All
contenders live in the same 4 processes and take their steps in turn
(rotating order), so a busy spell of this shared machine hits them alike;
each round starts fresh processes, and gives paired per-step ratios (stage 3
over DDP, over FSDP2), whose medians over rounds the table prints, with the
CPU time of all ranks per step (the steadier measure on shared cores).

The breakdown (on by default) times, per rank, each phase of a step (forward,
backward, optimizer step): wall time, the training thread's CPU time, the
process's CPU time (gloo's threads too) and, for hybrid, the time blocked in
the communicator (``Communicator.blocked_seconds``: gathers and
reduce-scatters that compute did not hide). For stage 3 also the wall time
inside the gather hooks, the gradient hooks, the order check, the end of
backward and the step's wait for the last reduction (blocked or not), and the
elements gathered per step. Medians over ranks and steps, then over rounds.

Reproduce (from the repository root)::

    python benchmarks/zero3_profile.py --steps 8 --with-zero0       # 3 rounds, about 3 minutes on 2 cores
    python benchmarks/zero3_profile.py --rounds 1 --steps 4         # a quick look
    python benchmarks/zero3_profile.py --steps 8 --stage3-bucket 1500000   # stage 3 in buckets
    flock /work/bench.lock python benchmarks/zero3_profile.py --compile --steps 8   # compiled blocks vs eager
    flock /work/bench.lock python benchmarks/zero3_profile.py --compile --steps 8 --prefetch-bucket 500000

``--compile`` runs stage 3 twice instead of against the peers: eager, and with every transformer block compiled
(``model_zoo.compile.compile_blocks``, inductor; the warm-up steps hold the compile), and prints compiled over
eager: the step, the time blocked in the gather hooks (the gathers compute did not hide), and the gathers'
unhidden time (:func:`_unhidden_gather_seconds`: the units one step gathered, gathered again one at a time and
waited for), with the gatherer's own prefetch counts per step.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.zero_vs_peers import PlainGPT, batch, gpt_config, param_groups  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from hybrid.compile_marks import eager  # noqa: E402
from tests.multiproc import run_distributed  # noqa: E402

WORLD = 4
CONTENDERS = ("torch DDP", "torch FSDP2 (reshard)", "hybrid zero-3")
REUSE = "hybrid zero-3 reuse"  # with --reuse: zero.max_reuse_distance set
COMPILED = "hybrid zero-3 compiled"  # with --compile: every transformer block through torch.compile
# The GPT, batch and optimizer of benchmarks/zero_vs_peers.py's default run (the names its helpers read).
MODEL = dict(hidden=256, layers=4, heads=8, vocab=8192, seq=128, global_batch=16, lr=1e-3, wd=0.1)


class _Timers:
    """Wall time spent inside wrapped methods, split into blocked-in-the-communicator and the rest (Python, copies).

    Kinds nest: the order check's time is also inside the gather hooks that call it."""

    def __init__(self, comm):
        self.comm = comm
        self.seconds: Dict[str, float] = collections.defaultdict(float)
        self.calls: Dict[str, int] = collections.defaultdict(int)
        self._active = set()

    def wrap(self, obj, method: str, key: str) -> None:
        inner = getattr(obj, method)

        @eager  # inside a compiled block: one graph break, as the wrapped hook is (model_zoo.compile)
        def timed(*a, **k):
            if key in self._active:  # nested in a call of the same kind: the outer call counts it
                return inner(*a, **k)
            self._active.add(key)
            t0, b0 = time.perf_counter(), self.comm.blocked_seconds()
            try:
                return inner(*a, **k)
            finally:
                self._active.discard(key)
                blocked = self.comm.blocked_seconds() - b0
                self.seconds[key + " blocked"] += blocked
                self.seconds[key + " other"] += time.perf_counter() - t0 - blocked
                self.calls[key + " calls"] += 1

        setattr(obj, method, timed)

    def take(self) -> Dict[str, float]:
        out = dict(self.seconds)
        out.update({k: float(v) for k, v in self.calls.items()})
        self.seconds.clear()
        self.calls.clear()
        return out


class _Phases:
    """Per phase of a step: wall seconds, this thread's CPU seconds, the process's CPU seconds (gloo's threads too)."""

    def __init__(self):
        self.values: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, comm=None):
        t0, th0, c0 = time.perf_counter(), time.thread_time(), time.process_time()
        b0 = comm.blocked_seconds() if comm is not None else 0.0
        yield
        self.values[name + " wall"] = time.perf_counter() - t0
        self.values[name + " thread CPU"] = time.thread_time() - th0
        self.values[name + " process CPU"] = time.process_time() - c0
        if comm is not None:
            self.values[name + " blocked"] = comm.blocked_seconds() - b0


def _build_hybrid(args, stage: int, breakdown: bool, reuse: int = 0, compiled: bool = False):
    import hybrid
    from hybrid import Topology
    from model_zoo import GPTModel

    topo = Topology()
    model = GPTModel(gpt_config(args), topo)
    model.check_inputs = False
    micro = args.global_batch // WORLD
    zero = {"stage": stage, "max_reuse_distance": reuse} if stage == 3 else {"stage": stage}
    if stage == 3 and args.stage3_bucket:
        zero["bucket_size"] = args.stage3_bucket
    if stage == 3 and args.prefetch_bucket is not None:
        zero["prefetch_bucket_size"] = args.prefetch_bucket
    engine = hybrid.initialize(model, {"zero": zero, "micro_batch_size": micro,
                                       "global_batch_size": args.global_batch,
                                       "optimizer": {"lr": args.lr, "weight_decay": args.wd}},
                               topology=topo, no_weight_decay=lambda n, p: p.ndim < 2)
    if compiled:
        from model_zoo.compile import compile_blocks

        compile_blocks(model)
    opt, comm = engine.optimizer, topo.comm
    timers = _Timers(comm)
    issued: List[int] = []  # the units stage 3 gathered in the last step, in order
    if stage == 3:
        gather = opt.gatherer._issue

        def issue(indices, why, checked=True):
            issued.extend(indices)
            return gather(indices, why, checked)

        opt.gatherer._issue = issue
    if breakdown and stage == 3:
        g, r = opt.gatherer, opt.reducer
        timers.wrap(opt.order, "verify", "order check")
        timers.wrap(g, "_complete", "gather wait")  # every wait for a gather to land, wherever it is called
        for name in ("module_pre", "module_post", "use_external", "_unpack", "_pack"):
            timers.wrap(g, name, "gather hooks")
        r.remove_hooks()  # the autograd hooks hold bound methods: wrap first, then attach again
        for name in ("_on_grad", "_before_accumulate"):
            timers.wrap(r, name, "grad hooks")
        r.attach_hooks()
        timers.wrap(r, "end_backward", "end of backward")
        timers.wrap(r, "wait", "grad wait in step")
    phase = _Phases()

    def step(x, y):
        g = getattr(opt, "gatherer", None)
        g0 = g and (g.gathered_numel_total, g.prefetch_issued, g.prefetch_hits)
        issued.clear()
        with phase("forward", comm):
            loss = engine(x, y)
        with phase("backward", comm):
            engine.backward(loss)
        with phase("step", comm):
            engine.step()
        if stage == 3:
            phase.values["gathered elements"] = g.gathered_numel_total - g0[0]
            phase.values["prefetched units"] = g.prefetch_issued - g0[1]
            phase.values["prefetch hits"] = g.prefetch_hits - g0[2]
        return loss

    def stats():
        out = dict(phase.values)
        out.update(timers.take())
        return out

    def unhidden():
        return _unhidden_gather_seconds(opt.gatherer, list(issued)) if stage == 3 else {}

    return step, topo.dp_rank, stats, unhidden


def _unhidden_gather_seconds(g, units: List[int], repeats: int = 3) -> Dict[str, float]:
    """``{"unhidden gather": s}``: the median over ``repeats`` of the wall time this rank takes to all-gather (over
    ``dp``, in the gatherer's format) ``units`` (one step's gathers) one after another, waiting for each: what the
    step's gathers cost when nothing overlaps them. Collective: every DP rank passes the same units (the order
    check held them equal)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in units:
            buf = torch.empty(g.units[i].numel, dtype=g.chunks[i].dtype, device=g.chunks[i].device)
            g.comm.all_gather_into_tensor(buf, g.chunks[i], "dp", quant=g.quant)
        times.append(time.perf_counter() - t0)
    return {"unhidden gather": statistics.median(times)}


def _build_torch(kind: str, args):
    import torch.distributed as dist

    model = PlainGPT.from_zoo(gpt_config(args))
    if kind == "torch DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=args.bucket * 4 / 2**20)
        opt = torch.optim.AdamW(param_groups(model.module.named_parameters(), args.wd), lr=args.lr, fused=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = torch.optim.AdamW(param_groups(model.named_parameters(), args.wd), lr=args.lr, fused=True)
    phase = _Phases()

    def step(x, y):
        with phase("forward"):
            loss = model(x, y)
        with phase("backward"):
            loss.backward()
        with phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    return step, dist.get_rank(), lambda: dict(phase.values), dict


def child(args) -> Dict:
    """Every contender on this rank, their steps interleaved in rotating order (a busy spell hits all alike).

    Returns per contender the wall and CPU seconds of each measured step
    (CPU: every thread of this process, gloo's included), its losses,
    each step's breakdown and, for stage 3, the unhidden time of the last
    step's gathers (added to every step's breakdown).
    """
    built = {}
    for kind in args.contenders:
        torch.manual_seed(0)
        if kind == REUSE:
            built[kind] = _build_hybrid(args, 3, args.breakdown, args.reuse)
        elif kind == COMPILED:
            built[kind] = _build_hybrid(args, 3, args.breakdown, compiled=True)
        elif kind.startswith("hybrid"):
            built[kind] = _build_hybrid(args, int(kind[-1]), args.breakdown)
        else:
            built[kind] = _build_torch(kind, args)
    micro = args.global_batch // WORLD
    out = {kind: {"times": [], "cpu": [], "losses": [], "stats": []} for kind in args.contenders}
    n = len(args.contenders)
    for s in range(args.warmup + args.steps):
        x, y = batch(s, args)
        for kind in args.contenders[s % n:] + args.contenders[:s % n]:
            step, dp_rank, stats, _ = built[kind]
            xs, ys = x[dp_rank * micro:(dp_rank + 1) * micro], y[dp_rank * micro:(dp_rank + 1) * micro]
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(xs, ys)
            rec = out[kind]
            if s >= args.warmup:
                rec["times"].append(time.perf_counter() - t0)
                rec["cpu"].append(time.process_time() - c0)
                rec["stats"].append(stats())
            else:
                stats()
            rec["losses"].append(float(loss.detach()))
    for kind in args.contenders:  # in the same order on every rank: the replayed gathers are collectives
        unhidden = built[kind][3]()
        for s in out[kind]["stats"]:
            s.update(unhidden)
    return out


def _per_step(per_rank: List[Dict], kind: str, key: str, combine) -> List[float]:
    """``combine`` over ranks of each measured step's ``key`` (max of wall times: a step ends when every rank is
    done; sum of CPU times)."""
    steps = len(per_rank[0][kind][key])
    return [combine(r[kind][key][i] for r in per_rank) for i in range(steps)]


def _breakdown(per_rank: List[Dict], kind: str) -> Dict[str, float]:
    stats = [s for r in per_rank for s in r[kind]["stats"]]
    keys = {k for s in stats for k in s}
    return {k: statistics.median(s.get(k, 0.0) for s in stats) for k in keys}


COUNTS = ("calls", "elements", "units", "hits")  # breakdown rows that count rather than time


def _compiled_over_eager(wall: Dict[str, List[float]], breakdowns: Dict[str, List[Dict[str, float]]]) -> None:
    """The --compile table: per step, eager and compiled stage 3 (median over rounds, min-max over rounds) and the
    ratio of the medians: the step, the time blocked waiting for gathers to land (the exposed gathers; the gather
    hooks' blocked time also holds the order check's all-reduces, which wait for the slowest rank), in the
    communicator at all (the reduce-scatters' waits and the order checks too), the gathers' unhidden time, the
    exposed share (blocked waiting for gathers over unhidden), and the gatherer's prefetch counts."""
    def per_round(kind: str) -> Dict[str, List[float]]:
        rows = {"step": wall[kind]}
        b = breakdowns[kind]
        rows["blocked in gather waits"] = [r["gather wait blocked"] for r in b]
        rows["blocked, all"] = [r["forward blocked"] + r["backward blocked"] + r["step blocked"] for r in b]
        rows["unhidden gather"] = [r["unhidden gather"] for r in b]
        rows["exposed share"] = [r["gather wait blocked"] / r["unhidden gather"] for r in b]
        rows["prefetched units"] = [r["prefetched units"] for r in b]
        rows["prefetch hits"] = [r["prefetch hits"] for r in b]
        return rows

    def cell(vals: List[float], key: str) -> str:
        scale, unit = (1.0, "") if key.endswith(COUNTS + ("share",)) else (1e3, "ms")
        lo, mid, hi = (scale * v for v in (min(vals), statistics.median(vals), max(vals)))
        return f"{mid:9.2f}{unit:2s} ({lo:.2f}-{hi:.2f})"

    eager, compiled = per_round("hybrid zero-3"), per_round(COMPILED)
    print("\nstage 3 compiled over eager, per rank and step (median over rounds, min-max over rounds):")
    print(f"  {'':24s}{'eager':>28s}{'compiled':>28s}{'median ratio':>16s}")
    for key in eager:
        ratio = statistics.median(compiled[key]) / max(statistics.median(eager[key]), 1e-12)
        print(f"  {key:24s}{cell(eager[key], key):>28s}{cell(compiled[key], key):>28s}{ratio:15.2f}x")


def main(argv=None) -> None:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=25_000_000, help="DDP gradient bucket, elements (hybrid's default)")
    ap.add_argument("--stage3-bucket", type=int, default=0,
                    help="hybrid stage 3's zero.bucket_size, elements (0: the default; DDP keeps --bucket)")
    ap.add_argument("--prefetch-bucket", type=int, default=None,
                    help="hybrid stage 3's zero.prefetch_bucket_size, elements (unset: the default, which holds this "
                         "whole model: every gather starts at the end of the step before; smaller: the gathers "
                         "are issued from the module hooks, inside forward and backward)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each in fresh processes; the table shows medians")
    ap.add_argument("--reuse", type=int, default=0,
                    help="also run stage 3 with zero.max_reuse_distance set to this many elements")
    ap.add_argument("--with-zero0", action="store_true",
                    help="also run hybrid stage 0 (the same model code as stage 3, DDP's algorithm)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="time stage 3 without the hook timers")
    ap.add_argument("--compile", action="store_true",
                    help="stage 3 eager against stage 3 with its transformer blocks compiled, without the peers")
    args = ap.parse_args(argv)
    for key, value in MODEL.items():
        setattr(args, key, value)
    first = ("hybrid zero-3", COMPILED) if args.compile else CONTENDERS
    args.contenders = first + ((REUSE,) if args.reuse else ()) + (("hybrid zero-0",) if args.with_zero0 else ())
    ours = [k for k in args.contenders if k.startswith("hybrid zero-3")]
    peers = [k for k in CONTENDERS[:2] if k in args.contenders]
    pairs = [(z3, peer) for z3 in ours for peer in peers] + ([(COMPILED, "hybrid zero-3")] if args.compile else [])
    wall: Dict[str, List[float]] = collections.defaultdict(list)
    cpu: Dict[str, List[float]] = collections.defaultdict(list)
    ratios: Dict[tuple, List[float]] = collections.defaultdict(list)
    cpu_ratios: Dict[tuple, List[float]] = collections.defaultdict(list)
    breakdowns: Dict[str, List[Dict[str, float]]] = collections.defaultdict(list)
    loss_gap = 0.0
    for round_ in range(args.rounds):
        per_rank = run_distributed(child, WORLD, args, timeout=900, start="spawn")
        steps = {k: _per_step(per_rank, k, "times", max) for k in args.contenders}
        cpus = {k: _per_step(per_rank, k, "cpu", sum) for k in args.contenders}
        for k in args.contenders:
            wall[k].append(statistics.median(steps[k]))
            cpu[k].append(statistics.median(cpus[k]))
            breakdowns[k].append(_breakdown(per_rank, k))
        for z3, peer in pairs:  # paired: the same step, back to back
            ratios[z3, peer].append(statistics.median(a / b for a, b in zip(steps[z3], steps[peer])))
            cpu_ratios[z3, peer].append(statistics.median(a / b for a, b in zip(cpus[z3], cpus[peer])))
        mean_loss = {k: [statistics.mean(r[k]["losses"][i] for r in per_rank)
                         for i in range(len(per_rank[0][k]["losses"]))] for k in args.contenders}
        loss_gap = max([loss_gap] + [abs(a - b) for k in args.contenders[1:]
                                     for a, b in zip(mean_loss[k], mean_loss[args.contenders[0]])])
        print(f"[round {round_ + 1}] " + ", ".join(f"{k}: {1e3 * wall[k][-1]:.1f} ms" for k in args.contenders),
              flush=True)
    print(f"\nworld {WORLD} (gloo, {os.cpu_count()} CPU cores), GPT h={args.hidden} L={args.layers} seq={args.seq} "
          f"vocab={args.vocab}, global batch {args.global_batch}, fp32 AdamW, {args.steps} measured steps after "
          f"{args.warmup} warm-up, steps interleaved, {args.rounds} rounds; medians over rounds\n")
    print(f"{'contender':24s} {'median step':>12s} {'CPU/step':>9s}   per round (ms)")
    for k in args.contenders:
        rounds = " ".join(f"{1e3 * t:.0f}" for t in wall[k])
        print(f"{k:24s} {1e3 * statistics.median(wall[k]):10.1f}ms {statistics.median(cpu[k]):8.2f}s   {rounds}")
    for z3, peer in pairs:
        rs = " ".join(f"{r:.2f}" for r in ratios[z3, peer])
        print(f"{z3:19s} / {peer:22s} step {statistics.median(ratios[z3, peer]):.2f}x (rounds: {rs}), "
              f"CPU {statistics.median(cpu_ratios[z3, peer]):.2f}x")
    print(f"largest gap between the contenders' mean losses: {loss_gap:.2e}")
    if args.compile and args.breakdown:
        _compiled_over_eager(wall, breakdowns)
    if args.breakdown:
        print("\nbreakdown per rank and step (median over ranks and steps, then over rounds). thread CPU: the "
              "training thread's; process CPU: every thread (gloo's too); blocked: waiting in the communicator; "
              "hook rows: wall time inside them, blocked or not (the order check runs inside the gather hooks):")
        print(f"  {'':30s}" + "".join(f"{k[:16]:>17s}" for k in args.contenders))
        keys = sorted({key for k in args.contenders for b in breakdowns[k] for key in b})
        for key in keys:
            cells = []
            for k in args.contenders:
                vals = [b[key] for b in breakdowns[k] if key in b]
                if not vals:
                    cells.append(f"{'':>17s}")
                    continue
                v = statistics.median(vals)
                cells.append(f"{v:17.0f}" if key.endswith(COUNTS) else f"{1e3 * v:15.1f}ms")
            print(f"  {key:30s}" + "".join(cells))


if __name__ == "__main__":
    main()
