"""The planner's table: one row per layout, memory by component, fit, communication and step time."""

from __future__ import annotations

import json
from typing import List, Sequence

from hybrid.plan.layouts import Evaluation

GIB = 2**30

COLUMNS = [
    # (header, width, cell)
    ("#", 3, lambda i, e: f"{i}"),
    ("tp", 4, lambda i, e: f"{e.candidate.tp}{'s' if e.candidate.sequence_parallel else ''}"),
    ("dp", 4, lambda i, e: f"{e.candidate.dp}"),
    ("pp", 4, lambda i, e: f"{e.candidate.pp}" + (f"v{e.candidate.virtual_stages}"
                                                  if e.candidate.virtual_stages > 1 else "")),
    ("zero", 4, lambda i, e: f"{int(e.candidate.zero_stage)}"),
    ("offload", 7, lambda i, e: e.candidate.offload),
    ("recompute", 9, lambda i, e: e.candidate.recompute),
    ("mb", 3, lambda i, e: f"{e.candidate.micro_batch}"),
    ("gas", 4, lambda i, e: f"{e.accumulation}"),
    ("weights", 7, lambda i, e: f"{e.memory.weights / GIB:.2f}"),
    ("grads", 6, lambda i, e: f"{e.memory.grads / GIB:.2f}"),
    ("optim", 6, lambda i, e: f"{e.memory.optimizer / GIB:.2f}"),
    ("activ", 6, lambda i, e: f"{e.memory.transient / GIB:.2f}"),
    ("comm", 5, lambda i, e: f"{e.memory.comm_buffers / GIB:.2f}"),
    ("frag", 5, lambda i, e: f"{e.memory.fragmentation / GIB:.2f}"),
    ("total", 6, lambda i, e: f"{e.memory.total / GIB:.2f}"),
    ("fits", 4, lambda i, e: ("yes" if e.fits else "no") + ("" if e.host_fits else "*")),
    ("host", 6, lambda i, e: f"{e.memory.host / GIB:.1f}"),
    ("DP GB", 6, lambda i, e: f"{e.dp_wire_bytes / 1e9:.1f}"),
    ("TP GB", 6, lambda i, e: f"{e.tp_wire_bytes / 1e9:.1f}"),
    ("node GB", 7, lambda i, e: f"{e.time.inter_node_bytes_per_node / 1e9:.1f}"),
    ("comp s", 7, lambda i, e: f"{e.time.compute:.2f}"),
    ("intra s", 7, lambda i, e: f"{e.time.intra:.2f}"),
    ("inter s", 7, lambda i, e: f"{e.time.inter:.2f}"),
    ("pipe s", 6, lambda i, e: f"{e.time.bubble + e.time.pipeline:.2f}"),
    ("step s", 7, lambda i, e: f"{e.time.total:.2f}"),
    ("tok/s", 8, lambda i, e: _rate(e.tokens_per_s)),
]

# An MoE model's columns, each inserted after the column it names: the expert-parallel size, the worst-case total
# (dropless routing sending every token of the ep group to one rank's experts), the bytes a GPU sends in the token
# all-to-alls and what of them each node sends off it.
MOE_COLUMNS = [
    ("pp", ("ep", 3, lambda i, e: f"{e.candidate.parallel.ep}")),
    ("total", ("worst", 6, lambda i, e: f"{e.memory.worst_total / GIB:.2f}")),
    ("TP GB", ("EP GB", 6, lambda i, e: f"{e.ep_wire_bytes / 1e9:.1f}")),
    ("EP GB", ("EPx GB", 6, lambda i, e: f"{e.ep_inter_node_bytes / 1e9:.1f}")),
]

# A context-parallel plan's columns (hybrid.plan.context_parallel), inserted the same way: the cp size, the bytes
# a GPU sends around its cp ring per step, and the seconds of them the attention does not hide.
CP_COLUMNS = [
    ("tp", ("cp", 3, lambda i, e: f"{e.candidate.cp}")),
    ("TP GB", ("CP GB", 6, lambda i, e: f"{e.cp_wire_bytes / 1e9:.1f}")),
    ("inter s", ("ring s", 6, lambda i, e: f"{e.ring_exposed_s:.2f}")),
]

CP_LEGEND = """\
CP: cp = context-parallel size (each sequence split over cp ranks, two of 2 x cp chunks each; dp excludes cp,
ZeRO partitions over dp x cp); activ includes the ring's blocks in flight; CP GB = bytes each GPU sends around its
cp ring per step (key/value blocks forward and backward, the fp32 dK/dV sums backward); ring s = seconds per step
the ring's transfers are not hidden behind the attention of the block in hand (counted in intra s or inter s)."""

MOE_LEGEND = """\
MoE: ep = expert-parallel size (ep consecutive dp ranks share out the experts; their ZeRO state is partitioned
over edp = dp/ep); memory assumes balanced routing, worst = total when every token of the ep group picks this
rank's experts (dropless bound, every MoE layer at once); EP GB = bytes each GPU sends in the token all-to-alls
per step (dispatch and combine, forward and backward), EPx GB = what each node sends off it of those."""

LEGEND = """\
Memory columns are GiB per GPU and add up to total: weights, grads, optim = fp32 master + optimizer state
on the GPU, activ = activations and workspaces at the peak, comm = gradient buckets (stage 2) and, at the
peak, stage-3 gathered units, in-flight gradient buckets or the packed buffers of quantized collectives
(stages 0-2), frag = fragmentation allowance (10% of the transient part), total = what must fit.
host = GiB of host memory per GPU (offload).
DP/TP GB = wire bytes each GPU sends per step; node GB = bytes each node sends off the node per step.
Step time (seconds) = comp (model FLOPs per GPU / achieved FLOP/s) + intra and inter (exposed time of
the collectives whose rings stay inside nodes / cross them; a node's inter-node bytes share its one
link) + offload + pipe (a pipeline's bubble and its exposed transfers); tok/s = tokens per
second of the job, by which fitting layouts are ranked. With a pipeline, memory is its busiest stage's and
time its slowest stage's; gas is then the micro-batches per step.
'tps' = tensor parallel with sequence parallelism; pp = pipeline stages ('4v2': 4 stages of 2 virtual
stages, interleaved); mb = micro batch, gas = accumulation steps.
A '*' after fits: the node's host memory is too small."""


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e4 else f"{tokens_per_s:.0f}"


def columns(moe: bool, cp: bool = False) -> list:
    """The table's columns: :data:`COLUMNS`, with :data:`MOE_COLUMNS` for an MoE model and :data:`CP_COLUMNS`
    when a layout is context-parallel."""
    out = list(COLUMNS)
    for after, column in (MOE_COLUMNS if moe else []) + (CP_COLUMNS if cp else []):
        out.insert(next(k for k, c in enumerate(out) if c[0] == after) + 1, column)
    return out


def format_table(evaluations: Sequence[Evaluation], top: int) -> str:
    cols = columns(any(e.moe for e in evaluations), any(e.candidate.cp > 1 for e in evaluations))
    head = " ".join(f"{h:>{w}s}" for h, w, _ in cols)
    lines = [head, "-" * len(head)]
    for i, e in enumerate(evaluations[:top], 1):
        lines.append(" ".join(f"{cell(i, e):>{w}s}" for _, w, cell in cols))
    return "\n".join(lines)


def summary(evaluations: Sequence[Evaluation]) -> str:
    fitting = [e for e in evaluations if e.fits and e.host_fits]
    if not fitting:
        smallest = min(evaluations, key=lambda e: e.memory.total)
        return (f"none of {len(evaluations)} layouts fits; the smallest needs "
                f"{smallest.memory.total / GIB:.2f} GiB per GPU ({smallest.candidate.describe()})")
    best = fitting[0]
    return (f"{len(fitting)} of {len(evaluations)} layouts fit; best: {best.candidate.describe()}, "
            f"{best.memory.total / GIB:.2f} GiB per GPU, {best.time.total:.2f} s per step, "
            f"{best.tokens_per_s:.0f} tokens/s")


def to_json(evaluations: Sequence[Evaluation]) -> str:
    rows: List[dict] = []
    for e in evaluations:
        m = e.memory
        rows.append({"tp": e.candidate.tp, "dp": e.candidate.dp, "pp": e.candidate.pp,
                     "pipeline_schedule": e.candidate.pipeline_schedule,
                     "virtual_stages": e.candidate.virtual_stages, "busiest_pipeline_rank": m.pp_rank,
                     "micro_batches_in_flight": m.in_flight, "zero_stage": int(e.candidate.zero_stage),
                     "offload": e.candidate.offload, "recompute": e.candidate.recompute,
                     "micro_batch": e.candidate.micro_batch, "gradient_accumulation_steps": e.accumulation,
                     "sequence_parallel": e.candidate.sequence_parallel,
                     **({"ep": e.candidate.parallel.ep, "edp": e.candidate.dp // e.candidate.parallel.ep,
                         "worst_case_routing_total": e.memory.worst_total,
                         "ep_wire_bytes": e.ep_wire_bytes, "ep_inter_node_bytes_per_node": e.ep_inter_node_bytes}
                        if e.moe else {}),
                     **({"cp": e.candidate.cp, "cp_wire_bytes": e.cp_wire_bytes,
                         "ring_exposed_s": e.ring_exposed_s} if e.candidate.cp > 1 else {}),
                     "bytes": {"weights": m.weights, "grads": m.grads, "master": m.state.master,
                               "optimizer_states": m.state.optimizer_states,
                               "activations_per_micro_batch": m.activations.total, "transient": m.transient,
                               "comm_buffers": m.comm_buffers, "fragmentation": m.fragmentation,
                               "peak": m.peak, "total": m.total, "host": m.host},
                     "fits": e.fits and e.host_fits, "comm": e.comm,
                     "step_time_s": {"total": e.time.total, "compute": e.time.compute, "intra": e.time.intra,
                                     "inter": e.time.inter, "offload": e.time.offload, "bubble": e.time.bubble,
                                     "pipeline": e.time.pipeline},
                     "tokens_per_s": e.tokens_per_s,
                     "inter_node_bytes_per_node": e.time.inter_node_bytes_per_node,
                     "inter_node_bytes_by_node": list(e.time.inter_bytes_by_node),
                     "collectives": {c.name: {"link": c.link, "seconds": c.seconds, "exposed_s": c.exposed,
                                              "inter_node_bytes_per_node": c.inter_node_bytes_per_node}
                                     for c in e.time.collectives}})
    return json.dumps(rows, indent=1)
