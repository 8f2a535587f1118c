"""tools/preprocess_data.py: output contents, bad lines (skip/abort), worker invariance."""

import json

import numpy as np
import pytest

from hybrid.data.indexed import IndexedDataset
from hybrid.data.preprocess import BadInputError, preprocess
from hybrid.data.tokenizer import SentencePieceTokenizer
from tests.data.testkit import load_tool, synthetic_documents, train_tokenizer, write_jsonl

tool = load_tool("preprocess_data")


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def corpus_with_bad_lines(tmp_path):
    docs = synthetic_documents(12, seed=2)
    lines = [json.dumps({"text": d, "meta": i}) for i, d in enumerate(docs)]
    lines.insert(3, "{not json")  # line 4
    lines.insert(7, json.dumps({"body": "no text key"}))  # line 8
    lines.insert(9, "")  # line 10: blank, not a record
    lines.insert(11, json.dumps({"text": 17}))  # line 12
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, docs


def _args(inp, model, out, *extra):
    return ["--input", str(inp), "--tokenizer-model", str(model), "--output-prefix", str(out), "--no-progress",
            *extra]


def test_documents_are_the_tokenizer_output(tmp_path, tok_model):
    docs = synthetic_documents(30, seed=3)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    assert tool.main(_args(corpus, tok_model, tmp_path / "out", "--append-eod")) == 0
    ds = IndexedDataset(tmp_path / "out_text_document")
    tok = SentencePieceTokenizer(tok_model)
    assert ds.dtype == np.uint16 and len(ds) == ds.num_documents == len(docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == tok.encode(doc) + [tok.eod_id]


def test_abort_is_the_default_and_names_the_line(tmp_path, tok_model, corpus_with_bad_lines, capsys):
    path, _ = corpus_with_bad_lines
    assert tool.main(_args(path, tok_model, tmp_path / "out")) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:4: invalid JSON" in err and "--on-bad-line skip" in err
    assert not list(tmp_path.glob("out*"))  # nothing half-written is left


def test_abort_with_workers_stops_the_pool_and_writes_nothing(tmp_path, tok_model, corpus_with_bad_lines):
    path, _ = corpus_with_bad_lines
    with pytest.raises(BadInputError, match=r"bad\.jsonl:4: invalid JSON"):
        preprocess(str(path), tok_model, str(tmp_path / "out"), workers=2, chunk_docs=2, progress=False)
    assert not list(tmp_path.glob("out*"))


def test_skip_counts_and_lists_bad_lines(tmp_path, tok_model, corpus_with_bad_lines):
    path, docs = corpus_with_bad_lines
    result = preprocess(str(path), tok_model, str(tmp_path / "out"), on_bad_line="skip", progress=False)
    assert [(b.line, b.reason) for b in result.bad_lines] == [
        (4, "invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
        (8, "missing key 'text'"),
        (12, "key 'text' holds int, expected a string"),
    ]
    assert "skipped 3 bad line(s)" in result.summary() and "line 8: missing key 'text'" in result.summary()
    ds = IndexedDataset(tmp_path / "out_text_document")
    tok = SentencePieceTokenizer(tok_model)
    assert result.documents == len(ds) == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(d) for d in docs]


def test_skip_through_the_cli(tmp_path, tok_model, corpus_with_bad_lines, capsys):
    path, docs = corpus_with_bad_lines
    assert tool.main(_args(path, tok_model, tmp_path / "o", "--on-bad-line", "skip")) == 0
    out = capsys.readouterr().out
    assert "skipped 3 bad line(s)" in out and "line 4: invalid JSON" in out and "line 12:" in out
    assert len(IndexedDataset(tmp_path / "o_text_document")) == len(docs)


def test_invalid_utf8_is_a_bad_line(tmp_path, tok_model):
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(BadInputError, match=r"u\.jsonl:2: invalid UTF-8"):
        preprocess(str(path), tok_model, str(tmp_path / "o"), progress=False)


def test_multi_worker_output_is_byte_identical(tmp_path, tok_model):
    docs = synthetic_documents(600, seed=7, max_words=40)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    outputs = {}
    for workers in (1, 2, 3):
        prefix = tmp_path / f"w{workers}"
        # Small chunks: many chunks in flight, so reordering would show.
        result = preprocess(str(corpus), tok_model, str(prefix), workers=workers, append_eod=True,
                            progress=False, chunk_docs=7)
        assert result.documents == len(docs)
        stem = f"{prefix}_text_document"
        outputs[workers] = (open(stem + ".bin", "rb").read(), open(stem + ".idx", "rb").read())
    assert outputs[1] == outputs[2] == outputs[3]


def test_plain_text_blocks_and_several_keys(tmp_path, tok_model):
    tok = SentencePieceTokenizer(tok_model)
    text = tmp_path / "c.txt"
    text.write_text("\n\nfirst doc line one\nline two\n\n\n\nsecond doc\n  \nthird\n\n")
    preprocess(str(text), tok_model, str(tmp_path / "t"), progress=False)
    ds = IndexedDataset(tmp_path / "t_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [
        tok.encode("first doc line one\nline two"), tok.encode("second doc"), tok.encode("third")]
    corpus = tmp_path / "k.jsonl"
    corpus.write_text(json.dumps({"q": "question one", "a": "answer one"}) + "\n" +
                      json.dumps({"q": "question two", "a": "answer two"}) + "\n")
    assert tool.main(_args(corpus, tok_model, tmp_path / "k", "--json-keys", "q", "a")) == 0
    assert IndexedDataset(tmp_path / "k_q_document")[1].tolist() == tok.encode("question two")
    assert IndexedDataset(tmp_path / "k_a_document")[0].tolist() == tok.encode("answer one")


def test_bad_arguments_are_reported(tmp_path, tok_model, capsys):
    assert tool.main(_args(tmp_path / "missing.jsonl", tok_model, tmp_path / "o")) == 1
    assert "missing.jsonl not found (--input)" in capsys.readouterr().err
    corpus = write_jsonl(tmp_path / "c.jsonl", ["a"])
    assert tool.main(_args(corpus, tmp_path / "no.model", tmp_path / "o")) == 1
    assert "tokenizer model" in capsys.readouterr().err
    assert tool.main(_args(corpus, tok_model, tmp_path / "o", "--workers", "2", "--worker-timeout", "0")) == 1
    assert "worker timeout must be > 0 seconds (--worker-timeout)" in capsys.readouterr().err


def test_an_output_prefix_under_a_file_is_one_line(tmp_path, tok_model, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(5, seed=8))
    (tmp_path / "FILE").write_text("in the way\n")
    for prefix in (tmp_path / "FILE" / "x", tmp_path / "FILE" / "a" / "x"):
        assert tool.main(_args(corpus, tok_model, prefix)) == 1
        err = capsys.readouterr().err
        assert err == f"error: --output-prefix {prefix}: {tmp_path / 'FILE'} is a file, not a directory; choose " \
                      f"another --output-prefix\n", err
    assert (tmp_path / "FILE").read_text() == "in the way\n"


@pytest.mark.parametrize("value", ["0", "-3"])
def test_log_interval_below_one_is_refused(tmp_path, tok_model, capsys, value):
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(5, seed=8))
    assert tool.main(_args(corpus, tok_model, tmp_path / "o", "--log-interval", value)) == 1
    assert capsys.readouterr().err == f"error: --log-interval must be >= 1 (documents between docs/s refreshes), " \
                                      f"got {value}\n"
    assert not list(tmp_path.glob("o_*"))
