"""Issue 48, defect 4: ``from-hf`` and ``reshard`` never repoint another run's ``latest`` without being told to.

Writing a checkpoint moves its save folder's ``latest``. Into a run's folder
that would hide the run's newest checkpoint (its next resume would load the
tool's output and fail on the model), so both tools refuse a folder that
already holds checkpoints, in one line naming ``--force``, and write there
only with it. They hold the trainer's save lock while they write. On the
main of the issue both tests failed: the tools moved ``latest`` silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint import SaveDirLock
from hybrid.convert.hf import export_to_hf
from tests.convert.common import GPT2_CFG, randomized_state, write_weights_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "convert_checkpoint.py"


def _tool(*argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOL), *map(str, argv), "--no-progress"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.fixture()
def run_folder(tmp_path):
    """A run's save folder (``latest`` -> iteration 300) and a Hugging Face export of the same model."""
    write_weights_checkpoint(tmp_path / "run", GPT2_CFG, randomized_state(GPT2_CFG), 1, iteration=300)
    export_to_hf(tmp_path / "run", tmp_path / "hf")
    return tmp_path / "run", tmp_path / "hf"


def _refused(proc: subprocess.CompletedProcess, save: Path, latest: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"--save {save} already holds checkpoints (latest: {latest};" in lines[0] and "--force" in lines[0]


def test_from_hf_into_a_run_folder_is_refused_unless_forced(run_folder):
    run, hf = run_folder
    _refused(_tool("from-hf", "--input", hf, "--save", run, "--tp", 2), run, "iter_0000300")
    assert (run / "latest").read_text().strip() == "iter_0000300"
    assert not (run / "iter_0000000").exists()
    forced = _tool("from-hf", "--input", hf, "--save", run, "--tp", 2, "--force")
    assert forced.returncode == 0, forced.stderr
    assert (run / "latest").read_text().strip() == "iter_0000000"
    assert (run / "iter_0000300" / "metadata.json").is_file()  # written beside, not instead


def test_reshard_into_a_run_folder_is_refused_unless_forced(run_folder, tmp_path):
    run, _ = run_folder
    other = tmp_path / "other"
    write_weights_checkpoint(other, GPT2_CFG, randomized_state(GPT2_CFG, seed=3), 1, iteration=7)
    _refused(_tool("reshard", "--load", run, "--save", other, "--target-tp", 2), other, "iter_0000007")
    assert (other / "latest").read_text().strip() == "iter_0000007"
    forced = _tool("reshard", "--load", run, "--save", other, "--target-tp", 2, "--force")
    assert forced.returncode == 0, forced.stderr
    assert (other / "latest").read_text().strip() == "iter_0000300"


def test_the_tools_take_the_trainers_save_lock(run_folder, tmp_path):
    """A folder a job is saving into (this process holds its lock, as a trainer's rank 0 does) is refused.
    (This one held on the issue's main too: it guards the lock the refusal above is checked under.)"""
    _, hf = run_folder
    fresh = tmp_path / "fresh"
    with SaveDirLock(fresh):
        proc = _tool("from-hf", "--input", hf, "--save", fresh)
    assert proc.returncode == 1 and "is in use by another job" in proc.stderr, proc.stderr
    assert not (fresh / "latest").exists()
