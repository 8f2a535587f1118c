"""Tokenizer training (tool) and the SentencePiece wrapper."""

import json
import re

import pytest

from hybrid.data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from tests.data.testkit import load_tool, synthetic_documents, write_jsonl

train_tool = load_tool("train_tokenizer")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_from_jsonl_and_round_trip(tmp_path, model_type):
    docs = synthetic_documents(300, seed=4)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    rc = train_tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "256",
                          "--model-type", model_type, "--no-progress"])
    assert rc == 0
    tok = SentencePieceTokenizer(tmp_path / "tok.model")
    assert tok.vocab_size == 256
    assert tok.id_to_piece(tok.eod_id) == "</s>" and tok.eod_id == 2 and tok.unk_id == 0
    for doc in docs[:20]:
        ids = tok.encode(doc)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == doc
    # Learned merges compress: fewer tokens than characters.
    assert sum(len(tok.encode(d)) for d in docs) < 0.6 * sum(len(d) for d in docs)
    assert tok.encode_batch(docs[:5]) == [tok.encode(d) for d in docs[:5]]


def test_train_from_plain_text_blocks(tmp_path):
    docs = synthetic_documents(200, seed=5)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    rc = train_tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "t"), "--vocab-size", "200",
                          "--no-progress"])
    assert rc == 0 and SentencePieceTokenizer(tmp_path / "t.model").vocab_size == 200


def test_training_is_deterministic(tmp_path):
    docs = synthetic_documents(200, seed=6)
    a = SentencePieceTokenizer(train_sentencepiece(docs, tmp_path / "a", 220))
    b = SentencePieceTokenizer(train_sentencepiece(docs, tmp_path / "b", 220))
    assert [a.id_to_piece(i) for i in range(220)] == [b.id_to_piece(i) for i in range(220)]


def test_bad_jsonl_line_aborts_training(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    rc = train_tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "t"), "--vocab-size", "50",
                          "--no-progress"])
    assert rc == 1
    assert "c.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert not (tmp_path / "t.model").exists()


def test_missing_model_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer model .*nope\.model not found"):
        SentencePieceTokenizer(tmp_path / "nope.model")


def test_a_file_that_is_no_tokenizer_model_is_a_data_error(tmp_path):
    from hybrid.data.errors import DataError

    text = tmp_path / "corpus.jsonl"
    text.write_text('{"text": "not a model"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl is not a SentencePiece model.*--tokenizer-model"):
        SentencePieceTokenizer(text)
    with pytest.raises(DataError, match=r"is a directory.*--tokenizer-model"):
        SentencePieceTokenizer(tmp_path)


def test_invalid_training_options():
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(["a"], "/tmp/never", 100, model_type="wordpiece")
    with pytest.raises(ValueError, match="character_coverage"):
        train_sentencepiece(["a"], "/tmp/never", 100, character_coverage=0)


@pytest.mark.parametrize("option, value, message", [
    ("character_coverage", 0.5, "character_coverage must be 0.98 to 1.0"),  # in (0, 1] but below SentencePiece's
    ("num_threads", 0, "num_threads must be 1 to 1024"),
    ("max_sentence_length", 5, "max_sentence_length must be 10 to"),
    ("input_sentence_size", 50, "input_sentence_size must be 0 (use every line) or at least 101"),
])
def test_options_outside_sentencepiece_bounds_are_refused_before_the_input_is_read(tmp_path, option, value, message):
    def corpus():
        raise AssertionError("the corpus was read before the options were checked")
        yield  # a generator: raises only when iterated

    with pytest.raises(ValueError, match=re.escape(message)):
        train_sentencepiece(corpus(), tmp_path / "t", 100, **{option: value})
    assert not list(tmp_path.iterdir())
