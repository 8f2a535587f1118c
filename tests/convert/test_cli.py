"""tools/convert_checkpoint.py: every subcommand end to end, its progress bar, and its error exits."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint import CheckpointReader
from hybrid.engine.checkpoint import save_engine
from tests.convert.common import GPT2_CFG, make_engine, randomized_state, train, write_weights_checkpoint
from tests.data.testkit import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_checkpoint.py"


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _tool()


def test_every_subcommand_round_trips(tool, tmp_path, capsys):
    engine = make_engine(GPT2_CFG, stage=1)
    train(engine, 1)
    save_engine(engine, tmp_path / "ck", 1)
    assert tool.main(["reshard", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "tp2"),
                      "--target-tp", "2", "--target-dp", "2", "--target-zero-stage", "2", "--no-progress"]) == 0
    layout = CheckpointReader(tmp_path / "tp2").layout
    assert (layout.tp, layout.dp, layout.zero_stage) == (2, 2, 2)
    assert tool.main(["to-fp32", "--load", str(tmp_path / "tp2"), "--output", str(tmp_path / "a.safetensors"),
                      "--no-progress"]) == 0
    tokenizer = train_tokenizer(tmp_path, vocab_size=100, num_docs=100)
    assert tool.main(["to-hf", "--load", str(tmp_path / "tp2"), "--output", str(tmp_path / "hf"),
                      "--max-shard-size", "100KB", "--tokenizer-model", tokenizer, "--no-progress"]) == 0
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == Path(tokenizer).read_bytes()
    assert tool.main(["from-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "back"), "--tp", "2",
                      "--no-progress"]) == 0
    assert tool.main(["to-fp32", "--load", str(tmp_path / "back"), "--output", str(tmp_path / "b.safetensors"),
                      "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "wrote GPT2LMHeadModel" in out and "copied the SentencePiece tokenizer to" in out and "--finetune" in out
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_errors_exit_with_status_1_and_one_line(tool, tmp_path, capsys):
    assert tool.main(["to-fp32", "--load", str(tmp_path / "nothing"), "--output", str(tmp_path / "x.safetensors"),
                      "--no-progress"]) == 1
    assert "convert_checkpoint to-fp32: error: checkpoint path" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["T5ForConditionalGeneration"]}')
    assert tool.main(["from-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 1
    assert "unknown architecture ['T5ForConditionalGeneration']" in capsys.readouterr().err


def test_runs_as_a_script_with_a_progress_bar(tmp_path):
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), tp=2)
    proc = subprocess.run([sys.executable, str(TOOL), "to-fp32", "--load", str(tmp_path / "ck"), "--output",
                           str(tmp_path / "full.safetensors")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "to-fp32" in proc.stderr and "100%" in proc.stderr  # tqdm draws on stderr
    assert load_file(tmp_path / "full.safetensors").keys() == set(randomized_state(GPT2_CFG))
