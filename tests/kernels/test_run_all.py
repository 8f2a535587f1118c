"""``bash benchmarks/gpu/run_all.sh --dry-run-cpu``: the GPU verification run's orchestration on the CPU.

The same scripts, functions and JSON/table output as on a GPU, with tiny sizes and gloo, so the run
cannot rot unseen while no GPU is lent. (This file sorts after test_quantize.py on purpose: the compiled
CPU ops the dry run requires are then already in the session's kernel cache.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = [(0, "install"), (1, "env"), (2, "kernels"), (3, "engine"), (4, "memory"), (5, "mfu"), (6, "trainer")]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-run")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "benchmarks/gpu/run_all.sh", "--dry-run-cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    return proc, out


def _part(out: Path, part: int, name: str) -> dict:
    return json.loads((out / f"part{part}_{name}.json").read_text())


def test_every_part_reports_ok_and_the_table_comes_last(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for part, name in PARTS:
        data = _part(out, part, name)
        assert data["status"] == "ok", (part, name, data.get("failures"), data.get("error"))
        assert data["headline"]
    lines = proc.stdout.rstrip().splitlines()
    assert lines[-1] == f"{len(PARTS)}/{len(PARTS)} parts ok"
    table = (out / "summary.txt").read_text().rstrip().splitlines()
    assert lines[-1 - len(table):-1] == table  # the table, row for row, just before the closing line
    assert [row.split()[:3] for row in table[1:]] == [[str(p), n, "ok"] for p, n in PARTS]
    # and nothing any part printed comes after it
    assert proc.stdout.rfind("part 6 trainer: exit 0") < proc.stdout.rfind(table[0])
    # everything a part writes beside its JSON stays out of $OUT, whose files the device tool brings back
    from benchmarks.gpu.results import MAX_OUT_FILES

    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == sorted([f"part{p}_{n}.json" for p, n in PARTS] + ["summary.txt"])
    assert len(files) <= MAX_OUT_FILES


def test_parts_compare_what_they_say_they_compare(dry_run):
    _, out = dry_run
    kernels = _part(out, 2, "kernels")
    groups = {c["group"] for c in kernels["checks"]}
    assert {"multi_tensor_adam", "layer_norm", "rms_norm", "quantize (bit-identical)"} <= groups
    assert all(c["ok"] for c in kernels["checks"])

    engine = _part(out, 3, "engine")
    runs = {r["run"]: r for r in engine["rows"]}
    assert set(runs) == {"torch AdamW", "zero1", "zero2", "zero3", "zero2_offload"}
    assert runs["zero2_offload"]["poisoned_host"] and not runs["zero1"]["poisoned_host"]
    for name in ("zero1", "zero2", "zero3", "zero2_offload"):
        assert runs[name]["updated_steps"] == engine["info"]["steps"]
        assert runs[name]["param_rel_err"] <= runs[name]["param_tol"]
    # the CPU repeats the reference bit for bit, so the bounds are the rounding bounds alone
    assert engine["info"]["reference_noise_param"] == 0.0 and engine["info"]["reference_noise_loss"] == 0.0
    assert runs["zero1"]["param_tol"] == engine["info"]["param_rtol"]

    memory = _part(out, 4, "memory")
    assert len(memory["rows"]) == 4 and "n/a on CPU" in memory["info"]["instrument"]
    for row in memory["rows"]:
        assert row["predicted_peak"] > 0 and abs(row["peak"] / row["predicted_peak"] - 1) <= 0.10

    # The dry run gives part 5 a budget of 0 s: its first size runs (nothing is known about the cost
    # before), then the second micro batch and the other 4 settings (one model in the dry run: 2 recompute
    # x 2 kernels, plus the compiled run at recompute none) are recorded as skipped, and the part still
    # reports ok.
    mfu = _part(out, 5, "mfu")
    assert len(mfu["rows"]) == 1 and mfu["rows"][0]["micro_batch"] == 1
    assert any("flash" in k for k in mfu["rows"][0]["sdpa_kernels"])
    assert len(mfu["skipped"]) == 1 + 4 and all("left of the 0 s budget" in s for s in mfu["skipped"])
    assert any("kernels=compiled" in s for s in mfu["skipped"])
    assert mfu["info"]["measured_peak_tflops"] == _part(out, 1, "env")["info"]["matmul_bf16_tflops"]


def test_a_part_without_its_json_is_reported_as_such(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    script = [sys.executable, "benchmarks/gpu/results.py"]
    subprocess.run(script + ["missing", "5", "mfu", "124", "70"], cwd=REPO, env=env, check=True)
    subprocess.run(script + ["missing", "6", "trainer", "1", "30"], cwd=REPO, env=env, check=True)
    proc = subprocess.run(script + ["summary"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert _part(tmp_path, 5, "mfu")["status"] == "timeout"
    assert _part(tmp_path, 6, "trainer")["status"] == "crashed"
    assert proc.stdout.rstrip().splitlines()[-1] == "0/2 parts ok"



_STOPPED_PART = """
import sys, time
sys.path.insert(0, {repo!r})
from benchmarks.gpu.results import run_part

def body(res):
    res.rows.append({{"size": 1}})
    print("first row in", flush=True)
    while True:
        try:  # a part's own guard around one size must not swallow the time limit
            time.sleep(0.05)
        except Exception:
            res.rows.append({{"swallowed": True}})

sys.exit(run_part(7, "stopped", body, "a part that overruns"))
"""


def test_a_part_stopped_by_its_time_limit_keeps_its_rows(tmp_path):
    script = tmp_path / "part.py"
    script.write_text(_STOPPED_PART.format(repo=str(REPO)))
    env = dict(os.environ, OUT=str(tmp_path))
    # as run_all.sh runs a part: SIGTERM at the hard limit, SIGKILL 2 s later
    proc = subprocess.run(["timeout", "--kill-after=2", "3", sys.executable, str(script), "--budget", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "first row in" in proc.stdout
    assert proc.returncode == 124  # stopped by the SIGTERM and ended on its own: 137 would mean the SIGKILL
    data = _part(tmp_path, 7, "stopped")
    assert data["status"] == "timeout" and data["rows"] == [{"size": 1}]
    assert "stopped by its time limit" in data["error"]


def test_a_required_run_that_does_not_fit_fails_the_part_and_an_optional_one_does_not():
    sys.path.insert(0, str(REPO))
    from benchmarks.gpu.results import Budget, PartResult

    optional = PartResult(5, "mfu", Budget(0), dry_run=True)
    assert not optional.fits("gpt2-xl micro 16", 10.0)
    assert optional.status == "ok" and len(optional.skipped) == 1
    required = PartResult(3, "engine", Budget(0), dry_run=True)
    assert not required.fits("zero2_offload", 10.0, required=True)
    assert required.status == "failed" and "zero2_offload run" in required.failures[0]


def test_the_trainer_part_kills_an_overrunning_torchrun_with_its_worker(tmp_path):
    from benchmarks.gpu.trainer_run import run_with_deadline
    from hybrid.processes import alive

    pid_file = tmp_path / "worker.pid"
    # a launcher that starts a worker in a session of its own and waits on it, as torchrun does; the worker
    # ignores SIGTERM, so only the SIGKILL that follows the grace ends it
    worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    launcher = ("import subprocess, sys; "
                f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); "
                f"open({str(pid_file)!r}, 'w').write(str(w.pid)); print('launched', flush=True); w.wait()")
    returncode, output = run_with_deadline([sys.executable, "-c", launcher], timeout=3)
    assert returncode is None and "launched" in output
    worker_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker_pid), "the worker outlived its launcher's stop"
