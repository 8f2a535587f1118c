"""tools/convert_checkpoint.py: every subcommand end to end, its progress bar, and its error exits."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

from hybrid.checkpoint import CheckpointReader
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
    engine.save_checkpoint(tmp_path / "ck", 1)
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
    assert "wrote GPT2LMHeadModel" in out and "--finetune" in out
    assert "copied the tokenizer (SentencePieceTokenizer) to" in out
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a pipeline target: one parameter index and one set of files per stage, the same model in them
    assert tool.main(["reshard", "--load", str(tmp_path / "tp2"), "--save", str(tmp_path / "pp2"), "--target-tp", "1",
                      "--pipeline-model-parallel-size", "2", "--pipeline-layers-per-stage", "0", "2",
                      "--no-progress"]) == 0
    reader = CheckpointReader(tmp_path / "pp2")
    assert (reader.layout.pp, reader.layout.tp, reader.layout.dp) == (2, 1, 2)
    first, last = ({e["name"] for e in reader.stage_param_index(s)} for s in (0, 1))
    assert not any(n.startswith("layers.") for n in first) and {"layers.0.mlp.in_proj.weight",
                                                                  "layers.1.mlp.in_proj.weight"} <= last
    assert first & last == {"embedding.word_embeddings.weight"}  # the tied copy on the last stage
    assert {"model_tp00_pp00.safetensors", "model_tp00_pp01.safetensors", "optim_tp00_dp01_pp01.pt",
            "rank_tp00_dp01_pp01.pt"} <= set(reader.manifest.files)
    assert tool.main(["to-fp32", "--load", str(tmp_path / "pp2"), "--output", str(tmp_path / "c.safetensors"),
                      "--no-progress"]) == 0
    c = load_file(tmp_path / "c.safetensors")
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)


def test_impossible_pipeline_targets_exit_with_status_1_and_one_line(tool, tmp_path, capsys):
    make_engine(GPT2_CFG, stage=1).save_checkpoint(tmp_path / "ck", 0)
    layers = GPT2_CFG.num_layers
    size = "--pipeline-model-parallel-size"
    cases = {
        (size, str(layers + 3)): f"cannot split {layers} layers over {layers + 3} pipeline parts",
        (size, "2", "--target-zero-stage", "3"): f"--target-zero-stage 3 with {size} 2: ZeRO stage 3 partitions the "
                                                 f"parameters",
        (size, "2", "--num-layers-per-virtual-pipeline-stage", str(layers)):
            f"--num-layers-per-virtual-pipeline-stage {layers} x pipeline_model_parallel_size 2 must divide",
        (size, "2", "--pipeline-layers-per-stage", "1"): "has 1 entries but the pipeline has 2 parts",
        (size, "0"): f"'pipeline.size' must be >= 1, got 0 (set by {size})",
    }
    for k, (flags, message) in enumerate(cases.items()):
        assert tool.main(["reshard", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / f"out{k}"),
                          "--target-tp", "1", *flags, "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("convert_checkpoint reshard: error: ") and err.count("\n") == 1, err
        assert message in err, err
        assert not (tmp_path / f"out{k}").exists()


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


def test_a_save_folder_in_use_by_a_job_is_refused_in_one_line(tmp_path):
    from hybrid.checkpoint.lock import SaveDirLock

    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), tp=2)
    busy = tmp_path / "busy"
    with SaveDirLock(busy):  # this process stands for a training job saving into busy/
        proc = subprocess.run([sys.executable, str(TOOL), "reshard", "--load", str(tmp_path / "ck"), "--save",
                               str(busy), "--target-tp", "1"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by another job" in lines[0] and str(os.getpid()) in lines[0], proc.stderr
    assert not any(p.name.startswith("iter_") for p in busy.iterdir())  # nothing written
    # once the job is gone the same command writes the checkpoint
    proc = subprocess.run([sys.executable, str(TOOL), "reshard", "--load", str(tmp_path / "ck"), "--save",
                           str(busy), "--target-tp", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (busy / "latest").exists() and not (busy / "save.lock").exists()


def _reseal(iter_dir: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and record its new size and sha256: damage no checksum can see."""
    import hashlib
    import json

    from hybrid.checkpoint.manifest import DIGEST_KEY, document_digest

    (iter_dir / name).write_bytes(data)
    doc = json.loads((iter_dir / "metadata.json").read_text())
    doc["files"][name].update(sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data))
    doc[DIGEST_KEY] = document_digest(doc)
    (iter_dir / "metadata.json").write_text(json.dumps(doc))


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"convert_checkpoint {command}: error: ") and err.count("\n") == 1, err
    return err


class _NotATensor:
    """Stands for any pickled object in a pytorch_model.bin (code could hide in its class)."""


def test_damaged_hf_weight_files_are_refused_in_one_line(tool, tmp_path, capsys):
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), tp=1)
    assert tool.main(["to-hf", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"),
                      "--no-progress"]) == 0
    capsys.readouterr()
    weights = tmp_path / "hf" / "model.safetensors"
    good = weights.read_bytes()

    def from_hf(save):
        assert tool.main(["from-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / save),
                          "--no-progress"]) == 1
        assert not (tmp_path / save).exists()
        return _one_error_line(capsys, "from-hf")

    for k, damaged in enumerate((good[:4], good[: len(good) // 2], b"garbage" * 100)):
        weights.write_bytes(damaged)
        err = from_hf(f"st{k}")
        assert f"{weights} is not a readable safetensors file (Error while deserializing header" in err, err
    # the older pytorch_model.bin: an object that is not a tensor is refused without unpickling it
    weights.unlink()
    tensors = load(good)
    torch.save({**tensors, "extra": _NotATensor()}, tmp_path / "hf" / "pytorch_model.bin")
    err = from_hf("bin")
    assert f"{tmp_path / 'hf' / 'pytorch_model.bin'} holds pickled objects other than tensors" in err, err
    assert "_NotATensor" in err and "never unpickles code" in err and "weights_only=False" not in err, err
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"garbage" * 100)
    assert "pytorch_model.bin holds pickled objects other than tensors" in from_hf("bin2")
    torch.save(tensors, tmp_path / "hf" / "pytorch_model.bin")
    data = (tmp_path / "hf" / "pytorch_model.bin").read_bytes()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert "pytorch_model.bin is not a readable PyTorch weights file" in from_hf("bin3")


def test_a_damaged_optimizer_file_whose_checksum_matches_is_one_line(tool, tmp_path, capsys):
    engine = make_engine(GPT2_CFG, precision="bf16", stage=1)  # to-fp32 reads the fp32 masters
    train(engine, 1)
    engine.save_checkpoint(tmp_path / "ck", 1)
    iter_dir = CheckpointReader(tmp_path / "ck").path
    _reseal(iter_dir, "optim_tp00_dp00.pt", b"garbage" * 100)
    for command, extra in (("to-fp32", ["--output", str(tmp_path / "x.safetensors")]),
                           ("reshard", ["--save", str(tmp_path / "rs"), "--target-tp", "1"])):
        assert tool.main([command, "--load", str(tmp_path / "ck"), *extra, "--no-progress"]) == 1
        err = _one_error_line(capsys, command)
        assert f"checkpoint file {iter_dir / 'optim_tp00_dp00.pt'} cannot be read (not a PyTorch zip archive)" \
            in err and "load another iteration" in err, err
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "rs").exists()


def test_zero_bucket_size_is_refused_like_a_negative_one(tool, tmp_path, capsys):
    make_engine(GPT2_CFG, stage=1).save_checkpoint(tmp_path / "ck", 0)
    for size in ("0", "-7"):
        assert tool.main(["reshard", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / f"out{size}"),
                          "--target-tp", "1", "--zero-bucket-size", size, "--no-progress"]) == 1
        err = _one_error_line(capsys, "reshard")
        assert f"--zero-bucket-size must be an integer >= 1, got {size}" in err, err
        assert not (tmp_path / f"out{size}").exists()


@pytest.mark.parametrize("name,command", [("model_tp00.safetensors", "to-fp32"), ("rank_tp00_dp00.pt", "reshard")])
def test_a_damaged_model_or_rank_file_whose_checksum_matches_is_one_line(tool, tmp_path, capsys, name, command):
    engine = make_engine(GPT2_CFG, stage=1)
    train(engine, 1)
    engine.save_checkpoint(tmp_path / "ck", 1)
    _reseal(CheckpointReader(tmp_path / "ck").path, name, b"garbage" * 100)
    extra = {"to-fp32": ["--output", str(tmp_path / "x.safetensors")],
             "reshard": ["--save", str(tmp_path / "rs"), "--target-tp", "1", "--target-dp", "2"]}[command]
    assert tool.main([command, "--load", str(tmp_path / "ck"), *extra, "--no-progress"]) == 1
    assert name in _one_error_line(capsys, command)
