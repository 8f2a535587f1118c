import pytest
import torch

from hybrid.topology import Topology
from hybrid.training.generate import _filter_logits, generate
from model_zoo import GPTConfig, GPTModel


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(_filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False]
    # top-p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it.
    assert torch.isfinite(_filter_logits(logits, 0, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter_logits(logits, 0, 0.9)).tolist() == [True, True, True, False]
    assert torch.isfinite(_filter_logits(logits, 0, 1.0)).all()


def test_greedy_generation_follows_the_argmax_and_stops_at_eod():
    config = GPTConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, seq_length=16)
    model = GPTModel(config, Topology.local(), seed=3).eval()
    out = generate(model, [1, 2, 3], 5, greedy=True)
    ids = [1, 2, 3]
    for _ in range(5):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[3:]
    assert generate(model, [1, 2, 3], 5, greedy=True, eod_id=out[0]) == out[:1]
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], 3)


# ---- the command line: bad input is one line naming the flag ----------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A weights-only checkpoint of the tiny GPT-2 and a SentencePiece model that fits its vocabulary."""
    from tests.convert.common import GPT2_CFG, randomized_state, write_weights_checkpoint
    from tests.data.testkit import train_tokenizer

    root = tmp_path_factory.mktemp("generate")
    write_weights_checkpoint(root / "ck", GPT2_CFG, randomized_state(GPT2_CFG), tp=1)
    return root, train_tokenizer(root, vocab_size=100, num_docs=100)


def _cli(saved, *extra, load=None, tokenizer=None):
    root, tok = saved
    return ["--load", str(load or root / "ck"), "--tokenizer-model", str(tokenizer or tok), "--max-new-tokens", "4",
            *extra]


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("generate: error: "), captured
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


def test_the_command_line_generates(saved, capsys):
    from hybrid.training.generate import main

    assert main(_cli(saved, "--prompt", "hello", "--seed", "3")) == 0
    assert main(_cli(saved, "--greedy", "--temperature", "0")) == 0  # the temperature is not used
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "0"], "--temperature must be > 0 for sampling, got 0; pass --greedy"),
    (["--temperature", "-1"], "--temperature must be > 0 for sampling, got -1"),
    (["--temperature", "nan"], "--temperature must be > 0 for sampling, got nan"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--top-k", "-1"], "--top-k must be >= 0 (0 disables it), got -1"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (1 disables it), got 0"),
    (["--top-p", "2"], "--top-p must be in (0, 1] (1 disables it), got 2"),
])
def test_bad_sampling_flags_are_refused_before_loading(flags, message, tmp_path, capsys):
    from hybrid.training.generate import main

    # nothing exists at --load or --tokenizer-model: the flags are checked first
    assert main(["--load", str(tmp_path / "nope"), "--tokenizer-model", str(tmp_path / "no.model"), *flags]) == 1
    assert message in _error_line(capsys)


def test_a_missing_or_damaged_checkpoint_or_tokenizer_is_one_line(saved, tmp_path, capsys):
    import shutil

    from hybrid.checkpoint import CheckpointReader
    from hybrid.training.generate import main

    root, tok = saved
    assert main(_cli(saved, load=tmp_path / "nope")) == 1
    err = _error_line(capsys)
    assert f"checkpoint path {tmp_path / 'nope'} does not exist" in err and "(--load)" in err, err
    assert main(_cli(saved, tokenizer=tmp_path / "no.model")) == 1
    assert "no.model not found" in _error_line(capsys)
    (tmp_path / "corpus.jsonl").write_text('{"text": "not a model"}\n')
    assert main(_cli(saved, tokenizer=tmp_path / "corpus.jsonl")) == 1
    assert "corpus.jsonl is not a SentencePiece model" in _error_line(capsys)
    assert main(_cli(saved, tokenizer=tmp_path)) == 1
    assert "is a directory" in _error_line(capsys)
    shutil.copytree(root / "ck", tmp_path / "ck")
    model = CheckpointReader(tmp_path / "ck").path / "model_tp00.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    assert main(_cli(saved, load=tmp_path / "ck")) == 1
    err = _error_line(capsys)
    assert "model_tp00.safetensors" in err and "truncated or damaged" in err and "(--load)" in err, err
