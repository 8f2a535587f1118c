"""Convergence of ZeRO's compressed-communication options: the tiny demo model on 2 emulated nodes.

Every option trains the tiny GPT of ``launch_scripts/pretrain_gpt_tiny.sh`` (the standard
library's docstrings, a SentencePiece tokenizer of 4096 pieces, seq 128, global batch 16, AdamW
at 3e-3 with cosine decay, seed 1234) for ``--iters`` optimizer steps (default 300) at TP=2 x DP=2
on an emulated cluster of 2 nodes x 2 ranks (``tools/emulated_cluster.py``): each TP pair on one
node, the data-parallel collectives across the link. Only the ZeRO/optimizer flags differ between
the runs, so the same seed gives every run the same initial weights and the same batches.

Options (name: trainer flags):

=========  ============================================================================
z2         ``--zero-stage 2 --zero-reduce-once`` (the baseline, uncompressed)
qg8        z2 + ``--zero-quantized-gradients int8``
qg4        z2 + ``--zero-quantized-gradients int4``
qw8        z2 + ``--zero-quantized-weights int8``
q          z2 + ``--zero-quantized-gradients int4 --zero-quantized-weights int8``
z3         ``--zero-stage 3`` (uncompressed; stage 3 reduces per unit, not once)
z3-q       z3 + ``--zero-quantized-gradients int4 --zero-quantized-weights int8``
onebit     z2 + ``--optimizer onebit_adam --optimizer-freeze-step 100``
=========  ============================================================================

Not run at this layout (listed with the reason in the output and the JSON): ``2l``
(``--zero-two-level-reduce``) and ``z3-hpz`` (``--zero-hpz-partition-size``). Both act on the
data-parallel ranks that share a node, and TP=2 x DP=2 on 2 nodes puts one rank of each
data-parallel group on each node: the two-level reduction would be the flat one, and a
secondary partition inside a node would hold the whole model (no saving, nothing to compare).

The curves come from each run's own TensorBoard directory (``<work-dir>/tensorboard/<option>``,
tags ``train/lm_loss``, the mean over each log interval, and ``valid/lm_loss``). The final
validation loss is ``valid/lm_loss`` at the last iteration (the trainer evaluates there).

Writes ``--json`` (default ``benchmarks/results/convergence.json``: per option the final
validation loss, its ratio to z2's, and both curves) and ``--png`` (default
``benchmarks/results/convergence.png``: training loss against iteration for every option in one
figure, validation losses as markers, and a zoom on the validation losses), and prints a
Markdown table (option, final validation loss, ratio to z2, within ``--tolerance`` of z2?).

An option whose run fails is reported with one ``FAILED`` line (its reason) and skipped; the
others go on. A later ``--only NAME`` reruns just that option: results of options not rerun are
kept from the existing ``--json`` when it was made with the same iterations and link (``--fresh``
starts over), so the table and the plot still show every option.

Reproduce (from the repository root, as root)::

    python benchmarks/convergence.py                           # every option, 300 iterations
    python benchmarks/convergence.py --only onebit             # add / redo one option later
    python benchmarks/convergence.py --iters 20 --only z2,qg8 --json /tmp/c.json --png /tmp/c.png  # smoke

Exit status: 0 when every option run finished within the tolerance, 1 when one failed or missed
it; 0 with one line when this machine cannot host the emulated cluster. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hybrid.argument_parser import ArgumentParser  # noqa: E402

NODES, RANKS_PER_NODE, TP = 2, 2, 2
BASELINE = "z2"

_Z2 = ("--zero-stage", "2", "--zero-reduce-once")
_Q = ("--zero-quantized-gradients", "int4", "--zero-quantized-weights", "int8")
# name -> the trainer flags that differ from the tiny demo's (every option names its ZeRO stage)
OPTIONS: Dict[str, Tuple[str, ...]] = {
    "z2": _Z2,
    "qg8": _Z2 + ("--zero-quantized-gradients", "int8"),
    "qg4": _Z2 + ("--zero-quantized-gradients", "int4"),
    "qw8": _Z2 + ("--zero-quantized-weights", "int8"),
    "q": _Z2 + _Q,
    "z3": ("--zero-stage", "3"),
    "z3-q": ("--zero-stage", "3") + _Q,
    "onebit": _Z2 + ("--optimizer", "onebit_adam", "--optimizer-freeze-step", "100"),
    # the fastest over the slow link (benchmarks/slow_link.py's hybrid-tp2-z0-1bit)
    "onebit-z0": ("--zero-stage", "0", "--optimizer", "onebit_adam", "--optimizer-freeze-step", "100"),
}
# Options that would be run at a layout with 2+ data-parallel ranks per node; at TP2 x DP2 over 2 nodes
# each node holds one rank of every data-parallel group, so they have nothing to act on.
SKIPPED: Dict[str, str] = {
    "2l": ("--zero-two-level-reduce reduces among a node's data-parallel ranks before crossing; TP2 x DP2 on 2 nodes "
           "has one per node, so it is the flat reduction"),
    "z3-hpz": ("--zero-hpz-partition-size keeps a secondary stage-3 partition among a node's data-parallel ranks; "
               "with one per node it would be a whole copy of the model, so hpZ does not apply at TP2 x DP2"),
}

# The tiny demo's settings (launch_scripts/pretrain_gpt_tiny.sh), checkpoints left out.
VOCAB_SIZE, SEQ_LENGTH, MICRO_BATCH, GLOBAL_BATCH, LR, SEED = 4096, 128, 4, 16, 3e-3, 1234

TRAIN_TAG, VALID_TAG = "train/lm_loss", "valid/lm_loss"


# ---- data -----------------------------------------------------------------------------------------
def prepare_data(data_dir: Path) -> Tuple[Path, Path]:
    """The demo's corpus, tokenizer and indexed dataset under ``data_dir`` (built once, then reused)."""
    prefix, model = data_dir / "corpus_text_document", data_dir / "tokenizer.model"
    if Path(str(prefix) + ".idx").exists() and Path(str(prefix) + ".bin").exists() and model.exists():
        return prefix, model
    data_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    steps = [
        [py, "tools/make_stdlib_corpus.py", "--output", str(data_dir / "corpus.jsonl"), "--max-documents", "0"],
        [py, "tools/train_tokenizer.py", "--input", str(data_dir / "corpus.jsonl"), "--output-prefix",
         str(data_dir / "tokenizer"), "--vocab-size", str(VOCAB_SIZE), "--model-type", "bpe", "--no-progress"],
        [py, "tools/preprocess_data.py", "--input", str(data_dir / "corpus.jsonl"), "--tokenizer-model", str(model),
         "--output-prefix", str(data_dir / "corpus"), "--append-eod", "--workers", "2", "--no-progress"],
    ]
    for cmd in steps:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return prefix, model


# ---- one run --------------------------------------------------------------------------------------
def base_flags(iters: int, data_prefix: Path, tokenizer: Path, args) -> List[str]:
    """The tiny demo's trainer flags at TP=2, without a ZeRO stage (each option gives its own)."""
    return ["--model", "tiny", "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
            "--tensor-model-parallel-size", str(TP),
            "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(iters), "--lr", str(LR), "--min-lr", str(LR / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(iters // 20 + 1), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--data-path", str(data_prefix), "--split", "95,5,0", "--tokenizer-model", str(tokenizer),
            "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
            "--log-interval", str(args.log_interval), "--seed", str(SEED)]


def option_flags(name: str, iters: int, data_prefix: Path, tokenizer: Path, args, tb_dir: Path) -> List[str]:
    return [*base_flags(iters, data_prefix, tokenizer, args), *OPTIONS[name], "--tensorboard-dir", str(tb_dir)]


def read_curves(tb_dir: Path) -> Dict[str, List[Tuple[int, float]]]:
    """``{tag: [(iteration, value), ...]}`` of the loss tags in a run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    curves = {}
    for tag in (TRAIN_TAG, VALID_TAG):
        points = {e.step: e.value for e in acc.Scalars(tag)} if tag in tags else {}  # a step written twice: the last
        curves[tag] = sorted(points.items())
    return curves


_EXCEPTION_RE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)): (.+)$")


def exception_line(result) -> Optional[str]:
    """``node K exit N: SomeError: message`` from the first failed node's output whose traceback ends in
    ``SomeError: ...`` (the last such line), or None."""
    for n in [n for n in result.nodes if n.returncode != 0]:
        found = None
        for line in n.output.splitlines():
            m = _EXCEPTION_RE.match(line.strip())
            if m and "ChildFailedError" not in m.group(1):
                found = f"{m.group(1)}: {m.group(2)}"
        if found:
            return f"node {n.node.index} {n.killed or f'exit {n.returncode}'}: {found[:240]}"
    return None


def run_option(cluster, name: str, args, data_prefix: Path, tokenizer: Path) -> dict:
    from benchmarks.slow_link import failure_reason

    tb_dir = args.work_dir / "tensorboard" / name
    shutil.rmtree(tb_dir, ignore_errors=True)  # no stale events from an earlier run of this option
    log_dir = args.work_dir / "logs" / name
    argv = ["-m", "hybrid.train", *option_flags(name, args.iters, data_prefix, tokenizer, args, tb_dir)]
    t0 = time.monotonic()
    result = cluster.run(argv, timeout_s=args.timeout, cwd=str(REPO), log_dir=str(log_dir),
                         env={"OMP_NUM_THREADS": "1"})  # one intra-op thread per rank, as the demo
    wall = time.monotonic() - t0
    run = {"flags": list(OPTIONS[name]), "ok": False, "reason": None, "wall_s": round(wall, 1),
           "tensorboard_dir": str(tb_dir), "log_dir": str(log_dir),
           "measured_at": datetime.datetime.now().isoformat(timespec="seconds"),
           "final_valid_loss": None, "train_curve": [], "valid_curve": []}
    if not result.ok:
        run["reason"] = exception_line(result) or failure_reason(result)
        return run
    curves = read_curves(tb_dir)
    run["train_curve"] = [[s, v] for s, v in curves[TRAIN_TAG]]
    run["valid_curve"] = [[s, v] for s, v in curves[VALID_TAG]]
    last = curves[VALID_TAG][-1] if curves[VALID_TAG] else None
    if last is None or last[0] != args.iters:
        run["reason"] = (f"exit 0, but no {VALID_TAG} at iteration {args.iters} in {tb_dir} "
                         f"(last: {'none' if last is None else last[0]})")
        return run
    run["ok"], run["final_valid_loss"] = True, last[1]
    return run


# ---- results --------------------------------------------------------------------------------------
def add_ratios(options: Dict[str, dict], tolerance: float) -> None:
    base = options.get(BASELINE)
    ref = base["final_valid_loss"] if base and base["ok"] else None
    for r in options.values():
        if r["ok"] and ref:
            r["ratio_to_z2"] = r["final_valid_loss"] / ref
            r["within_tolerance"] = abs(r["ratio_to_z2"] - 1) <= tolerance
        else:
            r["ratio_to_z2"], r["within_tolerance"] = None, None


def markdown_table(options: Dict[str, dict], tolerance: float) -> str:
    lines = [f"| option | flags | final validation loss | ratio to {BASELINE} | within {tolerance:.0%}? |",
             "|---|---|---:|---:|:---:|"]
    for name, r in options.items():
        flags = " ".join(r["flags"])
        if not r["ok"]:
            lines.append(f"| {name} | `{flags}` | FAILED: {(r['reason'] or '').replace('|', '/')} | | |")
            continue
        ratio = "n/a" if r["ratio_to_z2"] is None else f"{r['ratio_to_z2']:.4f}"
        within = "n/a" if r["within_tolerance"] is None else ("yes" if r["within_tolerance"] else "no")
        lines.append(f"| {name} | `{flags}` | {r['final_valid_loss']:.4f} | {ratio} | {within} |")
    for name, why in SKIPPED.items():
        lines.append(f"| {name} | | not run: {why} | | |")
    return "\n".join(lines)


def plot(options: Dict[str, dict], path: Path, title: str, tolerance: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = [(n, r) for n, r in options.items() if r["ok"]]
    for k, (name, r) in enumerate(drawn):
        color = colors[k % len(colors)]
        style = "-" if name == BASELINE else "--" if name.startswith("z3") else "-."
        width = 2.2 if name == BASELINE else 1.3
        xs, ys = zip(*r["train_curve"]) if r["train_curve"] else ((), ())
        ax.plot(xs, ys, style, color=color, lw=width, label=f"{name} (train)")
        vx, vy = zip(*r["valid_curve"]) if r["valid_curve"] else ((), ())
        ax.plot(vx, vy, "o", color=color, ms=5, mfc="none")
        zoom.plot(vx, vy, "o" + style, color=color, lw=width, ms=5, label=f"{name}: {r['final_valid_loss']:.3f}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("training loss (lines, mean per log interval); validation loss (circles)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    zoom.set_xlabel("iteration")
    zoom.set_ylabel("validation loss")
    base = options.get(BASELINE)
    if base and base["ok"]:  # the acceptance band around the baseline's final validation loss
        ref = base["final_valid_loss"]
        zoom.axhspan(ref * (1 - tolerance), ref * (1 + tolerance), color="0.5", alpha=0.12,
                     label=f"{BASELINE} final \u00b1{tolerance:.0%}")
    later = [(s, v) for _, r in drawn for s, v in r["valid_curve"][1:]]
    if later:  # zoom past the first evaluation, where the curves are still far apart
        zoom.set_xlim(min(s for s, _ in later) - 5, max(s for s, _ in later) + 5)
        lo, hi = min(v for _, v in later), max(v for _, v in later)
        if base and base["ok"]:
            lo, hi = min(lo, ref * (1 - tolerance)), max(hi, ref * (1 + tolerance))
        zoom.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    zoom.set_title("validation loss (zoom); legend: final value")
    zoom.grid(alpha=0.3)
    zoom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- driver ---------------------------------------------------------------------------------------
def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--only", default="", help=f"comma-separated options (default: all): {', '.join(OPTIONS)}")
    ap.add_argument("--link", default="none",
                    help="tc rate of the inter-node link (e.g. 1gbit, 200mbit); 'none' leaves it unshaped. "
                         "Convergence does not depend on it, only the wall time")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="largest relative difference of the final validation loss from z2's counted as 'within'")
    ap.add_argument("--eval-interval", type=int, default=50, help="validation every this many steps (the demo's)")
    ap.add_argument("--eval-iters", type=int, default=4, help="validation batches per evaluation (the demo's)")
    ap.add_argument("--log-interval", type=int, default=10, help="train/lm_loss is the mean over this many steps")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before every node is killed")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/hybrid-convergence"),
                    help="the data, each option's TensorBoard directory (tensorboard/<option>) and node logs")
    ap.add_argument("--prefix", default="hcv", help="name prefix of the emulated cluster's namespaces")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "convergence.json")
    ap.add_argument("--png", type=Path, default=REPO / "benchmarks" / "results" / "convergence.png")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: redraw --png and print the table from the results in --json")
    ap.add_argument("--fresh", action="store_true",
                    help="do not keep the results of options not run now from an existing --json")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    skipped = [s for s in chosen if s in SKIPPED]
    if skipped:
        ap.error("; ".join(f"{s} is not run at TP2 x DP2 on 2 nodes: {SKIPPED[s]}" for s in skipped))
    unknown = [s for s in chosen if s not in OPTIONS]
    if unknown:
        ap.error(f"--only: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    args.options = [n for n in OPTIONS if n in chosen or not chosen]
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    if args.eval_interval < 0 or args.eval_iters < 1 or args.log_interval < 1:
        ap.error("--eval-interval must be >= 0, --eval-iters and --log-interval >= 1")
    args.rate = None if args.link == "none" else args.link
    if args.rate is not None:
        from benchmarks.slow_link import link_bytes_per_s
        try:
            link_bytes_per_s(args.rate)
        except ValueError as e:
            ap.error(f"--link: {e}")
    args.work_dir = args.work_dir.resolve()
    return args


def kept_results(args) -> Dict[str, dict]:
    """The options of an existing --json made with the same iterations and link, not rerun now."""
    if args.fresh or not args.json.exists():
        return {}
    try:
        old = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if old.get("iters") != args.iters or old.get("link") != args.link:
        return {}
    return {n: r for n, r in old.get("options", {}).items() if n in OPTIONS and n not in args.options}


def replot(args) -> int:
    result = json.loads(args.json.read_text())
    options = result["options"]
    add_ratios(options, args.tolerance)
    plot(options, args.png, plot_title(result["link"], result["iters"]), args.tolerance)
    print(markdown_table(options, args.tolerance))
    print(f"\nplot: {args.png}")
    return 0


def plot_title(link: str, iters: int) -> str:
    return (f"tiny GPT, TP2 x DP2 on 2 emulated nodes (link {link}), {iters} iterations, seed {SEED}: "
            f"ZeRO's compressed-communication options")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if args.replot:
        return replot(args)
    from tools import emulated_cluster as tool
    try:
        tool.check_available(args.prefix)
    except tool.ClusterUnavailable as e:
        print(f"convergence: skipped, no emulated cluster on this machine: {e}")
        return 0
    given = list(argv if argv is not None else sys.argv[1:])
    command = "python benchmarks/convergence.py" + (" " + shlex.join(given) if given else "")
    data_prefix, tokenizer = prepare_data(args.work_dir / "data")
    print(f"tiny GPT, TP={TP} x DP={NODES * RANKS_PER_NODE // TP} on {NODES} emulated nodes x {RANKS_PER_NODE} "
          f"ranks, link {args.link}, {args.iters} iterations per option, global batch {GLOBAL_BATCH} x seq "
          f"{SEQ_LENGTH}; {os.cpu_count()} CPU cores shared by both nodes", flush=True)
    for name, why in SKIPPED.items():
        print(f"[{name}] not run: {why}", flush=True)

    runs: Dict[str, dict] = {}
    with tool.EmulatedCluster(nodes=NODES, ranks_per_node=RANKS_PER_NODE, rate=args.rate,
                              prefix=args.prefix) as cluster:  # torn down on exit, error or Ctrl-C
        for name in args.options:
            print(f"[{name}] running: {' '.join(OPTIONS[name])} ...", flush=True)
            run = runs[name] = run_option(cluster, name, args, data_prefix, tokenizer)
            run["command"] = command  # the options of one --json may come from several invocations (--only)
            if run["ok"]:
                print(f"[{name}] done in {run['wall_s']:.1f} s: final validation loss {run['final_valid_loss']:.4f}",
                      flush=True)
            else:
                print(f"[{name}] FAILED after {run['wall_s']:.1f} s, skipped ({run['reason']}); node logs in "
                      f"{run['log_dir']}; rerun it alone with: python benchmarks/convergence.py --only {name}",
                      flush=True)

    kept = kept_results(args)
    options = {n: runs[n] if n in runs else kept[n] for n in OPTIONS if n in runs or n in kept}
    add_ratios(options, args.tolerance)
    result = {"command": command,  # the latest invocation; each option keeps its own
              "iters": args.iters, "link": args.link, "nodes": NODES,
              "ranks_per_node": RANKS_PER_NODE, "tp": TP, "dp": NODES * RANKS_PER_NODE // TP,
              "model": "tiny", "seq_length": SEQ_LENGTH, "global_batch_size": GLOBAL_BATCH,
              "micro_batch_size": MICRO_BATCH, "vocab_size": VOCAB_SIZE, "lr": LR, "seed": SEED,
              "eval_interval": args.eval_interval, "eval_iters": args.eval_iters, "log_interval": args.log_interval,
              "tolerance": args.tolerance, "baseline": BASELINE, "cpu_cores": os.cpu_count(),
              "train_tag": TRAIN_TAG, "valid_tag": VALID_TAG,
              "kept_from_earlier": sorted(kept.keys() & options.keys()),
              "options": options, "not_run": SKIPPED}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    if any(r["ok"] for r in options.values()):
        plot(options, args.png, plot_title(args.link, args.iters), args.tolerance)
    print()
    if kept:
        print(f"kept from {args.json} (not rerun now): {', '.join(sorted(kept.keys() & options.keys()))}")
    print(markdown_table(options, args.tolerance))
    print(f"\nresults: {args.json}\nplot: {args.png}\nTensorBoard: tensorboard --logdir {args.work_dir / 'tensorboard'}")
    failed = [n for n, r in options.items() if not r["ok"]]
    missed = [n for n, r in options.items() if r["within_tolerance"] is False]
    if failed:
        print(f"failed: {', '.join(failed)}")
    if missed:
        print(f"outside {args.tolerance:.0%} of {BASELINE}: {', '.join(missed)}")
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
