"""Issue 48, defect 5: resuming a weights-only checkpoint without ``--finetune`` says so in one line.

A ``from-hf`` import holds weights and no optimizer state. Resumed as a run
(``--load CK2 --save CK3``, no ``--finetune``), it died with ``KeyError:
'offset'`` in the ZeRO optimizer's ``index_mismatch``: the import's parameter
index records what each tensor is, not where it sits in an optimizer's flat
partitions. Now every ZeRO stage gives the documented line, "holds no optimizer
state ... (--finetune)", with exit status 1 and no traceback; ``--finetune``
still loads it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.test_trainer_faults import MOCK, _main

ROOT = Path(__file__).resolve().parents[2]
RUN = MOCK + ["--train-iters", "1"]


def _tool(*argv) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *map(str, argv),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """A from-hf import of a trained model: a hybrid checkpoint holding weights only."""
    root = tmp_path_factory.mktemp("weights_only")
    with pytest.MonkeyPatch.context() as monkeypatch:
        code, _, err = _main(RUN + ["--save", root / "trained"], monkeypatch, _Discard())
    assert code == 0, err
    _tool("to-hf", "--load", root / "trained", "--output", root / "hf")
    _tool("from-hf", "--input", root / "hf", "--save", root / "imported")
    return root / "imported"


class _Discard:
    """capsys's readouterr for a module-scoped fixture, which cannot take capsys."""

    @staticmethod
    def readouterr():
        class _Out:
            out = err = ""
        return _Out()


@pytest.mark.parametrize("stage", ["0", "1", "3"])
def test_resuming_an_import_without_finetune_says_it_holds_no_optimizer_state(imported, stage, tmp_path,
                                                                              monkeypatch, capsys):
    save = tmp_path / "ck3"
    code, out, err = _main(RUN + ["--zero-stage", stage, "--load", imported, "--save", save], monkeypatch, capsys)
    assert code == 1, out[-2000:] + "\n".join(err)
    assert "Traceback" not in out and "KeyError" not in "".join(err)
    iter_dir = imported / "iter_0000000"
    assert err == [f"hybrid-train: error: --load {iter_dir}: {iter_dir} holds no optimizer state (it was saved for "
                   f"inference or imported); load it for its weights only (--finetune)"]
    assert not list(save.glob("iter_*"))


def test_finetune_loads_the_import(imported, tmp_path, monkeypatch, capsys):
    code, out, err = _main(RUN + ["--zero-stage", "1", "--load", imported, "--finetune", "--save", tmp_path / "ft"],
                           monkeypatch, capsys)
    assert code == 0, err
    assert "weights only (--finetune)" in out
