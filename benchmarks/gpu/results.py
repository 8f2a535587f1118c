"""Shared by the parts of the GPU verification run (benchmarks/gpu/run_all.sh): where results go,
each part's time budget, the JSON every part writes, and the one summary table printed last.

    python benchmarks/gpu/results.py note PART NAME STATUS WALL BUDGET HEADLINE  # a step run_all.sh ran itself
    python benchmarks/gpu/results.py missing PART NAME RC BUDGET   # a part that wrote no JSON
    python benchmarks/gpu/results.py summary                       # the table of every part

Every part writes ``<out>/partN_<name>.json``: ``{"part", "name", "status", "headline", "wall_s",
"budget_s", "dry_run", "rows", "skipped", "notes"}``. ``status`` is ``ok`` (every check passed),
``failed`` (a check failed, or a required run did not fit its budget), ``error`` (the part raised),
``timeout`` (the part's ``timeout`` stopped it: its SIGTERM ends the part, which still writes the rows
it has), or ``crashed`` (written by ``missing`` when a part died without writing its JSON).
``<out>`` is ``$OUT`` when set, else a temporary folder whose path the script prints.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# MFU "of spec" is against the spec sheet's dense bf16 tensor-core peak of the GPU present, from hybrid's own GPU
# table (989.4 TFLOP/s for an H200 or H100 SXM, the figure Megatron's published MFU is against); a GPU missing from
# the table, and the CPU dry run, use the lent H200's. What a large bf16 matmul reaches is not a spec figure: part
# 1 measures it, and MFU is also given against it.
SPEC_GPU = "NVIDIA H200"


def spec_gpu_name() -> str:
    """The GPU whose spec peak MFU is against: the one present when hybrid's table knows it, else SPEC_GPU."""
    import torch

    from hybrid.monitor.flops import table_peak_tflops

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if table_peak_tflops(name, "bf16") is not None:
            return name
    return SPEC_GPU


def spec_peak_bf16_tflops() -> float:
    """The spec peak of :func:`spec_gpu_name` (a function: this module also runs before torch is installed, and
    the table's module imports torch)."""
    from hybrid.monitor.flops import table_peak_tflops

    return table_peak_tflops(spec_gpu_name(), "bf16")

STATUSES = ("ok", "failed", "error", "timeout", "crashed")
# The device tool brings back at most 8 files from $OUT: the 7 part JSONs and summary.txt, nothing else there.
MAX_OUT_FILES = 8
OUT_ENV = "OUT"
FALLBACK_ENV = "HYBRID_GPU_RUN_OUT"  # run_all.sh's temporary folder when $OUT is unset


def out_dir() -> Path:
    """Where every part writes: $OUT, else the folder run_all.sh chose, else a new temporary folder."""
    path = os.environ.get(OUT_ENV) or os.environ.get(FALLBACK_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="hybrid-gpu-run-")
        os.environ[FALLBACK_ENV] = path
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def result_path(part: int, name: str) -> Path:
    return out_dir() / f"part{part}_{name}.json"


class Budget:
    """A part's time budget in seconds, counted from construction. Parts check :meth:`left` before each
    optional size and record what they skip; the part's ``timeout`` in run_all.sh is the hard stop, ``grace``
    seconds after the budget."""

    def __init__(self, seconds: float, grace: float = 0.0):
        self.seconds, self.grace = float(seconds), float(grace)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def left_before_stop(self) -> float:
        """Seconds until run_all.sh's ``timeout`` stops the part: what a child process may be given at most."""
        return self.left() + self.grace


class PartResult:
    """What one part found: rows of measurements, whether every check held, what it skipped."""

    def __init__(self, part: int, name: str, budget: Budget, dry_run: bool):
        self.part, self.name, self.budget, self.dry_run = part, name, budget, dry_run
        self.rows: List[Dict] = []
        self.skipped: List[str] = []
        self.notes: List[str] = []
        self.failures: List[str] = []
        self.info: Dict = {}
        self.headline = ""
        self.error: Optional[str] = None
        self.timed_out = False

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        """Record one pass/fail comparison; a failure is printed at once and fails the part."""
        if not ok:
            self.failures.append(f"{what}: {detail}" if detail else what)
            print(f"FAIL {what} {detail}", flush=True)
        return ok

    def fits(self, what: str, needed_s: float, required: bool = False) -> bool:
        """Whether ``what`` (a size or run, expected to take ``needed_s``) fits in what is left of the budget;
        when it does not, it is recorded as skipped, and a ``required`` one (a check the part exists for, not
        an optional size) also fails the part."""
        left = self.budget.left()
        if left >= needed_s:
            return True
        reason = f"{left:.0f} s left of the {self.budget.seconds:.0f} s budget, about {needed_s:.0f} s needed"
        self.skipped.append(f"{what}: {reason}")
        if required:
            self.check(f"{what} run", False, f"not run: {reason}")
        print(f"skipped {what} (budget)", flush=True)
        return False

    @property
    def status(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.error is not None:
            return "error"
        return "failed" if self.failures else "ok"

    def to_dict(self) -> Dict:
        return {"part": self.part, "name": self.name, "status": self.status, "headline": self.headline,
                "wall_s": round(self.budget.elapsed(), 2), "budget_s": self.budget.seconds,
                "dry_run": self.dry_run, "info": self.info, "rows": self.rows, "skipped": self.skipped,
                "failures": self.failures, "notes": self.notes, "error": self.error}

    def write(self) -> Path:
        path = result_path(self.part, self.name)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=str))
        return path


def part_arguments(description: str) -> argparse.Namespace:
    """The command line every part takes: ``--dry-run-cpu``, ``--budget SECONDS`` and ``--grace SECONDS``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="the same code on CPU with tiny sizes and gloo (what CI runs)")
    parser.add_argument("--budget", type=float, required=True, help="this part's time budget in seconds")
    parser.add_argument("--grace", type=float, default=0.0,
                        help="seconds after the budget at which run_all.sh's timeout stops the part")
    return parser.parse_args()


class PartStopped(BaseException):
    """The part's ``timeout`` sent SIGTERM: raised in the part so that its rows so far are still written. Not an
    ``Exception``, so that a part's ``except Exception`` around one size or section does not swallow it."""


def stop_on_sigterm(signum, frame) -> None:
    raise PartStopped("stopped by its time limit (SIGTERM from run_all.sh's timeout)")


def run_part(part: int, name: str, body: Callable[[PartResult], None], description: str) -> int:
    """Parse the part's arguments, run ``body``, write its JSON whatever happens (its ``timeout``'s SIGTERM
    included: run_all.sh sends SIGKILL only KILL_AFTER seconds later); exit 0 only when ok."""
    args = part_arguments(description)
    result = PartResult(part, name, Budget(args.budget, args.grace), args.dry_run_cpu)
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        body(result)
    except PartStopped as exc:
        result.timed_out = True
        result.error = f"{exc} after {result.budget.elapsed():.1f} s; the rows measured before it are kept"
        print(f"TIMEOUT in part {part} ({name}): {result.error}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the JSON must say what broke; the next part still runs
        result.error = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(f"ERROR in part {part} ({name}):\n{result.error}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    path = result.write()
    print(f"part {part} {name}: {result.status} in {result.budget.elapsed():.1f} s -> {path}", flush=True)
    return 0 if result.status == "ok" else 1


def dry_run_choice(dry_run: bool, gpu, cpu):
    """The GPU size, or the tiny one of the dry run."""
    return cpu if dry_run else gpu


# ---------------------------------------------------------------- run_all.sh's commands --

def write_note(part: int, name: str, status: str, wall: Optional[float], budget: float, headline: str) -> None:
    """The JSON of a step run_all.sh runs itself (the torch install), or of a part that wrote none."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    result_path(part, name).write_text(json.dumps(
        {"part": part, "name": name, "status": status, "wall_s": wall, "budget_s": budget, "headline": headline,
         "rows": [], "skipped": [], "failures": [], "notes": [], "error": None}, indent=1))


def write_missing(part: int, name: str, rc: int, budget: float) -> None:
    """A part that ended without its JSON: killed by its ``timeout`` (rc 124/137) or crashed."""
    if not result_path(part, name).exists():
        write_note(part, name, "timeout" if rc in (124, 137) else "crashed", None, budget,
                   f"no result: exit code {rc}")


def load_results() -> List[Dict]:
    out = []
    for path in sorted(out_dir().glob("part*_*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            out.append({"part": path.stem, "name": path.stem, "status": "crashed", "headline": f"unreadable: {exc}"})
    return sorted(out, key=lambda r: str(r.get("part")))


def summary_table(results: List[Dict]) -> str:
    lines = [f"{'part':<5}{'name':<14}{'status':<9}{'wall s':>8}{'budget s':>10}  headline"]
    for r in results:
        wall = r.get("wall_s")
        wall_txt = f"{wall:.1f}" if isinstance(wall, (int, float)) else "-"
        skipped = f" (skipped {len(r['skipped'])})" if r.get("skipped") else ""
        lines.append(f"{str(r.get('part')):<5}{r.get('name', ''):<14}{r.get('status', '?'):<9}{wall_txt:>8}"
                     f"{r.get('budget_s', 0):>10.0f}  {r.get('headline', '')}{skipped}")
    return "\n".join(lines)


def print_summary() -> int:
    results = load_results()
    table = summary_table(results)
    (out_dir() / "summary.txt").write_text(table + "\n")
    files = sorted(p.name for p in out_dir().rglob("*") if p.is_file())
    if len(files) > MAX_OUT_FILES:
        print(f"WARNING: {out_dir()} holds {len(files)} files, over the {MAX_OUT_FILES} the device tool brings "
              f"back: {', '.join(files)}", flush=True)
    bad = [r for r in results if r.get("status") != "ok"]
    print("\n" + "=" * 100)
    print(f"hybrid GPU verification run: results in {out_dir()}")
    print(table)
    print(f"{len(results) - len(bad)}/{len(results)} parts ok")
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    note = sub.add_parser("note")
    note.add_argument("part", type=int)
    note.add_argument("name")
    note.add_argument("status", choices=STATUSES)
    note.add_argument("wall", type=float)
    note.add_argument("budget", type=float)
    note.add_argument("headline")
    miss = sub.add_parser("missing")
    miss.add_argument("part", type=int)
    miss.add_argument("name")
    miss.add_argument("rc", type=int)
    miss.add_argument("budget", type=float)
    sub.add_parser("summary")
    sub.add_parser("out-dir")
    args = parser.parse_args(argv)
    if args.command == "note":
        write_note(args.part, args.name, args.status, args.wall, args.budget, args.headline)
        return 0
    if args.command == "missing":
        write_missing(args.part, args.name, args.rc, args.budget)
        return 0
    if args.command == "out-dir":
        print(out_dir())
        return 0
    return print_summary()


if __name__ == "__main__":
    sys.exit(main())
