"""A Hugging Face ``tokenizer.json`` (Megatron's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``):
the tokenizers of Llama 3, Qwen2 and most current models, read with the ``tokenizers`` library, offline.

``--tokenizer-model`` is the model's folder (or its ``tokenizer.json``). Documents are encoded with the
tokenizer's own template, as ``transformers`` encodes them by default (Llama 3's adds ``<|begin_of_text|>``
first). The end of a document is the ``eos_token`` of ``tokenizer_config.json`` beside it, as
``transformers``' ``eos_token_id`` reads it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .errors import DataError, DataFileNotFoundError
from .library_tokenizer import LibraryTokenizer

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


def model_files(path: str) -> tuple[str, str]:
    """(tokenizer.json, tokenizer_config.json) of a model folder or of a tokenizer.json."""
    if os.path.isdir(path):
        return os.path.join(path, TOKENIZER_JSON), os.path.join(path, TOKENIZER_CONFIG)
    return path, os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: its text, or an object holding it as ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(LibraryTokenizer):
    """Encode/decode with a ``tokenizer.json``; ``eod_id`` is the configured ``eos_token``'s id. Its template
    applies (decoding leaves its special tokens, a begin-of-text mark, out of the text)."""

    TEMPLATE = True

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        self.path = os.fspath(path)
        self.json_path, self.config_path = model_files(self.path)
        if not os.path.isfile(self.json_path):
            raise DataFileNotFoundError(f"--tokenizer-model {self.path}: no {TOKENIZER_JSON} there; give the model's "
                                        f"folder, or its {TOKENIZER_JSON}")
        try:
            self._tok = Tokenizer.from_file(self.json_path)
        except Exception as e:  # the library raises its own exception type for a file it cannot read
            raise DataError(f"--tokenizer-model {self.json_path} is not a Hugging Face {TOKENIZER_JSON} "
                            f"({str(e).strip()})") from None
        self._eos = self._configured_eos()

    def _configured_eos(self) -> Optional[str]:
        if not os.path.isfile(self.config_path):
            return None
        try:
            with open(self.config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{self.config_path} is not readable JSON ({e})") from None
        return _token_text(config.get("eos_token")) if isinstance(config, dict) else None

    @property
    def eod_id(self) -> int:
        if self._eos is None:
            raise DataError(f"--tokenizer-model {self.path}: no eos_token in a {TOKENIZER_CONFIG} beside "
                            f"{self.json_path}, so the end of a document is unknown; give the model's folder as "
                            f"it ships")
        eod = self._tok.token_to_id(self._eos)
        if eod is None:
            raise DataError(f"{self.config_path}: its eos_token {self._eos!r} is not a token of {self.json_path}")
        return eod

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size})"
