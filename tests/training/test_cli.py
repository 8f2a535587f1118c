"""The trainer's command line: bad settings fail before any training, with errors that name the flag."""

import os
import subprocess
import sys

import pytest

from hybrid.training.arguments import ArgumentError, parse_args, validate
from hybrid.training.trainer import main

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "512"]


def _fails(argv, world, match, monkeypatch, capsys=None):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code != 0
    assert match in str(info.value.code), info.value.code


@pytest.mark.parametrize("argv,world,match", [
    (MODEL + ["--mock-data", "--train-iters", "2", "--tensor-model-parallel-size", "3"], 4,
     "world size 4 is not divisible by --tensor-model-parallel-size 3"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "6"], 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (MODEL + ["--train-iters", "2"], 1, "--data-path is required"),
    (MODEL + ["--train-iters", "2", "--data-path", "/nonexistent/corpus_text_document"], 1,
     "/nonexistent/corpus_text_document.bin does not exist"),
    (MODEL + ["--mock-data"], 1, "--train-iters is required"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--bf16", "--fp16"], 1, "mutually exclusive"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--num-attention-heads", "8", "--tensor-model-parallel-size",
              "3"], 3, "num_heads=8 must be divisible by the tensor-parallel size tp=3"),
    (["--model", "gpt2-smal", "--mock-data", "--train-iters", "2"], 1, "did you mean 'gpt2-small'"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--save-interval", "5"], 1, "--save-interval needs --save"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--sequence-parallel"], 1,
     "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--initial-loss-scale", "1000"], 1, "power of two"),
    (MODEL + ["--mock-data", "--train-iters", "2", "--zero-stage", "0", "--offload-optimizer", "cpu"], 1,
     "--offload-optimizer cpu needs --zero-stage 1, 2 or 3"),
])
def test_bad_settings_exit_before_training(argv, world, match, monkeypatch):
    _fails(argv, world, match, monkeypatch)


def test_config_file_with_flag_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 3\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nlr: 0.5\n"
                   "data_path: [0.3, a, 0.7, b]\n")
    args = parse_args(["--config", str(cfg), "--lr", "0.25"])
    assert (args.num_layers, args.hidden_size, args.lr) == (3, 64, 0.25)
    assert args.data_path == ["0.3", "a", "0.7", "b"]


def test_config_file_unknown_key_suggests(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text('{"hiden_size": 64}')
    with pytest.raises(ArgumentError, match="unknown setting 'hiden_size'; did you mean 'hidden_size'"):
        parse_args(["--config", str(cfg)])


def test_unknown_flag_is_rejected():
    proc = subprocess.run([sys.executable, "-m", "hybrid.train", "--hiden-size", "64"], capture_output=True,
                          text=True, env={**os.environ, "WORLD_SIZE": "1"})
    assert proc.returncode != 0
    assert "unrecognized arguments: --hiden-size" in proc.stderr


def test_valid_settings_pass():
    args = parse_args(MODEL + ["--mock-data", "--train-iters", "4", "--tensor-model-parallel-size", "2",
                               "--global-batch-size", "8", "--micro-batch-size", "2"])
    validate(args, world_size=4)
    assert args.precision == "fp32" and args.recompute == "none"
