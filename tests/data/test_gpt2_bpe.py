"""GPT-2's byte-level BPE (``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``): the ids of the
original GPT-2 encoder, the settings' one rule, preprocessing, and a run from corpus to generated text.

The reference is ``transformers``' pure-Python ``GPT2Tokenizer`` (the port of GPT-2's own ``encoder.py``), read
from the same files; the files are learned here from a synthetic corpus (nothing is downloaded).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.data import IndexedDataset, preprocess
from hybrid.data.errors import DataError, DataFileNotFoundError
from hybrid.data.gpt2_bpe import EOD_TOKEN, GPT2BPETokenizer, train_gpt2_bpe
from hybrid.tokenizer_files import TokenizerSpec
from tests.data.testkit import synthetic_documents, write_jsonl

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello world! It's 2026: the naïve café serves crème brûlée.",
    "  leading spaces,\ttabs\tand\nnew\n\nlines   trailing   ",
    "Numbers 123456 and 3.14159, contractions we'll they're I'd, CAPS and MiXeD.",
    "Unicode: Ελληνικά, русский, 日本語, emoji 😀👍🏽, and a zero-width\u200bjoiner.",
    f"the EOD string {EOD_TOKEN} inside a text is text",
    "",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    corpus = synthetic_documents(300, seed=5) + TEXTS[:4]
    return train_gpt2_bpe(corpus, tmp_path_factory.mktemp("bpe") / "gpt2", vocab_size=700)


def test_ids_are_the_original_gpt2_encoders(files):
    from transformers import GPT2Tokenizer

    ours, ref = GPT2BPETokenizer(*files), GPT2Tokenizer(*files)
    corpus = synthetic_documents(50, seed=11)
    for text in TEXTS + corpus:
        ids = ours.encode(text)
        if EOD_TOKEN not in text:  # transformers makes that string the special token; GPT-2's encoder does not
            assert ids == ref.encode(text), text
        assert ours.decode(ids) == text  # byte-level: every string survives the round trip
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    assert max(max(ours.encode(t), default=0) for t in corpus) < ours.vocab_size == 700


def test_eod_is_endoftext_and_that_string_in_a_text_is_text(files):
    tok = GPT2BPETokenizer(*files)
    assert tok.id_to_piece(tok.eod_id) == EOD_TOKEN
    assert tok.eod_id not in tok.encode(TEXTS[4])  # as in Megatron: only --append-eod puts it between documents


def test_file_errors_name_the_flag(files, tmp_path):
    vocab, merges = files
    with pytest.raises(DataFileNotFoundError, match=r"--merge-file .*nope\.txt: no such file"):
        GPT2BPETokenizer(vocab, tmp_path / "nope.txt")
    (tmp_path / "v.json").write_text("not json")
    with pytest.raises(DataError, match=r"--vocab-file .*v\.json / --merge-file .* are not a GPT-2 BPE vocabulary"):
        GPT2BPETokenizer(tmp_path / "v.json", merges)
    vocab_no_eod = {k: v for k, v in json.loads(Path(vocab).read_text()).items() if k != EOD_TOKEN}
    (tmp_path / "v2.json").write_text(json.dumps(vocab_no_eod))
    with pytest.raises(DataError, match=r"has no <\|endoftext\|> token"):
        _ = GPT2BPETokenizer(tmp_path / "v2.json", merges).eod_id
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        train_gpt2_bpe(["text"], tmp_path / "small", vocab_size=100)
    with pytest.raises(DataError, match="the corpus is empty"):
        train_gpt2_bpe([], tmp_path / "empty", vocab_size=300)


@pytest.mark.parametrize("settings,problem", [
    (dict(), None),
    (dict(tokenizer_model="m"), None),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v", merge_file="m"), None),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v"),
     ("GPT2BPETokenizer reads --vocab-file and --merge-file; --merge-file is missing", ("merge_file",))),
    (dict(vocab_file="v", merge_file="m"), None),  # the type the files say, as Megatron's GPT-2 scripts give them
    (dict(tokenizer_type="SentencePieceTokenizer", vocab_file="v", merge_file="m"),
     ("--vocab-file is a file of GPT2BPETokenizer, but --tokenizer-type is SentencePieceTokenizer; set "
      "--tokenizer-type to GPT2BPETokenizer, or give --tokenizer-model", ("vocab_file", "tokenizer_type"))),
    (dict(merge_file="m"), ("GPT2BPETokenizer reads --vocab-file and --merge-file; --vocab-file is missing",
                            ("vocab_file",))),
    (dict(tokenizer_type="gpt2bpetokenizer", tokenizer_model="m", vocab_file="v", merge_file="m"),
     ("--tokenizer-model is a file of SentencePieceTokenizer or HuggingFaceTokenizer or TikTokenizer, but "
      "--tokenizer-type is GPT2BPETokenizer; set --tokenizer-type to SentencePieceTokenizer or HuggingFaceTokenizer "
      "or TikTokenizer, or give "
      "--vocab-file and --merge-file",
      ("tokenizer_model", "tokenizer_type"))),
])
def test_the_files_must_fit_the_type(settings, problem):
    spec = TokenizerSpec(**settings)
    assert spec.problem() == problem
    assert spec.given == any(settings.get(s) for s in ("tokenizer_model", "vocab_file", "merge_file"))


def test_the_config_reads_megatrons_flags_and_refuses_a_misfit():
    from hybrid.config import ConfigError, config_from_command_line

    cfg = config_from_command_line(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json",
                                    "--merge-file", "m.txt"])
    assert cfg.data.tokenizer == TokenizerSpec("gpt2bpetokenizer", None, "v.json", "m.txt")
    # Megatron's GPT-2 scripts give the files alone: the type is the one they say
    alone = config_from_command_line(["--vocab-file", "v.json", "--merge-file", "m.txt"])
    assert alone.data.tokenizer == cfg.data.tokenizer and alone.data.tokenizer.name == "GPT2BPETokenizer"
    with pytest.raises(ConfigError, match=r"'data\.vocab_file' is a file of GPT2BPETokenizer, but "
                                          r"'data\.tokenizer_type' is SentencePieceTokenizer.*"
                                          r"\(set by --vocab-file, --tokenizer-type\)"):
        config_from_command_line(["--tokenizer-type", "sentencepiecetokenizer", "--vocab-file", "v.json",
                                  "--merge-file", "m.txt"])


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocessing_appends_endoftext_and_matches_direct_encoding(files, tmp_path, workers):
    docs = synthetic_documents(40, seed=7)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=files[0], merge_file=files[1])
    result = preprocess(str(corpus), spec, str(tmp_path / "out"), workers=workers, append_eod=True,
                        chunk_docs=8, progress=False)
    tok = GPT2BPETokenizer(*files)
    ds = IndexedDataset(result.output_prefixes["text"])
    assert len(ds) == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], tok.encode(doc) + [tok.eod_id])


def test_from_corpus_to_generated_text(files, tmp_path):
    """The tools and the trainer with GPT-2's flags: learn the files, preprocess, train 6 iterations, generate."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    corpus = write_jsonl(tmp_path / "c.jsonl", synthetic_documents(300, seed=9))

    def run(*argv):
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    prefix = tmp_path / "tok" / "gpt2"
    run("tools/train_tokenizer.py", "--input", str(corpus), "--output-prefix", str(prefix), "--vocab-size", "500",
        "--tokenizer-type", "GPT2BPETokenizer", "--no-progress")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{prefix}-vocab.json",
            "--merge-file", f"{prefix}-merges.txt"]
    run("tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "data"),
        "--append-eod", "--no-progress", *gpt2)
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "hybrid.train", *gpt2,
              "--data-path", str(tmp_path / "data_text_document"), "--split", "90,10,0", "--num-layers", "1",
              "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
              "--train-iters", "6", "--lr", "1e-3", "--log-interval", "3", "--eval-interval", "6", "--eval-iters",
              "1", "--eod-mask-loss", "--save", str(tmp_path / "ck"))
    assert "iteration 6/6" in out and "validation at iteration 6" in out
    # the model's vocabulary came from the tokenizer (500, padded to 512)
    text = run("-m", "hybrid.training.generate", "--load", str(tmp_path / "ck"), *gpt2, "--prompt", "the",
               "--max-new-tokens", "8", "--greedy")
    assert text.startswith("the")
