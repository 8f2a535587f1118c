"""tools/train_tokenizer.py: bad input is one line naming the flag or the line, never SentencePiece's own text."""

import json

import pytest

from tests.data.testkit import load_tool, synthetic_documents, write_jsonl

train_tool = load_tool("train_tokenizer")


def _fails(tmp_path, capsys, argv, *parts):
    rc = train_tool.main(["--output-prefix", str(tmp_path / "t"), "--vocab-size", "100", "--no-progress", *argv])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "INTERNAL" not in err and "trainer_interface" not in err, err
    for part in parts:
        assert part in err, err
    assert not (tmp_path / "t.model").exists() and not (tmp_path / "t.vocab").exists()
    return err


@pytest.mark.parametrize("progress", [[], ["--no-progress"]])
def test_a_bad_jsonl_line_is_reported_as_raised_in_one_line(tmp_path, capsys, progress):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    rc = train_tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "t"), "--vocab-size", "50",
                          *progress])
    assert rc == 1
    err = capsys.readouterr().err.splitlines()[-1:]  # a progress bar, if any, ends on its own line first
    assert err == [f"error: {corpus}:2: invalid JSON (Expecting property name enclosed in double quotes at column "
                   f"2); fix the line or pass --on-bad-line skip"], err
    assert not (tmp_path / "t.model").exists()


@pytest.mark.parametrize("flags,message", [
    (["--num-threads", "-1"], "--num-threads must be 1 to 1024, got -1"),
    (["--num-threads", "0"], "--num-threads must be 1 to 1024, got 0"),
    (["--max-sentence-length", "0"], "--max-sentence-length must be 10 to 1073741824 bytes, got 0"),
    (["--input-sentence-size", "-1"], "--input-sentence-size must be 0 (use every line) or at least 101, got -1"),
    (["--input-sentence-size", "100"], "--input-sentence-size must be 0 (use every line) or at least 101, got 100"),
    (["--character-coverage", "0.5"], "--character-coverage must be 0.98 to 1.0"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-size must be at least 257 for a byte-level BPE (256 byte "
                                               "symbols and <|endoftext|>), got 100"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "300", "--min-frequency", "0"],
     "--min-frequency must be >= 1, got 0"),
])
def test_out_of_range_flags_name_the_flag(tmp_path, capsys, flags, message):
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(50, seed=3))
    _fails(tmp_path, capsys, ["--input", str(corpus), *flags], message)


def test_sentencepiece_refusals_name_the_flag(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(50, seed=3))
    _fails(tmp_path, capsys, ["--input", str(corpus), "--vocab-size", "100000"],
           "--vocab-size 100000 is too large for this corpus: SentencePiece can make at most")
    _fails(tmp_path, capsys, ["--input", str(corpus), "--max-sentence-length", "10"],
           "no line of the input is at most --max-sentence-length 10 bytes long")


def test_an_output_prefix_under_a_file_is_one_line(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(50, seed=3))
    (tmp_path / "FILE").write_text("in the way\n")
    prefix = tmp_path / "FILE" / "t"
    rc = train_tool.main(["--input", str(corpus), "--output-prefix", str(prefix), "--vocab-size", "100",
                          "--no-progress"])
    assert rc == 1
    assert capsys.readouterr().err == f"error: --output-prefix {prefix}: {tmp_path / 'FILE'} is a file, not a " \
                                      f"directory; choose another --output-prefix\n"
