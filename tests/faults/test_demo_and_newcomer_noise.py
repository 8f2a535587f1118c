"""Issue 48, defects 6 and 9: the README demo's variants keep to their own folders, and a newcomer's first
commands print the project's own lines, not pages of someone else's.

* Each demo variant (``MODEL=tiny-gqa``, ``PP=2``, ...) gets its own folder under ``runs/``; a ``WORK_DIR``
  holding another variant's checkpoints is refused in one line naming it (the demo trains from scratch and
  would overwrite them). The script is run from a copy in a temporary folder: its ``runs/`` is there, and with
  no tools beside it, a run that is not refused stops right after its first line.
* ``setup_env.sh`` (sourced by the demo and ``tests/run.sh``) shows no install output on success and at most
  5 lines of it on failure; all of it goes to a log file it names (pip is a stand-in here: no network).
* The planner's ``--help`` says each default once; the slow-link test prints its table only when it fails;
  ``pyproject.toml``'s license is the SPDX string (the table form made setuptools print ~55 warning lines);
  the demo's closing text is the greedy continuation and says so.
Every test here failed on the issue's main.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launch_scripts" / "pretrain_gpt_tiny.sh"


def _demo_copy(tmp_path: Path) -> Path:
    (tmp_path / "launch_scripts").mkdir()
    shutil.copy(DEMO, tmp_path / "launch_scripts" / DEMO.name)
    return tmp_path / "launch_scripts" / DEMO.name


def _held_run(folder: Path, key: str) -> None:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "latest").write_text("iter_0000300\n")
    (folder / "demo_run.txt").write_text(key + "\n")


def _run_demo(script: Path, **variant) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORK_DIR", "MODEL", "TP", "PP", "NPROC", "ZERO_STAGE")}
    env.update(SETUP="0", MASTER_PORT="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               **variant)
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


DEFAULT_KEY = "MODEL=tiny TP=2 PP=1 ZERO_STAGE=1 NPROC=4 SEQ_LENGTH=128 VOCAB_SIZE=4096"


@pytest.mark.parametrize("variant,folder", [({}, "runs/tiny"), ({"MODEL": "tiny-gqa"}, "runs/tiny-gqa"),
                                            ({"PP": "2"}, "runs/tiny-pp2"),
                                            ({"MODEL": "tiny-gqa", "PP": "2", "NPROC": "2"}, "runs/tiny-gqa-pp2-np2")],
                         ids=["default", "tiny-gqa", "pp2", "gqa-pp2-np2"])
def test_each_demo_variant_has_its_own_folder(tmp_path, variant, folder):
    script = _demo_copy(tmp_path)
    _held_run(tmp_path / folder, "MODEL=other TP=1 PP=1 ZERO_STAGE=1 NPROC=1 SEQ_LENGTH=64 VOCAB_SIZE=300")
    proc = _run_demo(script, **variant)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"WORK_DIR={folder} holds the checkpoints of another run (MODEL=other" in lines[0] \
        and "set WORK_DIR to a new folder" in lines[0], proc.stderr
    assert proc.stdout == ""  # refused before anything is done
    assert (tmp_path / folder / "checkpoints" / "latest").read_text() == "iter_0000300\n"


def test_a_work_dir_with_another_models_run_is_refused_and_the_same_variant_may_rerun(tmp_path):
    script = _demo_copy(tmp_path)
    _held_run(tmp_path / "runs" / "tiny", DEFAULT_KEY)
    # MODEL=tiny-gqa told to write into the GPT-2 run's folder
    refused = _run_demo(script, MODEL="tiny-gqa", WORK_DIR="runs/tiny")
    assert refused.returncode == 1 and f"holds the checkpoints of another run ({DEFAULT_KEY})" in refused.stderr
    # a checkpoint folder the script never recorded is another run too
    (tmp_path / "runs" / "tiny" / "demo_run.txt").unlink()
    unknown = _run_demo(script)
    assert unknown.returncode == 1 and "a run this script did not record" in unknown.stderr
    # the same variant again: allowed (its first line, then this copy has no tools to run)
    (tmp_path / "runs" / "tiny" / "demo_run.txt").write_text(DEFAULT_KEY + "\n")
    again = _run_demo(script)
    assert "holds the checkpoints" not in again.stderr
    assert again.stdout.splitlines()[0] == "hybrid demo: pretraining tiny on 4 CPU processes (TP=2, PP=1, ZeRO-1) " \
                                           "into runs/tiny"


def _stub_venv(tmp_path: Path, pip_exit: int) -> Path:
    """A virtual environment whose ``python -m pip`` prints 200 lines (and exits ``pip_exit``); everything else
    runs this test's Python, which has hybrid and torch installed."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        "#!/usr/bin/env bash\n"
        "if [ \"${1:-}\" = -m ] && [ \"${2:-}\" = pip ]; then\n"
        "  for i in $(seq 200); do echo \"pip noise line $i\"; done\n"
        f"  exit {pip_exit}\n"
        "fi\n"
        f"exec {sys.executable} \"$@\"\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f"export PATH=\"{venv / 'bin'}:$PATH\"\n")
    return venv


def _source_setup(venv: Path) -> subprocess.CompletedProcess:
    import importlib.metadata as metadata

    env = {**os.environ, "VENV": str(venv), "FORCE_INSTALL": "1",
           "TORCH_SPEC": f"torch=={metadata.version('torch').split('+')[0]}"}
    env.pop("SETUP_LOG", None)
    return subprocess.run(["bash", "-c", f"source {ROOT / 'launch_scripts' / 'setup_env.sh'}"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_setup_env_keeps_install_output_in_a_log_it_names(tmp_path):
    venv = _stub_venv(tmp_path, 0)
    proc = _source_setup(venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = (proc.stdout + proc.stderr).strip().splitlines()
    assert "pip noise" not in proc.stdout + proc.stderr
    assert shown[0] == f"setting up {venv}: installing what is missing (pip's output goes to {venv / 'setup.log'})"
    assert shown[-1].startswith("hybrid ") and len(shown) == 2, shown
    assert (venv / "setup.log").read_text().count("pip noise line") == 200


def test_a_failed_install_shows_at_most_five_lines_of_its_output(tmp_path):
    venv = _stub_venv(tmp_path, 1)
    proc = _source_setup(venv)
    assert proc.returncode != 0
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if "pip noise" in line]
    assert 0 < len(noise) <= 5 and noise[-1] == "pip noise line 200"
    assert f"the last lines of {venv / 'setup.log'}" in proc.stderr


def test_the_planner_help_says_each_default_once():
    proc = subprocess.run([sys.executable, "-m", "hybrid.plan", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert proc.returncode == 0
    assert "(default: None)" not in proc.stdout
    assert not re.search(r"\(default[^()]*\)\s*\(default", proc.stdout), proc.stdout


def test_the_slow_link_tests_print_nothing_among_the_progress_dots():
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/plan/test_link_time.py", "-q", "-p",
                           "no:cacheprovider", "-k", "compressed_bytes"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert " predicted " not in proc.stdout, proc.stdout[:2000]


def test_the_license_is_an_spdx_string_and_the_demo_says_how_it_samples():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', text, re.M) and "license = {" not in text
    assert re.search(r'requires = \["setuptools>=(7[7-9]|[89]\d)', text)
    demo = DEMO.read_text()
    assert "--greedy" in demo and "greedy" in re.search(r'stage "4/4[^"]*"', demo).group(0)
