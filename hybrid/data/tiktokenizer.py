"""Megatron-LM's ``TikTokenizer``: a byte-level BPE vocabulary file encoded with the ``tiktoken`` library
(``--tokenizer-type TikTokenizer --tokenizer-model VOCAB.json --tiktoken-pattern v2``).

The file is Megatron's (and NeMo's) format: a JSON list whose entry ``i`` is ``{"rank": i, "token_bytes":
BASE64, "token_str": TEXT}``, the first 256 the single bytes 0..255 in order, each later one a merge. Ids are the
ranks shifted up by ``--tiktoken-num-special-tokens`` (default 1000): ids 0, 1, 2 are ``<unk>``, ``<s>``,
``</s>`` and the rest of the special block ``<SPECIAL_3>``... Text is split by the pre-tokenizer pattern
``--tiktoken-pattern`` names (v1 or v2, Megatron's) before the merges; special tokens in a text are encoded
as ordinary text, as Megatron's ``tokenize`` does. The end of a document is ``</s>``.

``tiktoken`` is an optional dependency: ``pip install 'hybrid[tiktoken]'``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Iterable, Sequence

from .errors import DataError, DataFileNotFoundError

# Megatron-LM's pre-tokenizer patterns (megatron/training/tokenizer/tokenizer.py, PATTERN_TIKTOKEN and
# PATTERN_TIKTOKEN_V2): the text is split into pieces by these before the merges, so they are part of the format
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # the first ids, in this order
DEFAULT_NUM_SPECIAL_TOKENS = 1000  # Megatron's --tiktoken-num-special-tokens default


def read_ranks(path: str) -> dict:
    """The merges of a Megatron tiktoken vocabulary file: token bytes -> rank (0-based, before the special
    tokens' shift). Raises DataError naming the first entry that is not the format."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except FileNotFoundError:
        raise DataFileNotFoundError(f"--tokenizer-model {path}: no such file (TikTokenizer reads Megatron's "
                                    f"tiktoken vocabulary, a .json list)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer-model {path} is not readable JSON ({e})") from None
    if not isinstance(vocab, list) or len(vocab) < 256:
        raise DataError(f"--tokenizer-model {path}: a TikTokenizer vocabulary is a JSON list of at least the 256 "
                        f"single bytes, one {{rank, token_bytes, token_str}} object each")
    ranks = {}
    for i, entry in enumerate(vocab):
        try:
            if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
                raise ValueError
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (ValueError, TypeError, binascii.Error):
            raise DataError(f"--tokenizer-model {path}: entry {i} is not {{\"rank\": {i}, \"token_bytes\": BASE64, "
                            f"\"token_str\": TEXT}}") from None
        if (i < 256 and token != bytes([i])) or token in ranks:
            raise DataError(f"--tokenizer-model {path}: entry {i} is {token!r}; the first 256 are the single bytes "
                            f"0..255 in order, and each token appears once")
        ranks[token] = i
    return ranks


class TikTokenizer:
    """Encode/decode with a Megatron tiktoken vocabulary (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, pattern: str = "v2",
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS):
        try:
            import tiktoken
        except ImportError:
            raise DataError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install "
                            "'hybrid[tiktoken]'") from None
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
        if num_special_tokens < len(SPECIAL_TOKENS):
            raise ValueError(f"--tiktoken-num-special-tokens must be >= {len(SPECIAL_TOKENS)} (for "
                             f"{', '.join(SPECIAL_TOKENS)}), got {num_special_tokens}")
        self.path = os.fspath(path)
        self.pattern = pattern
        self.num_special_tokens = num_special_tokens
        ranks = {token: rank + num_special_tokens for token, rank in read_ranks(self.path).items()}
        specials = list(SPECIAL_TOKENS) + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)]
        self._specials = specials
        self._enc = tiktoken.Encoding(name=os.path.basename(self.path), pat_str=PATTERNS[pattern],
                                      mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(specials)})
        self._vocab_size = num_special_tokens + len(ranks)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def unk_id(self) -> int:
        return SPECIAL_TOKENS.index("<unk>")

    @property
    def bos_id(self) -> int:
        return SPECIAL_TOKENS.index("<s>")

    @property
    def eod_id(self) -> int:
        return SPECIAL_TOKENS.index("</s>")

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One at a time: preprocessing parallelism comes from worker processes, not the library's threads.
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id < self.num_special_tokens:
            return self._specials[token_id]
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"TikTokenizer({self.path!r}, pattern={self.pattern!r}, vocab_size={self.vocab_size})"
