"""Megatron-LM's TikTokenizer: a vocabulary file in its format made here, encoded through hybrid's loader and
compared with byte-level BPE written out in the test (pieces by Megatron's pattern, then the lowest-ranked merge
first, ids shifted by the special tokens), the special ids, decoding, the config and the file's errors."""

import base64
import json

import pytest

tiktoken = pytest.importorskip("tiktoken")
regex = pytest.importorskip("regex")  # tiktoken's pattern syntax (\p{L}, possessive ++), for the reference split

from hybrid.config import ConfigError, config_from_command_line  # noqa: E402
from hybrid.data.errors import DataError  # noqa: E402
from hybrid.data.tiktokenizer import PATTERNS, TikTokenizer  # noqa: E402
from hybrid.data.tokenizer_choice import load_tokenizer  # noqa: E402

# each merge the join of two earlier tokens, as BPE makes them (tiktoken takes a whole piece that is a token at
# once, which BPE would reach too)
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"12"]


def write_vocab(path, merges=MERGES, mangle=None):
    tokens = [bytes([i]) for i in range(256)] + list(merges)
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
               for i, t in enumerate(tokens)]
    if mangle:
        mangle(entries)
    path.write_text(json.dumps(entries))
    return path


def reference_encode(text, pattern, ranks, shift):
    """Byte-level BPE: split by the pattern, then in each piece merge the adjacent pair whose merged bytes have
    the lowest rank until none is a token."""
    ids = []
    for piece in regex.findall(PATTERNS[pattern], text):
        parts = [bytes([b]) for b in piece.encode()]
        while True:
            pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] + shift for p in parts]
    return ids


TEXTS = ["hello world", "Hello World 123!", "hellohello  world\n\nworld's", "ünïcödé hello 12 3",
         "the  HELLO wOrld\r\n", ""]


@pytest.mark.parametrize("pattern", ["v1", "v2"])
@pytest.mark.parametrize("num_special", [3, 1000])
def test_encoding_is_byte_level_bpe_over_megatrons_pattern(tmp_path, pattern, num_special):
    path = write_vocab(tmp_path / "vocab.json")
    tok = TikTokenizer(path, pattern, num_special)
    ranks = {t: i for i, t in enumerate([bytes([i]) for i in range(256)] + MERGES)}
    assert tok.vocab_size == num_special + 256 + len(MERGES)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference_encode(text, pattern, ranks, num_special), text
        assert tok.decode(ids) == text
    assert tok.encode("hello world") == [256 + 3 + num_special, 256 + 8 + num_special]  # "hello", " world"
    assert (tok.unk_id, tok.bos_id, tok.eod_id) == (0, 1, 2)
    assert tok.id_to_piece(2) == "</s>" and tok.id_to_piece(num_special + 256 + 3) == "hello"
    assert tok.encode("</s>") == reference_encode("</s>", pattern, ranks, num_special)  # a special is plain text


def test_the_two_patterns_split_differently():
    # v2 keeps a capitalised word's upper and lower case together as one piece of letters after an optional
    # punctuation mark, v1 takes any letters; a digit run is one piece per digit in both
    assert regex.findall(PATTERNS["v1"], "HeLLo 42") == ["HeLLo", " ", "4", "2"]
    assert regex.findall(PATTERNS["v2"], "HeLLo 42") == ["He", "LLo", " ", "4", "2"]


def test_the_trainers_settings_load_it(tmp_path):
    path = write_vocab(tmp_path / "vocab.json")
    cfg = config_from_command_line(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                    "--seq-length", "32", "--micro-batch-size", "1", "--mock-data",
                                    "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path),
                                    "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", "8"])
    tok = load_tokenizer(cfg.data.tokenizer)
    assert isinstance(tok, TikTokenizer) and tok.vocab_size == 8 + 256 + len(MERGES)
    with pytest.raises(ConfigError, match=r"TikTokenizer splits text by Megatron's pattern before its merges: give "
                                          r"'data.tiktoken_pattern' v1 or v2"):
        config_from_command_line(["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path)])


@pytest.mark.parametrize("mangle,match", [
    (lambda e: e[260].update(rank=7), "entry 260 is not"),
    (lambda e: e.__setitem__(5, {**e[5], "token_bytes": base64.b64encode(b"x").decode()}),
     "the first 256 are the single bytes"),
    (lambda e: e[258].pop("token_str"), "entry 258 is not"),
    (lambda e: e.__setitem__(265, {**e[265], "token_bytes": e[256]["token_bytes"]}), "each token appears once"),
])
def test_a_file_not_in_the_format_names_the_entry(tmp_path, mangle, match):
    path = write_vocab(tmp_path / "vocab.json", mangle=mangle)
    with pytest.raises(DataError, match=match):
        TikTokenizer(path)
