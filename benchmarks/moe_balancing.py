"""Balancing works: the tiny-moe preset trained three ways, the spread of tokens over experts compared.

Every run trains ``model_zoo``'s ``tiny-moe`` (4 layers, each an MoE layer of 4
SwiGLU experts, top-2) on the demo corpus of ``launch_scripts/pretrain_gpt_tiny.sh``
(the standard library's docstrings, a SentencePiece tokenizer of 4096 pieces,
seq 128, global batch 16, AdamW at 3e-3 with cosine decay, seed 1234; built
once by ``benchmarks/convergence.py``'s ``prepare_data``) for ``--iters``
optimizer steps in one process, with only the balancing flags differing:

===========  ========================================================================================
aux          ``--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2`` (the preset's)
bias         ``--moe-router-load-balancing-type none --moe-aux-loss-coeff 0 --moe-router-enable-expert-bias``
             ``--moe-router-bias-update-rate 1e-2`` (aux-loss-free, DeepSeek-V3's method; the rate is 10x its
             1e-3, for a run of 200 steps)
none         ``--moe-router-load-balancing-type none --moe-aux-loss-coeff 0``
bias-1e-3    as bias at DeepSeek's rate 1e-3 (not run unless named: ``--only bias-1e-3``; plotted when there)
===========  ========================================================================================

The spread is the trainer's TensorBoard tag ``moe/load_max_over_mean``
(``docs/monitoring.md``): over the global batch of one iteration
(``--log-interval 1``), the most loaded expert's assignments over the mean, the
highest over the 4 MoE layers; 1 is perfectly balanced, 2 (= E/k) every token
on the same two experts. A run's figure is its mean over the last
:data:`LAST` iterations. Balancing works when ``aux`` and ``bias`` are at most
:data:`BOUND` (1.5: the monitor's collapse flag, ``hybrid.monitor.moe``) and
``none`` is measurably worse: above the bound, and above the worse of the
other two by more than :data:`MARGIN_SE` standard errors of the difference of
the means (each mean's error from its LAST values' spread).

At the demo's learning rate every run's routing collapses onto two experts
within its first 10 iterations (the warm-up); the balancing loss brings it back
from about iteration 40, the expert bias at 1e-2 from about 60, DeepSeek's
1e-3 only starts to by 200 (``benchmarks/results/moe_balancing.md``).

Writes ``--markdown`` (default ``benchmarks/results/moe_balancing.md``: the
command, the table, the verdict) and ``--png`` (default
``benchmarks/results/moe_balancing.png``: the spread against iteration for the
three runs, read back from their event files with tensorboard's
EventAccumulator, and the bound). Needs matplotlib (``pip install .[bench]``).

Reproduce (from the repository root)::

    python benchmarks/moe_balancing.py                      # 200 iterations each, one after another
    python benchmarks/moe_balancing.py --parallel           # the three runs at once (3 processes)
    python benchmarks/moe_balancing.py --replot             # table and PNG again from the event files

Exit status: 0 when the verdict holds, 1 when it does not or a run failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from convergence import (GLOBAL_BATCH, LR, MICRO_BATCH, SEED, SEQ_LENGTH,  # noqa: E402  the demo's settings
                         prepare_data)
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from hybrid.monitor.moe import collapse_threshold  # noqa: E402

MODEL = "tiny-moe"
SPREAD_TAG = "moe/load_max_over_mean"
LOSS_TAG = "train/lm_loss"
LAST = 20  # iterations averaged for a run's figure
NUM_EXPERTS, TOPK = 4, 2  # tiny-moe's
# The bound balancing must keep the spread (mean of the last LAST iterations) to: below the monitor's collapse flag,
# half-way from balanced (1) to every token on the same 2 experts (E / k = 2)
BOUND = collapse_threshold(NUM_EXPERTS, TOPK)
MARGIN_SE = 3.0  # "measurably worse": by more than this many standard errors of the difference

_NONE = ("--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0")
RUNS: Dict[str, Tuple[str, ...]] = {
    "aux": ("--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"),
    # 1e-2 a step, not DeepSeek's 1e-3: the router collapses within the first 10 steps at this learning rate, and
    # the bias must undo a score gap of up to 1 within a 200-step run (at 1e-3 it would take about 1000)
    "bias": (*_NONE, "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2"),
    "none": _NONE,
    # not run by default (--only bias-1e-3): DeepSeek's rate, for comparison
    "bias-1e-3": (*_NONE, "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3"),
}
DEFAULT_RUNS = ("aux", "bias", "none")
BALANCED = ("aux", "bias")  # the runs that must meet the bound; "none" must not
COLORS = {"aux": "tab:blue", "bias": "tab:green", "none": "tab:red", "bias-1e-3": "tab:olive"}


def trainer_flags(name: str, iters: int, data_prefix: Path, tokenizer: Path, tb_dir: Path) -> List[str]:
    """The demo's flags (launch_scripts/pretrain_gpt_tiny.sh, no checkpoints) on tiny-moe, plus ``name``'s."""
    return ["--model", MODEL, "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(iters), "--lr", str(LR), "--min-lr", str(LR / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(iters // 20 + 1), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--data-path", str(data_prefix), "--split", "95,5,0", "--tokenizer-model", str(tokenizer),
            "--eval-interval", str(iters + 1), "--eval-iters", "1", "--log-interval", "1", "--seed", str(SEED),
            "--tensorboard-dir", str(tb_dir), *RUNS[name]]


def read_tag(tb_dir: Path, tag: str) -> List[Tuple[int, float]]:
    """``[(iteration, value), ...]`` of ``tag`` in a run's event files (a step written twice: the last)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return sorted({e.step: e.value for e in acc.Scalars(tag)}.items())


def summarize(points: List[Tuple[int, float]], last: int = LAST) -> Tuple[float, float]:
    """(mean, standard error of the mean) of the last ``last`` values."""
    values = [v for _, v in points[-last:]]
    if len(values) < 2:
        raise ValueError(f"need at least 2 logged iterations, got {len(values)}")
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def verdict(figures: Dict[str, Tuple[float, float]], bound: float = BOUND,
            margin_se: float = MARGIN_SE) -> Tuple[bool, List[str]]:
    """Whether the balanced runs meet ``bound`` and ``none`` is measurably worse; the reasons, one line each."""
    lines, ok = [], True
    for name in BALANCED:
        mean, _ = figures[name]
        meets = mean <= bound
        ok &= meets
        lines.append(f"{name}: {mean:.4f} {'<=' if meets else '>'} {bound} ({'meets' if meets else 'misses'} the "
                     f"bound)")
    worst = max(BALANCED, key=lambda n: figures[n][0])
    (m_none, se_none), (m_worst, se_worst) = figures["none"], figures[worst]
    gap, se = m_none - m_worst, (se_none ** 2 + se_worst ** 2) ** 0.5
    worse = m_none > bound and gap > margin_se * se
    ok &= worse
    lines.append(f"none: {m_none:.4f}, {gap:+.4f} against {worst} ({gap / se if se else float('inf'):.1f} standard "
                 f"errors; needs > {margin_se:g}) and {'above' if m_none > bound else 'within'} the bound: "
                 f"{'measurably worse' if worse else 'NOT measurably worse'}")
    return ok, lines


def run_all(args, data_prefix: Path, tokenizer: Path) -> Dict[str, Optional[str]]:
    """Start the runs (at once with ``--parallel``, else one after another); ``{name: failure or None}``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    procs: Dict[str, subprocess.Popen] = {}
    failures: Dict[str, Optional[str]] = {}
    logs = args.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(name: str) -> subprocess.Popen:
        tb = args.work_dir / "tensorboard" / name
        if tb.exists():
            for f in tb.iterdir():  # a fresh run: old events would mix with the new
                f.unlink()
        cmd = [sys.executable, "-m", "hybrid.train", *trainer_flags(name, args.iters, data_prefix, tokenizer, tb)]
        print(f"[{name}] {shlex.join(cmd[1:])}", flush=True)
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(logs / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT)

    def finish(name: str, proc: subprocess.Popen, started: float) -> None:
        rc = proc.wait()
        failures[name] = None if rc == 0 else f"exit status {rc}, see {logs / (name + '.log')}"
        print(f"[{name}] {'done' if rc == 0 else 'FAILED: ' + failures[name]} ({time.time() - started:.0f} s)",
              flush=True)

    t0 = time.time()
    if args.parallel:
        procs = {name: start(name) for name in args.only}
        for name, proc in procs.items():
            finish(name, proc, t0)
    else:
        for name in args.only:
            started = time.time()
            finish(name, start(name), started)
    return failures


def plot(curves: Dict[str, List[Tuple[int, float]]], figures: Dict[str, Tuple[float, float]], path: Path,
         iters: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, points in curves.items():
        if not points:
            continue
        steps, values = zip(*points)
        mean = figures[name][0]
        ax.plot(steps, values, color=COLORS[name], linewidth=1.0, alpha=0.85,
                label=f"{name} (last {LAST}: {mean:.3f})")
    ax.axhline(BOUND, color="black", linestyle="--", linewidth=1.0, label=f"bound {BOUND}")
    ax.axvspan(iters - LAST + 0.5, iters + 0.5, color="0.9", zorder=0, label=f"last {LAST} iterations")
    ax.set_xlabel("iteration")
    ax.set_ylabel("max / mean tokens per expert (worst of 4 MoE layers)")
    ax.set_title(f"{MODEL}: 4 experts, top-2, demo corpus, global batch {GLOBAL_BATCH} x seq {SEQ_LENGTH}")
    ax.set_ylim(bottom=1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(args, figures: Dict[str, Tuple[float, float]], losses: Dict[str, Optional[float]], ok: bool,
             lines: List[str], command: str) -> str:
    rows = [f"| {name} | `{shlex.join(RUNS[name])}` | {figures[name][0]:.4f} ± {figures[name][1]:.4f} | "
            f"{'n/a' if losses[name] is None else format(losses[name], '.3f')} |" for name in figures]
    return "\n".join([
        "# MoE balancing: tiny-moe, three ways", "",
        f"`{MODEL}` (4 MoE layers of 4 experts, top-2) on the demo corpus, {args.iters} iterations each, one "
        f"process, global batch {GLOBAL_BATCH} x seq {SEQ_LENGTH}, seed {SEED}. Spread: `{SPREAD_TAG}` (max/mean "
        f"tokens per expert over the global batch of an iteration, the worst layer), mean ± standard error over "
        f"the last {LAST} iterations. Bound: {BOUND} (`hybrid.monitor.moe.collapse_threshold(4, 2)`: half-way from "
        f"balanced, 1, to every token on the same 2 experts, 2; the console flags ROUTING COLLAPSED from there).", "",
        "| run | balancing flags | spread (last 20) | lm loss (last 20) |",
        "| --- | --- | --- | --- |", *rows, "",
        f"Verdict: {'balancing works' if ok else 'NOT MET'}.", "", *[f"- {line}" for line in lines], "",
        f"![spread over iterations]({args.png.name})", "",
        "Command (from the repository root):", "", "```", command, "```", ""])


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="optimizer steps of each run (default 200)")
    ap.add_argument("--only", default=",".join(DEFAULT_RUNS),
                    help=f"comma-separated runs of {', '.join(RUNS)} (default: {','.join(DEFAULT_RUNS)})")
    ap.add_argument("--parallel", action="store_true", help="run them at once (3 processes)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (default 1)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/hybrid-moe-balancing"),
                    help="data, event files and logs (default /tmp/hybrid-moe-balancing)")
    ap.add_argument("--markdown", type=Path, default=REPO / "benchmarks/results/moe_balancing.md")
    ap.add_argument("--png", type=Path, default=REPO / "benchmarks/results/moe_balancing.png")
    ap.add_argument("--replot", action="store_true", help="no training: the table and plot from the event files")
    args = ap.parse_args(argv)
    args.only = [n for n in args.only.split(",") if n]
    unknown = [n for n in args.only if n not in RUNS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: not a run; give some of {', '.join(RUNS)}")
    if args.iters < LAST:
        ap.error(f"--iters {args.iters}: at least {LAST} (the figure is the mean of the last {LAST})")
    args.work_dir = args.work_dir.resolve()
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    command = shlex.join(["python", "benchmarks/moe_balancing.py", *(sys.argv[1:] if argv is None else argv)])
    command_file = args.work_dir / "command.txt"  # the training command, for a later --replot's markdown
    if args.replot and command_file.exists():
        command = command_file.read_text().strip()
    if not args.replot:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        command_file.write_text(command + "\n")
        data_prefix, tokenizer = prepare_data(args.work_dir / "data")
        failures = run_all(args, data_prefix, tokenizer)
        if any(failures.values()):
            for name, why in failures.items():
                if why:
                    print(f"FAILED {name}: {why}")
            return 1
    curves = {name: read_tag(args.work_dir / "tensorboard" / name, SPREAD_TAG) for name in RUNS}
    missing = [name for name in DEFAULT_RUNS if len(curves[name]) < LAST]
    if missing:
        print(f"no {SPREAD_TAG} for the last {LAST} iterations of {', '.join(missing)} in "
              f"{args.work_dir / 'tensorboard'}: run them (--only {','.join(missing)})")
        return 1
    curves = {name: points for name, points in curves.items() if len(points) >= LAST}  # extra runs: when there
    figures = {name: summarize(points) for name, points in curves.items()}
    losses = {}
    for name in curves:
        loss = read_tag(args.work_dir / "tensorboard" / name, LOSS_TAG)
        losses[name] = statistics.fmean(v for _, v in loss[-LAST:]) if loss else None
    ok, lines = verdict(figures)
    plot(curves, figures, args.png, args.iters)
    text = markdown(args, figures, losses, ok, lines, command)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
