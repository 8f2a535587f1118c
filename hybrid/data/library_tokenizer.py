"""What the tokenizers built on the ``tokenizers`` library share: encoding, decoding and the vocabulary of one
``tokenizers.Tokenizer`` (GPT-2's byte-level BPE, a model folder's ``tokenizer.json``)."""

from __future__ import annotations

from typing import Iterable, Sequence


class LibraryTokenizer:
    """Encode/decode through ``self._tok`` (a ``tokenizers.Tokenizer`` the subclass builds). ``TEMPLATE``: whether
    encoding applies the tokenizer's template of special tokens (and decoding leaves them out)."""

    TEMPLATE = False

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.TEMPLATE).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One at a time: preprocessing parallelism comes from worker processes, not the library's threads.
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=self.TEMPLATE)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))
