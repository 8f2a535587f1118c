"""hybrid's layouts against Megatron-style layouts on 2 emulated nodes joined by a slow link.

Every contender trains the same GPT with ``python -m hybrid.train`` (mock data, fp32, AdamW) on
an emulated cluster of 2 nodes x 2 ranks (``tools/emulated_cluster.py``: one network namespace
per node, the nodes joined by a veth pair shaped with ``tc tbf``). Ranks on one node talk over
the node's own loopback, unshaped; ranks on different nodes cross the shaped link. Only the link
is emulated: both "nodes" share this machine's CPUs and memory.

Contenders (world 4, dp = 4 / tp; micro-steps per step = global batch / (micro batch x dp)):

====================  =====  ====  =====  ====================================================
name                   tp     dp   ZeRO   notes
====================  =====  ====  =====  ====================================================
megatron-tp4            4      1    0     TP group spans both nodes (``--allow-tp-across-nodes``)
megatron-tp2-dp2        2      2    0     TP inside a node, DP all-reduce across the link
hybrid-tp2-z1           2      2    1     reduce-scatter + all-gather across the link
hybrid-tp2-z2           2      2    2     ``--zero-reduce-once``: one reduction per step
hybrid-tp2-z2-micro     2      2    2     stage 2's default: a reduce-scatter every micro-step
dp4-z2                  1      4    2
dp4-z3                  1      4    3
====================  =====  ====  =====  ====================================================

Megatron's pipeline layouts (with ``--pipelines``, or named by ``--only``): pp = 2, one stage per node, so
the pipeline crosses the link and TP stays inside each node (dp = 4 / (tp x pp) = 1):

====================  =====  ====  =====  ====================================================
name                   tp     pp   ZeRO   notes
====================  =====  ====  =====  ====================================================
megatron-tp2-pp2        2      2    0     1F1B, sequence parallel, micro batch 2 (8 per step)
megatron-tp2-pp2-v2     2      2    0     the same, interleaved: two chunks of one layer per rank
====================  =====  ====  =====  ====================================================

Peers (with ``--peers``, or named by ``--only``): each trains the same GPT at its own defaults through
``benchmarks/peer_train.py`` under the same torchrun on the same cluster (DeepSpeed with ``DS_ACCELERATOR=cpu``):

====================  =====  ====  =====  ====================================================
name                   tp     dp   ZeRO   notes
====================  =====  ====  =====  ====================================================
deepspeed-dp4-z2        1      4    2     DeepSpeed ZeRO-2 (its 5e8-element buckets, no overlap on CPU)
deepspeed-dp4-z2-mat    1      4    2     DeepSpeed ZeRO-2 with hybrid's bucket size and ``overlap_comm``
deepspeed-dp4-z3        1      4    3     DeepSpeed ZeRO-3
deepspeed-dp4-z3-mat    1      4    3     DeepSpeed ZeRO-3 with hybrid's bucket, prefetch and persistence sizes
fsdp2-dp4               1      4    3     torch FSDP2, ``reshard_after_forward=True`` (its default)
fsdp2-dp4-noreshard     1      4    2     torch FSDP2, ``reshard_after_forward=False``
====================  =====  ====  =====  ====================================================

Peers count no communication of their own, so their ``exposed comm ms``, ``compute ms`` and
``MB/step comm`` are ``n/a``; the link's bytes (``MB/step iface``) are measured as for hybrid.

Sweep: for each bandwidth point (``--rates``, default ``none,1gbit,200mbit,50mbit``; ``none`` is
the unshaped veth) the cluster is brought up once with that rate, then every contender runs
``--repeat`` times, interleaved (round 1: every contender, round 2: every contender, ...), each
run ``--iters`` optimizer steps. Latency points (``--delays``) need ``tc netem``; where the kernel
lacks it (these machines) one line says they were skipped and why.

What each figure means:

* ``ms/iter``: rank 0's iteration time, median over the iterations after the first of one run
  (the trainer's ``run profile`` line when it prints one, else the per-iteration log lines), then
  the median over the repeats.
* ``tokens/s`` = global batch x sequence length / that median; ``vs tp4`` = tokens/s over
  megatron-tp4's at the same point (above 1: faster than megatron-tp4).
* ``exposed comm ms``: time the ranks spent blocked in communication per iteration (median over
  iterations, mean over ranks), from the trainer's ``run profile`` line; ``compute ms`` =
  ms/iter - exposed comm ms. Both are ``n/a`` when the trainer does not print that line.
* ``MB/step iface``: bytes both nodes' veths sent (``tx_bytes`` of node 0 + node 1) per step, in
  units of 10^6 bytes. Measured, by default (``--bytes-method diff``), as
  ``(B(N) - B(1)) / (N - 1)``, where ``B(N)`` is the median over the repeats of the bytes of an
  N-iteration run and ``B(1)`` those of one extra 1-iteration run per contender and point: the
  difference removes what every run sends once (rendezvous, the weight broadcast at start-up, the
  final traffic report). ``--bytes-method total`` uses ``B(N) / N`` instead (start-up included),
  and is what ``--iters 1`` falls back to. A contender with a ``warmup`` (1-bit Adam's AdamW steps)
  runs that many steps more in every run, baseline included, so the difference is of measured steps
  only; its timing leaves them out too (the trainer's profile does, from ``--optimizer-freeze-step``).
  A run that skips a step for non-finite gradients (one that diverged) counts as failed.
* ``MB/step comm``: the same, from the communicator's own count (the trainer's last line
  ``inter-node traffic (bytes sent off each node): node 0 X, node 1 Y``, summed over the nodes).
* ``peak RSS``: the largest peak resident set size of any rank, MiB (the ``run profile``'s
  ``peak_rss_mib``; without it, rank 0's ``peak rss`` from its last iteration line, marked ``r0``).
* ``FLOP/B``: the workload's model FLOPs per inter-node byte,
  ``flops_per_token(model) x global batch x seq / (MB/step iface x 10^6)``, with
  ``model_zoo.flops.flops_per_token`` (6 x matmul weights + 12 L s h per token, forward and
  backward). Both the FLOPs and the bytes are the whole cluster's, so it equals one node's FLOPs
  over the bytes one node sends (the two nodes are symmetric).

Where communication matches compute: a cluster whose node computes at ``F`` FLOP/s and sends
``W`` bytes/s over its inter-node link needs ``F / W`` FLOP of work per byte sent for the link to
keep up with compute. Below that a step is bound by the link (unless communication hides behind
compute); above it, by compute. The two reference clusters:

* V100 node on 40 Gbit/s Ethernet: ``8 x 125e12 x 0.35 / (40e9 / 8) = 70,000 FLOP/B``
  (8 GPUs at 125 TFLOP/s fp16 peak, an assumed 35% MFU);
* H100 node on 400 Gbit/s InfiniBand: ``8 x 989e12 x 0.40 / (400e9 / 8) = 63,296 FLOP/B``
  (8 GPUs at 989 TFLOP/s, an assumed 40% MFU);
* this emulation at rate ``R`` bit/s: ``(F_machine / nodes) / (R / 8)``, where ``F_machine`` is
  the median over the contenders at the unshaped point of ``step model FLOPs / compute s`` (ms/iter
  where no exposed-communication figure exists, which understates ``F_machine``). Where ranks
  outnumber cores, time blocked in communication includes waiting for peers that share the cores,
  so compute s is understated and ``F_machine`` overstated: read it as a scale, not a peak. Not
  available when the sweep has no ``none`` point.

A workload's FLOP/B above a cluster's figure means that, with perfect overlap, the link is not
the bottleneck there.

Reproduce (from the repository root, as root; the defaults make 4 points x 6 contenders x (3 timed + 1
bytes-baseline) runs)::

    python benchmarks/slow_link.py                                   # the full sweep, 3 repeats
    python benchmarks/slow_link.py --markdown                        # + the tables as Markdown
    python benchmarks/slow_link.py --peers --rates 200mbit,50mbit --delays '' --markdown \\
        --only dp4-z2,dp4-z3,hybrid-tp2-z2,deepspeed-dp4-z2,deepspeed-dp4-z2-mat,deepspeed-dp4-z3,\\
deepspeed-dp4-z3-mat,fsdp2-dp4,fsdp2-dp4-noreshard --json benchmarks/results/slow_link_peers.json
                                                                     # hybrid beside DeepSpeed and FSDP2
    python benchmarks/slow_link.py --rates 200mbit,50mbit --delays '' --repeat 5 --markdown \\
        --only hybrid-tp2-z1,hybrid-tp2-z1-opg,hybrid-tp2-z2,hybrid-tp2-z2-opg \\
        --json benchmarks/results/slow_link_overlap.json               # the weights' all-gather overlapped
    python benchmarks/slow_link.py --rates none,200mbit --repeat 1 --iters 3 --hidden 64 --layers 2 \\
        --only megatron-tp4,hybrid-tp2-z1 --json /tmp/sl.json         # a quick look
    python benchmarks/slow_link.py --pipelines --rates none,200mbit,50mbit --delays '' --markdown \\
        --only megatron-tp4,megatron-tp2-pp2,megatron-tp2-pp2-v2,hybrid-tp2-z1,hybrid-tp2-z2 \\
        --json benchmarks/results/slow_link_pipeline.json             # beside Megatron's pipelines

Writes every figure, and each run's raw ones, to ``--json`` (default
``benchmarks/results/slow_link.json``). Exits non-zero when any run failed (shown as FAILED with
its reason in the table); skips with one line (exit 0) where namespaces cannot be made.
See docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hybrid.argument_parser import ArgumentParser  # noqa: E402

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
BASELINE = "megatron-tp4"  # the ratio column's reference
HEADLINE = ("hybrid-tp2-z1", "hybrid-tp2-z2")

# The two real clusters the workload's FLOP per byte is set beside: (label, GPUs per node, peak FLOP/s per GPU,
# assumed MFU, inter-node link bit/s per node).
REFERENCE_CLUSTERS = (
    ("V100 node, 40 Gbit/s Ethernet", 8, 125e12, 0.35, 40e9),
    ("H100 node, 400 Gbit/s InfiniBand", 8, 989e12, 0.40, 400e9),
)


@dataclasses.dataclass(frozen=True)
class Contender:
    """One layout: ``dp`` is derived as ``world / (tp x pp)``."""

    name: str
    tp: int
    zero_stage: int
    micro_batch: int
    extra: Tuple[str, ...] = ()
    compressed: bool = False  # optional: runs only with --compressed (or when named by --only)
    # steps run before the measured ones besides the first (1-bit Adam's AdamW warm-up): every run is that much
    # longer, its timing and the bytes baseline leave them out
    warmup: int = 0
    # a peer's trainer (benchmarks/peer_train.py --peer NAME) instead of hybrid.train; runs only with --peers
    peer: Optional[str] = None
    # pipeline stages (outermost: with tp 2, one stage per node, so only the stages' activations and their
    # gradients cross the link); above 1 it runs only with --pipelines
    pp: int = 1

    @property
    def dp(self) -> int:
        return WORLD // (self.tp * self.pp)

    @property
    def zero_reduce_once(self) -> bool:
        return "--zero-reduce-once" in self.extra


CONTENDERS = [
    Contender("megatron-tp4", 4, 0, 4, ("--allow-tp-across-nodes",)),
    Contender("megatron-tp2-dp2", 2, 0, 4),
    Contender("hybrid-tp2-z1", 2, 1, 4),
    Contender("hybrid-tp2-z2", 2, 2, 4, ("--zero-reduce-once",)),
    # stage 2 as it runs by default: a reduce-scatter on every micro-step (2 here), for 1/dp of the gradient memory
    Contender("hybrid-tp2-z2-micro", 2, 2, 4),
    Contender("dp4-z2", 1, 2, 4),
    Contender("dp4-z3", 1, 3, 4),
    # compressed communication (zero.quantized_gradients / zero.quantized_weights), beside hybrid-tp2-z2
    Contender("hybrid-tp2-z2-qg8", 2, 2, 4, ("--zero-reduce-once", "--zero-quantized-gradients", "int8"), True),
    Contender("hybrid-tp2-z2-qg4", 2, 2, 4, ("--zero-reduce-once", "--zero-quantized-gradients", "int4"), True),
    Contender("hybrid-tp2-z2-qw8", 2, 2, 4, ("--zero-reduce-once", "--zero-quantized-weights", "int8"), True),
    Contender("hybrid-tp2-z2-q", 2, 2, 4, ("--zero-reduce-once", "--zero-quantized-gradients", "int4",
                                          "--zero-quantized-weights", "int8"), True),
    Contender("dp4-z3-q", 1, 3, 4, ("--zero-quantized-gradients", "int4", "--zero-quantized-weights", "int8"), True),
    # zero.overlap_param_gather: the step leaves the updated weights' all-gather in flight and the next forward
    # waits for each bucket before its first module
    Contender("hybrid-tp2-z1-opg", 2, 1, 4, ("--overlap-param-gather",), True),
    Contender("hybrid-tp2-z2-opg", 2, 2, 4, ("--zero-reduce-once", "--overlap-param-gather"), True),
    # two ranks of each dp group per node: reduce inside the node first, then across on half the bytes
    Contender("dp4-z2-2l", 1, 2, 4, ("--zero-two-level-reduce",), True),
    Contender("dp4-z2-q2l", 1, 2, 4, ("--zero-two-level-reduce", "--zero-quantized-gradients", "int4",
                                      "--zero-quantized-weights", "int8"), True),
    # hpZ: stage 3 keeps a secondary weight shard over the node's 2 dp ranks; backward re-gathers inside the node
    Contender("dp4-z3-hpz", 1, 3, 4, ("--zero-hpz-partition-size", "2"), True),
    Contender("dp4-z3-q-hpz", 1, 3, 4, ("--zero-quantized-gradients", "int4", "--zero-quantized-weights", "int8",
                                        "--zero-hpz-partition-size", "2"), True),
    # a prefetch window smaller than this model (3.1M gathered elements): forward keeps only the last window's
    # worth into backward, which gathers the rest again (across nodes, or with hpZ inside the node), as for a
    # model larger than the default window
    Contender("dp4-z3-w500k", 1, 3, 4, ("--zero-prefetch-bucket-size", "500000"), True),
    Contender("dp4-z3-hpz-w500k", 1, 3, 4, ("--zero-prefetch-bucket-size", "500000", "--zero-hpz-partition-size", "2"),
              True),
    # 1-bit Adam: the momentum crosses as signs (beside megatron-tp2-dp2, the same stage 0), measured after 8
    # AdamW steps (fewer leave a variance too noisy to freeze: with 1 the loss diverges by the 4th step)
    Contender("hybrid-tp2-z0-1bit", 2, 0, 4, ("--optimizer", "onebit_adam", "--optimizer-freeze-step", "8"), True,
              warmup=7),
    # Megatron's answer to a slow link: TP inside the node, the pipeline across it. Sequence parallelism sends
    # each TP rank's [s/t, b, h] share of the activation, the bytes of Megatron's scatter-gather optimisation;
    # micro batch 2: 8 micro-batches a step, a 1F1B bubble of 1/9 (interleaved, 2 chunks of 1 layer: 1/17)
    Contender("megatron-tp2-pp2", 2, 0, 2, ("--sequence-parallel",), pp=2),
    Contender("megatron-tp2-pp2-v2", 2, 0, 2, ("--sequence-parallel", "--pipeline-schedule", "interleaved",
                                               "--num-layers-per-virtual-pipeline-stage", "1"), pp=2),
    # peers at their own defaults (benchmarks/peer_train.py)
    Contender("deepspeed-dp4-z2", 1, 2, 4, peer="deepspeed-z2"),
    Contender("deepspeed-dp4-z3", 1, 3, 4, peer="deepspeed-z3"),
    Contender("deepspeed-dp4-z2-mat", 1, 2, 4, peer="deepspeed-z2-matched"),
    Contender("deepspeed-dp4-z3-mat", 1, 3, 4, peer="deepspeed-z3-matched"),
    Contender("fsdp2-dp4", 1, 3, 4, peer="fsdp2"),
    Contender("fsdp2-dp4-noreshard", 1, 2, 4, peer="fsdp2-noreshard"),
]


# ---- rates ---------------------------------------------------------------------------------------
_RATE_UNITS = {"bit": 1 / 8, "bps": 1.0}  # tc: "bit" is bits per second, "bps" bytes per second
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}  # tc's SI prefixes


def link_bytes_per_s(rate: Optional[str]) -> Optional[float]:
    """Bytes per second of a tc rate such as ``200mbit`` (None for an unshaped link)."""
    if rate is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate)
    if m is None:
        raise ValueError(f"rate {rate!r}: give a tc rate such as 200mbit or 1gbit")
    return float(m.group(1)) * _PREFIX[m.group(2)] * _RATE_UNITS[m.group(3)]


# ---- one run's output ----------------------------------------------------------------------------
_ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?iteration time: ([\d.]+) ms(?:.*?peak rss ([\d.]+) GiB)?")
_SKIPPED_RE = re.compile(r"iteration\s+\d+/\s*\d+ \|.*?\| skipped: (\d+) \|")
_TRAFFIC_RE = re.compile(r"inter-node traffic \(bytes sent off each node\): (.*)")
_PROFILE_RE = re.compile(r"run profile: (\{.*\})")


def parse_iterations(output: str) -> List[Tuple[int, float, Optional[float]]]:
    """(iteration, iteration time in ms, rank 0's peak RSS in MiB or None) of every per-iteration line."""
    out = []
    for m in _ITER_RE.finditer(output):
        rss = float(m.group(3)) * 1024 if m.group(3) else None
        out.append((int(m.group(1)), float(m.group(2)), rss))
    return out


def skipped_steps(output: str) -> int:
    """Steps the run skipped for non-finite gradients, summed over its iteration lines."""
    return sum(int(m.group(1)) for m in _SKIPPED_RE.finditer(output))


def parse_traffic(output: str) -> Optional[List[int]]:
    """The communicator's count of the bytes each node sent off-node, node by node (None when absent)."""
    m = None
    for m in _TRAFFIC_RE.finditer(output):
        pass
    if m is None:
        return None
    by_node = {int(k): int(b) for k, b in re.findall(r"node (\d+) (\d+)", m.group(1))}
    return [by_node[k] for k in sorted(by_node)]


def parse_profile(output: str) -> Optional[dict]:
    """The trainer's ``run profile: {JSON}`` line, when it printed one (the last, if several)."""
    found = None
    for m in _PROFILE_RE.finditer(output):
        try:
            found = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
    return found


_BOILERPLATE = ("torch.distributed.elastic", "ChildFailedError", "Traceback (most recent call last)",
                "Root Cause", "Failures:", "<NO_OTHER_FAILURES>", "To enable traceback", "error_file",
                "traceback :", "=====", "-----")


def failure_reason(result) -> str:
    """One line: which node failed how, and the first line of its output that names an error."""
    bad = [n for n in result.nodes if n.returncode != 0]
    how = "; ".join(f"node {n.node.index} {n.killed or f'exit {n.returncode}'}" for n in bad)
    for n in bad + [n for n in result.nodes if n not in bad]:
        for line in n.output.splitlines():
            text = line.strip()
            if not text or any(b in text for b in _BOILERPLATE):
                continue
            if re.search(r"error|refused|unrecognized|failed|timed out|not complete", text, re.IGNORECASE):
                return f"{how}: {text[:240]}"
    return how or "no iteration lines in node 0's output"


# ---- running -------------------------------------------------------------------------------------
def train_argv(c: Contender, args, iters: int) -> List[str]:
    if c.peer is not None:
        return [str(REPO / "benchmarks" / "peer_train.py"), "--peer", c.peer, *model_flags(args),
                "--micro-batch-size", str(args.micro_batch or c.micro_batch),
                "--global-batch-size", str(args.global_batch), "--train-iters", str(iters), "--lr", str(args.lr),
                *(["--zero-bucket-size", str(args.bucket_size)] if args.bucket_size else [])]
    return ["-m", "hybrid.train", *model_flags(args),
            "--mock-data", "--precision", "fp32", "--optimizer", "adamw", "--lr", str(args.lr),
            "--micro-batch-size", str(args.micro_batch or c.micro_batch),
            "--global-batch-size", str(args.global_batch),
            "--tensor-model-parallel-size", str(c.tp), "--zero-stage", str(c.zero_stage),
            *(["--pipeline-model-parallel-size", str(c.pp)] if c.pp > 1 else []),
            "--train-iters", str(iters), "--log-interval", "1", "--eval-interval", "0", *c.extra,
            *(["--zero-bucket-size", str(args.bucket_size)] if args.bucket_size else [])]


def model_flags(args) -> List[str]:
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
            "--vocab-size", str(args.vocab)]


def run_once(cluster, c: Contender, args, iters: int, purpose: str, round_: int, log_dir: Optional[str]) -> dict:
    """One ``hybrid.train`` run on every node; its raw figures."""
    t0 = time.monotonic()
    env = {"DS_ACCELERATOR": "cpu"} if c.peer is not None else None  # DeepSpeed would look for CUDA otherwise
    result = cluster.run(train_argv(c, args, iters), timeout_s=args.timeout, cwd=str(REPO), log_dir=log_dir,
                         env=env)
    wall = time.monotonic() - t0
    out0 = result.nodes[0].output
    iterations = parse_iterations(out0)
    profile = parse_profile(out0)
    traffic = parse_traffic(out0)
    skipped = skipped_steps(out0)
    # a skipped step sends and computes less than a training step: such a run measures nothing. A peer counts
    # no traffic of its own.
    counted = traffic is not None or c.peer is not None
    ok = result.ok and len(iterations) >= iters and counted and not skipped
    reason = None
    if not result.ok:
        reason = failure_reason(result)
    elif len(iterations) < iters:
        reason = f"exit 0, but {len(iterations)} of {iters} iteration lines in node 0's output"
    elif not counted:
        reason = "exit 0, but no 'inter-node traffic' line in node 0's output"
    elif skipped:
        reason = f"{skipped} step(s) skipped for non-finite gradients (the run diverged)"
    times = [ms for _, ms, _ in iterations]
    first = 1 + c.warmup  # the first iteration carries the start-up, then the contender's own warm-up
    measured = times[first:] if len(times) > first else times
    run = {"purpose": purpose, "round": round_, "iters": iters, "ok": ok, "reason": reason,
           "returncodes": [n.returncode for n in result.nodes], "killed": [n.killed for n in result.nodes],
           "wall_s": wall,
           "iface_tx_bytes": [result.link_bytes[n.node.netns]["tx_bytes"] for n in result.nodes],
           "iface_rx_bytes": [result.link_bytes[n.node.netns]["rx_bytes"] for n in result.nodes],
           "comm_bytes": traffic, "iteration_ms": times, "profile": profile,
           "iteration_s_median": None, "exposed_comm_s_median": None, "peak_rss_mib": None,
           "peak_rss_source": None, "timing_source": None}
    if profile is not None and profile.get("iteration_ms_median") is not None:
        run["iteration_s_median"] = profile["iteration_ms_median"] / 1e3
        run["timing_source"] = "run profile"
    elif measured:
        run["iteration_s_median"] = statistics.median(measured) / 1e3
        run["timing_source"] = "iteration lines"
    if profile is not None and profile.get("exposed_comm_ms_median") is not None:
        run["exposed_comm_s_median"] = profile["exposed_comm_ms_median"] / 1e3
    if profile is not None and profile.get("peak_rss_mib"):
        run["peak_rss_mib"] = [float(x) for x in profile["peak_rss_mib"]]
        run["peak_rss_source"] = "run profile (every rank)"
    elif iterations and iterations[-1][2] is not None:
        run["peak_rss_mib"] = [iterations[-1][2]]
        run["peak_rss_source"] = "rank 0 iteration line"
    return run


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(c: Contender, runs: List[dict], args, step_flops: float) -> dict:
    """One contender at one point: the medians over its timed runs, the bytes per step, the derived figures."""
    timed = [r for r in runs if r["purpose"] == "timed"]
    good = [r for r in timed if r["ok"]]
    base = next((r for r in runs if r["purpose"] == "bytes baseline" and r["ok"]), None)
    failed = [r for r in runs if not r["ok"]]
    iteration_s = _median([r["iteration_s_median"] for r in good])
    exposed = _median([r["exposed_comm_s_median"] for r in good])
    per_step = {}
    for key, field in (("iface", "iface_tx_bytes"), ("comm", "comm_bytes")):
        total = _median([sum(r[field]) for r in good if r[field] is not None])
        value = None
        if total is not None:
            if args.bytes_method == "diff" and base is not None and base[field] is not None and args.iters > 1:
                value = (total - sum(base[field])) / (args.iters - 1)
            elif args.bytes_method == "total" or args.iters == 1:
                value = total / args.iters
        per_step[key] = value
    rss = [max(r["peak_rss_mib"]) for r in good if r["peak_rss_mib"]]
    tokens = args.global_batch * args.seq
    row = {"name": c.name, "tp": c.tp, "dp": c.dp, "pp": c.pp, "zero_stage": c.zero_stage,
           "micro_batch": args.micro_batch or c.micro_batch, "zero_reduce_once": c.zero_reduce_once,
           "iteration_s_median": iteration_s, "exposed_comm_s_median": exposed,
           "inter_node_bytes_per_step_iface": per_step["iface"], "inter_node_bytes_per_step_comm": per_step["comm"],
           "tokens_per_s": tokens / iteration_s if iteration_s else None,
           "peak_rss_mib": max(rss) if rss else None,
           "ok": bool(timed) and not failed and iteration_s is not None,
           "runs": runs,
           # additions beyond the planner's schema
           "flags": list(c.extra),
           "compute_s_median": iteration_s - exposed if iteration_s is not None and exposed is not None else None,
           "flop_per_inter_node_byte": step_flops / per_step["iface"] if per_step["iface"] else None,
           "peak_rss_source": good[0]["peak_rss_source"] if good else None,
           "failure": failed[0]["reason"] if failed else (None if timed else "not run")}
    if row["failure"] is None and not row["ok"]:
        row["failure"] = "no timing in the trainer's output"
    return row


# ---- printing ------------------------------------------------------------------------------------
COLUMNS = ("contender", "layout", "ms/iter", "tokens/s", "vs tp4", "compute ms", "exposed comm ms",
           "MB/step iface", "MB/step comm", "peak RSS MiB", "FLOP/B")


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# What a contender's flags change besides the layout, as the layout column names it (the flag's value where "{}"
# stands), in this order. The pipeline schedule is named only when it is not the schema's default.
FLAG_LABELS = (("--zero-quantized-gradients", "grads {}"), ("--zero-quantized-weights", "weights {}"),
               ("--zero-two-level-reduce", "2-level"), ("--zero-hpz-partition-size", "hpZ {}"),
               ("--zero-prefetch-bucket-size", "prefetch {}"), ("--optimizer", "{}"),
               ("--pipeline-schedule", "{}"), ("--overlap-param-gather", "overlapped gather"))


def settings_label(row: dict) -> str:
    """`` <label> ...`` for the settings of :data:`FLAG_LABELS` the row's flags set, else empty."""
    from hybrid.config.schema import PipelineConfig

    flags = row.get("flags", [])
    labels = []
    for flag, label in FLAG_LABELS:
        if flag not in flags:
            continue
        i = flags.index(flag)
        value = flags[i + 1] if "{}" in label and i + 1 < len(flags) else ""
        if flag == "--pipeline-schedule" and value == PipelineConfig().schedule:
            continue
        labels.append(label.format(value))
    return "".join(f" {label}" for label in labels)


def table_rows(point: dict) -> List[List[str]]:
    base = next((r for r in point["contenders"] if r["name"] == BASELINE and r["ok"]), None)
    rows = []
    for r in point["contenders"]:
        layout = f"TP{r['tp']}x{'PP%dx' % r['pp'] if r.get('pp', 1) > 1 else ''}DP{r['dp']} Z{r['zero_stage']} " \
                 f"mb{r['micro_batch']}" + (" once" if r["zero_reduce_once"] else "") + settings_label(r)
        if not r["ok"]:
            rows.append([r["name"], layout, "FAILED", r["failure"] or "", "", "", "", "", "", "", ""])
            continue
        ratio = (r["tokens_per_s"] / base["tokens_per_s"]) if base else None
        compute = r["compute_s_median"]
        rss = _fmt(r["peak_rss_mib"], ".0f") + (" r0" if r["peak_rss_source"] == "rank 0 iteration line" else "")
        rows.append([r["name"], layout, _fmt(1e3 * r["iteration_s_median"], ".1f"), _fmt(r["tokens_per_s"], ".0f"),
                     _fmt(ratio, ".2f") + ("x" if ratio is not None else ""),
                     _fmt(None if compute is None else 1e3 * compute, ".1f"),
                     _fmt(None if r["exposed_comm_s_median"] is None else 1e3 * r["exposed_comm_s_median"], ".1f"),
                     _fmt(None if r["inter_node_bytes_per_step_iface"] is None
                          else r["inter_node_bytes_per_step_iface"] / 1e6, ".2f"),
                     _fmt(None if r["inter_node_bytes_per_step_comm"] is None
                          else r["inter_node_bytes_per_step_comm"] / 1e6, ".2f"),
                     rss, _fmt(r["flop_per_inter_node_byte"], ",.0f")])
    return rows


def print_text_table(point: dict) -> None:
    rows = table_rows(point)
    widths = [max([len(COLUMNS[i])] + [len(row[i]) for row in rows if not (row[2] == "FAILED" and i == 3)])
              for i in range(len(COLUMNS))]
    print("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(COLUMNS, widths))))
    for row in rows:
        if row[2] == "FAILED":
            print("  ".join(row[i].ljust(widths[i]) for i in range(2)) + "  FAILED: " + row[3])
            continue
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))


def markdown_table(point: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(COLUMNS) - 2)) + "|"]
    for row in table_rows(point):
        if row[2] == "FAILED":
            row = row[:2] + [f"FAILED: {row[3]}"] + [""] * (len(COLUMNS) - 3)
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return "\n".join(lines)


def point_label(point: dict) -> str:
    label = point["rate"] or "none"
    return label + (f"+{point['delay']}" if point.get("delay") else "")


def flop_per_byte_lines(point: dict, emulation: Optional[float]) -> List[str]:
    parts = [f"{r['name']} {_fmt(r['flop_per_inter_node_byte'], ',.0f')}" for r in point["contenders"] if r["ok"]]
    refs = [f"{label} {reference_flop_per_byte(*spec):,.0f}" for label, *spec in REFERENCE_CLUSTERS]
    if point["link_bytes_per_s"] is None:
        emu = "this emulation: n/a (unshaped link)"
    elif emulation is None:
        emu = "this emulation: n/a (no unshaped point measured)"
    else:
        emu = f"this emulation at {point['rate']} {emulation:,.0f}"
    return [f"  workload FLOP per inter-node byte: {', '.join(parts) or 'n/a'}",
            f"  communication matches compute at: {'; '.join(refs)}; {emu}"]


def reference_flop_per_byte(gpus: int, peak: float, mfu: float, link_bit_s: float) -> float:
    """Node FLOP/s over link bytes/s: the FLOP per byte at which communication matches compute."""
    return gpus * peak * mfu / (link_bit_s / 8)


def machine_flops(points: List[dict], step_flops: float) -> Optional[Tuple[float, str]]:
    """The machine's model FLOP/s: the median over the contenders at the unshaped point of step model FLOPs over
    compute seconds (ms/iter - exposed comm; ms/iter alone where the trainer gave no exposed comm), and what it
    is based on. None when the sweep has no unshaped point."""
    rates, used = [], []
    for p in points:
        if p["rate"] is not None or p.get("delay"):
            continue
        for r in p["contenders"]:
            compute = (r["compute_s_median"] or r["iteration_s_median"]) if r["ok"] else None
            if compute:
                rates.append(step_flops / compute)
                used.append(r["name"] + ("" if r["compute_s_median"] else " (ms/iter)"))
    if not rates:
        return None
    return statistics.median(rates), ", ".join(used)


# ---- driver --------------------------------------------------------------------------------------
def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=None, help="override every contender's micro batch (4)")
    ap.add_argument("--bucket-size", type=int, default=300_000,
                    help="every contender's --zero-bucket-size, in elements; the default cuts a TP=2 rank's 1.8M "
                         "gradient elements into about 6 buckets, so reductions overlap backward (as a user sizes "
                         "buckets to the model); 0 keeps the trainer's 25M, one bucket for this model")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--iters", type=int, default=6, help="optimizer steps per run; the first is not timed")
    ap.add_argument("--rates", default="none,1gbit,200mbit,50mbit",
                    help="comma-separated tc rates of the bandwidth points; 'none' leaves the link unshaped")
    ap.add_argument("--delays", default="1ms,10ms",
                    help="one-way link delays of the latency points (need tc netem); '' for none")
    ap.add_argument("--delay-rate", default="1gbit", help="link rate of the latency points")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds over the contenders per point")
    ap.add_argument("--compressed", action="store_true",
                    help="also run the optional ZeRO contenders: compressed communication (quantized gradients / "
                         "weights, 1-bit Adam), hpZ, small stage-3 windows, and the weights' all-gather behind the "
                         "next forward (-opg)")
    ap.add_argument("--peers", action="store_true",
                    help="also run the peers: DeepSpeed ZeRO-2/3 (at its defaults, and at hybrid's bucket "
                         "settings) and torch FSDP2")
    ap.add_argument("--pipelines", action="store_true",
                    help="also run Megatron's pipeline layouts: TP inside each node, one pipeline stage per node "
                         "(1F1B, and interleaved)")
    ap.add_argument("--only", default="", help="comma-separated contender names (default: all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run before every node is killed")
    ap.add_argument("--bytes-method", choices=("diff", "total"), default="diff",
                    help="diff: bytes per step = (B(N) - B(1)) / (N - 1), one extra 1-iteration run per contender "
                         "and point; total: B(N) / N, start-up traffic included")
    ap.add_argument("--prefix", default="hyb", help="name prefix of the emulated cluster's namespaces")
    ap.add_argument("--burst", default="256kb", help="tc tbf burst of the shaped links")
    ap.add_argument("--queue-latency", default="50ms", help="tc tbf latency of the shaped links")
    ap.add_argument("--log-dir", default=None, help="keep every run's node logs under this folder")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "slow_link.json"))
    ap.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    args = ap.parse_args(argv)
    names = {c.name for c in CONTENDERS}
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in names]
    if unknown:
        ap.error(f"--only: unknown contender(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    default = [c for c in CONTENDERS if (args.compressed or not c.compressed) and (args.peers or c.peer is None)
               and (args.pipelines or c.pp == 1)]
    args.contenders = [c for c in CONTENDERS if c.name in chosen or (not chosen and c in default)]
    for c in args.contenders:
        micro = args.micro_batch or c.micro_batch
        if args.global_batch % (micro * c.dp):
            ap.error(f"{c.name}: --global-batch {args.global_batch} is not a multiple of "
                     f"micro batch {micro} x dp {c.dp}")
    if args.iters < 1 or args.repeat < 1:
        ap.error("--iters and --repeat must be at least 1")
    args.rate_points = [None if r.strip() == "none" else r.strip() for r in args.rates.split(",") if r.strip()]
    args.delay_points = [d.strip() for d in args.delays.split(",") if d.strip()]
    try:
        for r in args.rate_points + [args.delay_rate]:
            link_bytes_per_s(r)
    except ValueError as e:
        ap.error(str(e))
    return args


def step_model_flops(args) -> float:
    """Model FLOPs of one optimizer step: ``flops_per_token`` of the trainer's own model x tokens per step."""
    from hybrid.training.cli import parse_args
    from hybrid.training.model import model_config
    from model_zoo.flops import flops_per_token

    config = parse_args([*model_flags(args), "--mock-data", "--train-iters", "1"])
    return float(flops_per_token(model_config(config, args.vocab))) * args.global_batch * args.seq


def run_point(tool, args, rate: Optional[str], delay: Optional[str], step_flops: float) -> dict:
    label = (rate or "none") + (f"+{delay}" if delay else "")
    runs: Dict[str, List[dict]] = {c.name: [] for c in args.contenders}
    with tool.EmulatedCluster(nodes=NODES, ranks_per_node=RANKS_PER_NODE, rate=rate, delay=delay, burst=args.burst,
                              queue_latency=args.queue_latency, prefix=args.prefix) as cluster:
        plan = [(k + 1, c, "timed", args.iters + c.warmup) for k in range(args.repeat) for c in args.contenders]
        if args.bytes_method == "diff" and args.iters > 1:
            plan += [(0, c, "bytes baseline", 1 + c.warmup) for c in args.contenders]
        for round_, c, purpose, iters in plan:
            if purpose == "bytes baseline" and not any(r["ok"] for r in runs[c.name]):
                continue  # no timed run to subtract it from
            log_dir = None
            if args.log_dir:
                log_dir = os.path.join(args.log_dir, label, f"{c.name}-{'r' + str(round_) if round_ else 'base'}")
            run = run_once(cluster, c, args, iters, purpose, round_, log_dir)
            runs[c.name].append(run)
            what = f"round {round_}/{args.repeat}" if round_ else f"{iters}-iteration bytes baseline"
            if not run["ok"]:
                status = f"FAILED ({run['reason']})"
            elif purpose == "timed":
                status = f"{_fmt(run['iteration_s_median'] and 1e3 * run['iteration_s_median'], '.1f')} ms/iter"
            else:
                status = "bytes only"
            print(f"[{label}, {what}, {run['wall_s']:5.1f} s] {c.name}: {status}, "
                  f"tx {'/'.join(f'{b / 1e6:.1f}' for b in run['iface_tx_bytes'])} MB", flush=True)
    point = {"rate": rate, "link_bytes_per_s": link_bytes_per_s(rate),
             "contenders": [summarise(c, runs[c.name], args, step_flops) for c in args.contenders]}
    if delay:
        point["delay"] = delay
    return point


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    from hybrid.plan.setup import DEFAULT_SETUP
    from tools import emulated_cluster as tool
    try:
        tool.check_available(args.prefix)
    except tool.ClusterUnavailable as e:
        print(f"slow_link: skipped, no emulated cluster on this machine: {e}")
        return 0
    step_flops = step_model_flops(args)
    command = "python benchmarks/slow_link.py" + ("" if not (argv if argv is not None else sys.argv[1:]) else
                                                  " " + shlex.join(argv if argv is not None else sys.argv[1:]))
    print(f"{NODES} emulated nodes x {RANKS_PER_NODE} ranks, GPT h={args.hidden} L={args.layers} heads={args.heads} "
          f"seq={args.seq} vocab={args.vocab}, global batch {args.global_batch}, fp32 AdamW, {args.iters} steps "
          f"per run, {args.repeat} interleaved rounds per point; {os.cpu_count()} CPU cores shared by both nodes",
          flush=True)
    points: List[dict] = []
    latency_note = None
    for rate in args.rate_points:
        points.append(run_point(tool, args, rate, None, step_flops))
    for k, delay in enumerate(args.delay_points):
        try:
            points.append(run_point(tool, args, args.delay_rate, delay, step_flops))
        except tool.LinkDelayUnavailable as e:
            latency_note = (f"latency points {', '.join(f'{args.delay_rate}+{d}' for d in args.delay_points[k:])} "
                            f"skipped: {e}")
            break

    best = machine_flops(points, step_flops)
    for p in points:
        bps = p["link_bytes_per_s"]
        p["emulation_flop_per_byte"] = best[0] / NODES / bps if best and bps else None

    result = {"command": command, "nodes": NODES, "ranks_per_node": RANKS_PER_NODE,
              "model": {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
                        "seq_length": args.seq, "vocab_size": args.vocab, "global_batch_size": args.global_batch,
                        "precision": "fp32"},
              "points": points,
              # additions beyond the planner's schema
              "zero_bucket_size": args.bucket_size or None,  # None: the trainer's default
              "cpu_cores": os.cpu_count(),  # shared by every rank of both emulated nodes
              # stage 3's keep window (elements forward keeps gathered for backward) at the trainer's defaults
              "zero_stage3_keep": DEFAULT_SETUP.stage3_keep,
              "iters_per_run": args.iters, "repeat": args.repeat, "bytes_per_step_method": (
                  "diff: (B(N) - B(1)) / (N - 1)" if args.bytes_method == "diff" and args.iters > 1
                  else "total: B(N) / N, start-up traffic included"),
              "step_model_flops": step_flops,
              "machine_model_flops_per_s": None if best is None else best[0],
              "machine_model_flops_basis": None if best is None else f"median of step FLOPs / compute s: {best[1]}",
              "reference_clusters": [{"name": label, "gpus": g, "peak_flops_per_gpu": pk, "mfu": mfu,
                                      "link_bit_per_s": bits,
                                      "flop_per_byte": reference_flop_per_byte(g, pk, mfu, bits)}
                                     for label, g, pk, mfu, bits in REFERENCE_CLUSTERS],
              "latency_points": latency_note or ("measured" if args.delay_points else "none asked for")}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)

    print()
    if latency_note:
        print(latency_note)
    bytes_note = ("(B(N) - B(1)) / (N - 1): start-up traffic excluded" if args.bytes_method == "diff"
                  and args.iters > 1 else "B(N) / N: start-up traffic included")
    print(f"MB/step = 10^6 bytes sent per step by both nodes together, {bytes_note}; ms/iter = rank 0, median over "
          f"iterations 2..N, then over rounds; vs tp4 = tokens/s over {BASELINE}'s; 'r0' = rank 0's peak only")
    if best is not None:
        print(f"machine model FLOP/s (unshaped, median of {best[1]}): {best[0] / 1e9:.2f} GFLOP/s, "
              f"{best[0] / NODES / 1e9:.2f} per emulated node; step model FLOPs {step_flops / 1e9:.2f} GFLOP")
    for p in points:
        print(f"\n== link {point_label(p)}" + (f" ({p['link_bytes_per_s'] / 1e6:g} MB/s each way)"
                                              if p["link_bytes_per_s"] else " (unshaped)"))
        print_text_table(p)
        for line in flop_per_byte_lines(p, p["emulation_flop_per_byte"]):
            print(line)
    if args.markdown:
        for p in points:
            print(f"\n#### link {point_label(p)}\n")
            print(markdown_table(p))
    print(f"\nresults: {args.json}")
    failed = [(point_label(p), r["name"]) for p in points for r in p["contenders"] if not r["ok"]]
    if failed:
        print(f"{len(failed)} contender(s) failed: " + ", ".join(f"{n} at {lbl}" for lbl, n in failed))
    print("\nheadline (tokens/s over megatron-tp4's at the same link):")
    for p in points:
        rows = {r["name"]: r for r in p["contenders"]}
        base = rows.get(BASELINE)
        parts = []
        for name in HEADLINE:
            r = rows.get(name)
            if r is None:
                continue
            if base is None or not base["ok"]:
                parts.append(f"{name} n/a ({BASELINE} {'not run' if base is None else 'failed'})")
            elif not r["ok"]:
                parts.append(f"{name} FAILED")
            else:
                parts.append(f"{name} {r['tokens_per_s'] / base['tokens_per_s']:.2f}x")
        print(f"  {point_label(p):>10s}: {', '.join(parts) or 'no hybrid contender run'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
