"""The trainer's faults of issue 13: divergence, user errors, data problems, seeding, the start-up line.

* A diverging run stops (exit 3, one line naming the iteration, the skipped
  steps, the last loss and the flag) instead of saving blown-up weights to its
  end; checkpoints saved during skipped steps are marked unhealthy, and
  non-finite weights are never saved; fp16's loss-scale collapse stops it too.
* A user error prints one line from rank 0 naming the flag, every rank exits
  with the same non-zero code, and no traceback is printed (world 2, each rank
  started as torchrun starts its workers).
* The data tools refuse an empty corpus; ``--data-path X.bin`` means ``X``; a
  read-only dataset directory works (the index cache goes elsewhere).
* Python's ``random`` and NumPy's global generator are seeded from ``--seed``.
* The effective optimizer settings are printed once at start-up.
"""

from __future__ import annotations

import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np

from hybrid.checkpoint.directory import is_healthy
from hybrid.data.indexed import write_dataset
from hybrid.training import parse_args, validate
from hybrid.training.data import build_data
from hybrid.training.trainer import Trainer, main
from tests.multiproc import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--micro-batch-size", "1", "--eval-interval", "0", "--log-interval", "1"]
MOCK = TINY + ["--mock-data"]


# ---- helpers ------------------------------------------------------------------------------------

def _single_process(monkeypatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _main(argv, monkeypatch, capsys):
    """Run ``hybrid-train argv`` in this process as a world of one; (exit code, stdout, stderr lines)."""
    _single_process(monkeypatch)
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line.strip()]


def _world2(argv, timeout: float = 120) -> List[subprocess.CompletedProcess]:
    """Start ``python -m hybrid.train argv`` as ranks 0 and 1 of one job, as torchrun starts its workers."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-m", "hybrid.train", *map(str, argv)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return done


def _one_error_line(ranks: List[subprocess.CompletedProcess], code: int) -> str:
    """Both ranks exited with ``code``; rank 0 printed exactly one error line, rank 1 nothing; no traceback."""
    logs = "".join(f"--- rank {r} stdout:\n{p.stdout[-2000:]}\n--- stderr:\n{p.stderr[-3000:]}\n"
                   for r, p in enumerate(ranks))
    assert [p.returncode for p in ranks] == [code, code], logs
    assert not any("Traceback" in p.stderr or "Traceback" in p.stdout for p in ranks), logs
    errors = [line for p in ranks for line in p.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("hybrid-train: error: "), logs
    assert errors[0] in ranks[0].stderr, logs
    return errors[0]


def _dataset(prefix: Path, num_docs: int, doc_len: int = 40, vocab: int = 128) -> Path:
    rng = np.random.default_rng(0)
    write_dataset(prefix, [rng.integers(3, vocab, doc_len) for _ in range(num_docs)])
    return prefix


# ---- 1. a diverging run stops ---------------------------------------------------------------------

def test_a_diverging_run_stops_and_its_skipped_steps_are_saved_unhealthy(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    settings = ["--weight-decay", "0.1", "--clip-grad", "1.0", "--zero-stage", "1"]
    code, out, err = _main(MOCK + settings + ["--train-iters", "2", "--save", save], monkeypatch, capsys)
    assert code == 0, err
    # 8. the effective optimizer settings, once, before the first iteration
    (line,) = [x for x in out.splitlines() if x.startswith("optimizer:")]
    for part in ("adamw", "lr 0.001", "betas (0.9, 0.999)", "eps 1e-08", "weight decay 0.1",
                 "exempt (at most one dimension: biases, norm weights; --optimizer-decay-1d-params",
                 "clip-grad 1", "ZeRO stage 1"):
        assert part in line, line
    assert out.index("optimizer:") < out.index("iteration 1/")

    # Resumed at a learning rate that blows the weights up: a step or two land (how many depends on the CPU's
    # rounding), then every step is NaN.
    code, out, err = _main(MOCK + settings + ["--train-iters", "50", "--save", save, "--load", save,
                                              "--save-interval", "1", "--lr", "1e6", "--override-opt-param-scheduler",
                                              "--max-consecutive-skipped-steps", "3",
                                              # the skip budget, which fp32 uses only without the NaN check
                                              "--no-check-for-nan-in-loss-and-grad"], monkeypatch, capsys)
    assert code == 3, out[-2000:] + "\n".join(err)
    assert len(err) == 1, err
    stop = re.search(r"hybrid-train: error: training diverged at iteration (\d+): 3 consecutive skipped steps",
                     err[0])
    assert stop and 5 <= int(stop.group(1)) < 50, err[0]
    for part in ("last lm loss ", "--lr", "--max-consecutive-skipped-steps"):
        assert part in err[0], err[0]
    last = int(stop.group(1))  # iterations last-2 .. last were skipped; the run stopped before saving the last
    saved = sorted(p.name for p in save.glob("iter_*"))
    assert saved == [f"iter_{i:07d}" for i in range(2, last)], saved
    assert [is_healthy(save / name) for name in saved] == [i < last - 2 for i in range(2, last)]
    assert "marked unhealthy" in out


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch, capsys):
    # fp32 masters that overflow to inf on the first step (lr 1e39)...
    save = tmp_path / "fp32"
    code, _, err = _main(MOCK + ["--train-iters", "3", "--save", save, "--save-interval", "1", "--lr", "1e39"],
                         monkeypatch, capsys)
    assert code == 3 and len(err) == 1 and "the weights are not finite" in err[0] and "--save" in err[0], err
    assert not list(save.glob("iter_*"))
    # ... and finite fp32 masters whose fp16 copy is inf (ZeRO-1, static loss scale so the step lands).
    save = tmp_path / "fp16"
    code, _, err = _main(MOCK + ["--train-iters", "3", "--save", save, "--save-interval", "1", "--lr", "1e6",
                                 "--fp16", "--loss-scale", "1", "--zero-stage", "1"], monkeypatch, capsys)
    assert code == 3 and len(err) == 1 and "the weights are not finite" in err[0], err
    assert not list(save.glob("iter_*"))


def test_fp16_loss_scale_collapse_stops_the_run(monkeypatch, capsys):
    code, _, err = _main(MOCK + ["--train-iters", "20", "--fp16", "--lr", "1e6", "--initial-loss-scale", "4",
                                 "--min-loss-scale", "4"], monkeypatch, capsys)
    assert code == 3 and len(err) == 1, err
    assert "training diverged at iteration 2: the fp16 loss scale collapsed" in err[0], err
    assert "--min-loss-scale" in err[0] and "--lr" in err[0]


def test_the_default_limit_outlasts_the_fp16_start_up_skips():
    """Dynamic scaling skips one step per halving plus hysteresis - 1 before it fits: never the limit."""
    from hybrid.config import HybridConfig
    from hybrid.config.schema import LossScalingConfig

    limit = HybridConfig().run.max_consecutive_skipped_steps
    power_field = LossScalingConfig.__dataclass_fields__["initial_scale_power"]
    worst = power_field.metadata["le"] + LossScalingConfig().hysteresis - 1
    assert limit > worst


# ---- 3. user errors: one line from rank 0, the same code everywhere ---------------------------------

def test_bad_settings_print_one_line_from_rank_0(monkeypatch, capsys):
    line = _one_error_line(_world2(MOCK + ["--train-iters", "2", "--lr", "nan"]), code=1)
    assert line == "hybrid-train: error: config key 'optimizer.lr' must be a finite number, got nan (set by --lr)"
    # (one process: the same line, without starting a second one)
    code, _, err = _main(MOCK + ["--train-iters", "2", "--clip-grad", "-1"], monkeypatch, capsys)
    assert (code, err) == (1, ["hybrid-train: error: config key 'clip_grad' must be >= 0.0, got -1.0 "
                               "(set by --clip-grad)"])


def test_a_dataset_too_small_prints_one_line(tmp_path, monkeypatch, capsys):
    prefix = _dataset(tmp_path / "small", num_docs=3, doc_len=5)  # 15 tokens: not one sample of 16 + 1
    code, _, err = _main(TINY + ["--train-iters", "2", "--data-path", prefix, "--split", "100,0,0"],
                         monkeypatch, capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("hybrid-train: error: the train split of") and "the dataset is too small" in err[0]
    assert "--seq-length" in err[0] and "--split" in err[0]


def test_checkpoint_errors_print_one_line_naming_load(tmp_path):
    save = tmp_path / "ckpt"
    ranks = _world2(MOCK + ["--train-iters", "1", "--zero-stage", "1", "--save", save])
    assert [p.returncode for p in ranks] == [0, 0], ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    # 8. printed once, by rank 0
    assert ranks[0].stdout.count("optimizer: adamw") == 1 and "optimizer:" not in ranks[1].stdout
    iter_dir = save / "iter_0000001"

    # a checkpoint of another model size
    line = _one_error_line(_world2(MOCK + ["--train-iters", "2", "--zero-stage", "1", "--hidden-size", "64",
                                           "--load", save]), code=1)
    assert line.startswith(f"hybrid-train: error: --load {iter_dir}: ") and "different model" in line, line

    # a corrupted file that only rank 1 reads (its optimizer partition): rank 0 still prints the one line
    rank1_files = sorted(p for p in iter_dir.iterdir() if "dp01" in p.name or "dp1" in p.name)
    assert rank1_files, sorted(p.name for p in iter_dir.iterdir())
    victim = rank1_files[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    line = _one_error_line(_world2(MOCK + ["--train-iters", "2", "--zero-stage", "1", "--load", save]), code=1)
    assert "--load" in line and victim.name in line, line


# ---- 4-6. data ---------------------------------------------------------------------------------------

def _tool(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / f"{name}.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_the_data_tools_refuse_an_empty_corpus(tmp_path):
    from hybrid.data.tokenizer import train_sentencepiece

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    tok = _tool("train_tokenizer", "--input", empty, "--output-prefix", tmp_path / "tok", "--vocab-size", 100,
                "--no-progress")
    assert tok.returncode != 0
    assert tok.stderr.strip().splitlines() == [
        "error: the corpus is empty: the input holds no line of text to train a tokenizer on; check --input "
        "(and --json-keys for jsonl)"], tok.stderr
    assert not (tmp_path / "tok.model").exists()

    model = train_sentencepiece([f"document number {i} has some words in it" for i in range(50)],
                                tmp_path / "spm", 60)
    pre = _tool("preprocess_data", "--input", empty, "--tokenizer-model", model, "--output-prefix",
                tmp_path / "out", "--no-progress")
    assert pre.returncode != 0
    lines = pre.stderr.strip().splitlines()
    assert len(lines) == 1 and "the corpus" in lines[0] and "is empty" in lines[0], pre.stderr
    assert not list(tmp_path.glob("out*"))


def _data_config(argv):
    config = parse_args([str(a) for a in argv])
    validate(config, world_size=1)
    return config


def test_data_path_with_the_file_extension_means_the_prefix(tmp_path):
    prefix = _dataset(tmp_path / "corpus_text_document", num_docs=20)
    for given in (f"{prefix}.bin", f"{prefix}.idx"):
        config = _data_config(TINY + ["--train-iters", "2", "--data-path", given])
        data = build_data(config, 16, 128, 2, 1, None, rank=0, barrier=lambda: None)
        assert len(data.train) == 2 and data.train.indexed.prefix == str(prefix)


def test_a_read_only_dataset_caches_its_indices_elsewhere(tmp_path, monkeypatch, capsys):
    data_dir = tmp_path / "readonly"
    data_dir.mkdir()
    prefix = _dataset(data_dir / "corpus", num_docs=20)
    # Not writable even for root: where the cache directory would go, a file.
    (data_dir / "index-cache").write_text("")
    data_dir.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    try:
        config = _data_config(TINY + ["--train-iters", "2", "--data-path", prefix])
        data = build_data(config, 16, 128, 2, 1, None, rank=0, barrier=lambda: None)
        assert len(data.train) == 2 and data.train[1]["tokens"].shape == (16,)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("notice: the index cache") and "--data-cache-path" in err[0], err
        assert list((tmp_path / "user-cache" / "hybrid" / "index-cache").rglob("*-description.json"))

        chosen = tmp_path / "chosen-cache"
        config = _data_config(TINY + ["--train-iters", "2", "--data-path", prefix, "--data-cache-path", chosen])
        build_data(config, 16, 128, 2, 1, None, rank=0, barrier=lambda: None)
        assert list(chosen.glob("*-description.json"))
    finally:
        data_dir.chmod(stat.S_IRWXU)


# ---- 7. seeding ---------------------------------------------------------------------------------------

def test_the_seed_reaches_python_and_numpy(monkeypatch):
    _single_process(monkeypatch)
    random.seed(0)
    np.random.seed(0)
    config = _data_config(MOCK + ["--train-iters", "1", "--seed", "77"])
    trainer = Trainer(config)
    try:
        assert random.random() == random.Random(77).random()
        assert np.random.rand() == np.random.RandomState(77).rand()
    finally:
        trainer.exit.restore()
        trainer.engine.close()
