"""Issue 48, defect 1: a checkpoint continues at another ``--seq-length``.

The sequence length is a runtime setting wherever no learned table depends on
it: a RoPE model, or learned positions whose table (``max_position_embeddings``)
holds the new length, continue at another length, resumed or with
``--finetune``, also after ``tools/convert_checkpoint.py from-hf`` (whose import
records the HF position table as the sequence length). A learned table shorter
than the new length is refused in one line naming both numbers.

On the main of 68fb09c every continuation here was refused with "holds a
different model...: seq_length: checkpoint 64, current model 32" (and
``max_position_embeddings None`` vs 64 after from-hf).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from hybrid.training.trainer import main
from model_zoo.config import GPTConfig
from tests.multiproc import free_port

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2",
       "--log-interval", "1", "--eval-interval", "0"]
LEARNED = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128"]
ROPE = LEARNED + ["--position-embedding-type", "rope", "--normalization", "rmsnorm", "--swiglu",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights"]  # a small Llama


def _train(argv, monkeypatch, capsys):
    """``hybrid-train RUN + argv`` in this process, a world of one: (exit code, stderr lines)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    try:
        code = main([str(a) for a in RUN + list(argv)])
    except SystemExit as e:
        code = e.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _ok(result) -> None:
    code, err = result
    assert code in (0, None), "\n".join(err[-20:])


# ---- the rule, on the settings alone ---------------------------------------------------------------

def test_the_sequence_length_is_no_shape_but_a_learned_table_is():
    from model_zoo.config import load_conflicts

    rope = GPTConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, position="rope", seq_length=64)
    assert load_conflicts(rope.to_dict(), rope.replace(seq_length=32).to_dict()) == []
    assert load_conflicts(rope.to_dict(), rope.replace(seq_length=4096, max_position_embeddings=4096).to_dict()) == []
    learned = GPTConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, seq_length=64,
                        max_position_embeddings=64)
    assert load_conflicts(learned.to_dict(), learned.replace(seq_length=32).to_dict()) == []
    # unset max_position_embeddings is seq_length: the same 64 rows either way
    assert load_conflicts(learned.to_dict(), learned.replace(max_position_embeddings=None).to_dict()) == []
    unset = dict(max_position_embeddings=None)
    (longer,) = load_conflicts(learned.to_dict(), learned.replace(seq_length=128, **unset).to_dict())
    assert "64 rows" in longer and "seq_length 128" in longer, longer
    (other,) = load_conflicts(learned.to_dict(), learned.replace(seq_length=32, **unset).to_dict())
    assert "64 rows" in other and "32" in other and "max_position_embeddings to 64" in other, other
    # a shape still has to agree
    assert load_conflicts(learned.to_dict(), learned.replace(hidden_size=64).to_dict()) == [
        "hidden_size: checkpoint 32, current model 64"]


# ---- the trainer ------------------------------------------------------------------------------------

def test_a_rope_model_continues_at_another_length_resumed_or_finetuned(tmp_path, monkeypatch, capsys):
    save = tmp_path / "k2"
    _ok(_train(ROPE + ["--seq-length", "64", "--max-position-embeddings", "64", "--save", save], monkeypatch, capsys))
    _ok(_train(ROPE + ["--seq-length", "32", "--max-position-embeddings", "64", "--load", save, "--finetune",
                       "--save", tmp_path / "k2ft"], monkeypatch, capsys))
    assert (tmp_path / "k2ft" / "latest").read_text().strip() == "iter_0000002"
    # resumed (optimizer and schedule too), longer than it was trained, with another table size
    _ok(_train(ROPE + ["--seq-length", "128", "--train-iters", "4", "--load", save, "--save", save],
               monkeypatch, capsys))
    assert (save / "latest").read_text().strip() == "iter_0000004"


def test_learned_positions_continue_within_their_table_and_refuse_past_it(tmp_path, monkeypatch, capsys):
    save = tmp_path / "learned"
    _ok(_train(LEARNED + ["--seq-length", "32", "--max-position-embeddings", "64", "--save", save],
               monkeypatch, capsys))
    _ok(_train(LEARNED + ["--seq-length", "16", "--max-position-embeddings", "64", "--load", save, "--finetune",
                          "--save", tmp_path / "ft"], monkeypatch, capsys))
    _ok(_train(LEARNED + ["--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", "4",
                          "--load", save, "--save", save], monkeypatch, capsys))
    # a table of 64 rows cannot run 128 positions: one line naming both
    code, err = _train(LEARNED + ["--seq-length", "128", "--load", save, "--finetune", "--save", tmp_path / "long"],
                       monkeypatch, capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("hybrid-train: error: --load ") and "64 rows" in err[0] and "seq_length 128" in err[0], err


def _hf_export(tmp_path, monkeypatch, capsys, model: List[str]) -> Path:
    """A Hugging Face folder of a 2-step run of ``model`` (to-hf), imported again by from-hf: the import."""
    trained = tmp_path / "trained"
    _ok(_train(model + ["--save", trained], monkeypatch, capsys))
    tool = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for args in (["to-hf", "--load", trained, "--output", tmp_path / "hf", "--no-progress"],
                 ["from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "imported", "--no-progress"]):
        proc = subprocess.run(tool + [str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / "imported"


# The in-process cases above cover both position kinds; the from-hf imports and the issue's torchrun run
# are with the slow tests (pytest -m slow), for the suite's time budget.
@pytest.mark.slow
def test_a_from_hf_import_fine_tunes_at_another_length(tmp_path, monkeypatch, capsys):
    imported = _hf_export(tmp_path, monkeypatch, capsys, ROPE + ["--seq-length", "128"])
    _ok(_train(ROPE + ["--seq-length", "32", "--max-position-embeddings", "64", "--load", imported, "--finetune",
                       "--save", tmp_path / "ft"], monkeypatch, capsys))
    assert (tmp_path / "ft" / "latest").read_text().strip() == "iter_0000002"


@pytest.mark.slow
def test_a_learned_from_hf_import_fine_tunes_within_its_table(tmp_path, monkeypatch, capsys):
    imported = _hf_export(tmp_path, monkeypatch, capsys, LEARNED + ["--seq-length", "64"])
    _ok(_train(LEARNED + ["--seq-length", "32", "--max-position-embeddings", "64", "--load", imported, "--finetune",
                          "--save", tmp_path / "ft"], monkeypatch, capsys))
    code, err = _train(LEARNED + ["--seq-length", "128", "--load", imported, "--finetune", "--save",
                                  tmp_path / "long"], monkeypatch, capsys)
    assert code == 1 and len(err) == 1 and "64 rows" in err[0] and "seq_length 128" in err[0], err


@pytest.mark.slow
def test_the_issue_reproduction_at_tp2_with_torchrun(tmp_path):
    """The reproduction of issue 48 as written: two processes, TP 2."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), "-m", "hybrid.train", "--mock-data", "--micro-batch-size", "2", "--global-batch-size",
            "8", "--lr", "1e-3", "--tensor-model-parallel-size", "2", "--model", "llama-tiny", "--train-iters", "2",
            "--eval-interval", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for extra in (["--seq-length", "64", "--max-position-embeddings", "64", "--save", tmp_path / "k2"],
                  ["--seq-length", "32", "--max-position-embeddings", "64", "--load", tmp_path / "k2", "--finetune",
                   "--save", tmp_path / "k2ft"]):
        proc = subprocess.run(base + [str(a) for a in extra], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "k2ft" / "latest").read_text().strip() == "iter_0000002"
