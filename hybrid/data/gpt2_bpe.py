"""GPT-2's byte-level BPE tokenizer, read from a ``vocab.json`` and a ``merges.txt`` (Megatron's
``--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...``), on the ``tokenizers`` library.

Text is split by GPT-2's pre-tokenization pattern, each piece's UTF-8 bytes are mapped to printable characters,
and the merges apply in rank order: the ids of the original GPT-2 encoder, which ``tests/data/test_gpt2_bpe.py``
checks against ``transformers``' pure-Python GPT-2 tokenizer. The end of a document is ``<|endoftext|>``
(id 50256 in GPT-2's own vocabulary). As in Megatron, that string inside a text is ordinary text: only the
preprocessing's ``--append-eod`` puts the EOD id between documents.

:func:`train_gpt2_bpe` makes such a pair of files from a corpus (``tools/train_tokenizer.py --tokenizer-type
GPT2BPETokenizer``).
"""

from __future__ import annotations

import itertools
import os
from typing import Callable, Iterable

from .errors import DataError, DataFileNotFoundError
from .library_tokenizer import LibraryTokenizer

EOD_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # the 256 byte symbols and the EOD token
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"  # GPT-2's own names


def _byte_level():
    from tokenizers import decoders, pre_tokenizers

    # GPT-2: no space added before the first word; its regex splits words, numbers and punctuation
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), decoders.ByteLevel()


class GPT2BPETokenizer(LibraryTokenizer):
    """Encode/decode with GPT-2's byte-level BPE; ``eod_id`` is ``<|endoftext|>``'s id. No template: GPT-2 adds
    no special token to a text."""

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike):
        from tokenizers import Tokenizer, models

        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        for path, flag, what in ((self.vocab_file, "--vocab-file", VOCAB_FILE),
                                 (self.merge_file, "--merge-file", MERGES_FILE)):
            if not os.path.isfile(path):
                raise DataFileNotFoundError(f"{flag} {path}: no such file; give GPT-2's {what} (or one that "
                                            f"tools/train_tokenizer.py --tokenizer-type GPT2BPETokenizer wrote)")
        try:
            model = models.BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as e:  # the library raises its own exception type for unreadable files
            raise DataError(f"--vocab-file {self.vocab_file} / --merge-file {self.merge_file} are not a GPT-2 BPE "
                            f"vocabulary and merges list ({str(e).strip()}); give GPT-2's {VOCAB_FILE} and "
                            f"{MERGES_FILE}") from None
        self._tok = Tokenizer(model)
        self._tok.pre_tokenizer, self._tok.decoder = _byte_level()

    @property
    def eod_id(self) -> int:
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise DataError(f"--vocab-file {self.vocab_file} has no {EOD_TOKEN} token to end documents with; give "
                            f"GPT-2's {VOCAB_FILE}, or train one with tools/train_tokenizer.py")
        return eod

    def __repr__(self) -> str:
        return f"GPT2BPETokenizer({self.vocab_file!r}, {self.merge_file!r}, vocab_size={self.vocab_size})"


def check_gpt2_training_options(*, vocab_size: int, min_frequency: int,
                                flag_of: Callable[[str], str] = lambda name: name) -> None:
    """ValueError naming the first option of :func:`train_gpt2_bpe` out of range (``flag_of``: its name on a
    command line)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"{flag_of('vocab_size')} must be at least {MIN_VOCAB_SIZE} for a byte-level BPE (256 byte "
                         f"symbols and {EOD_TOKEN}), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"{flag_of('min_frequency')} must be >= 1, got {min_frequency}")


def train_gpt2_bpe(documents: Iterable[str], output_prefix: str | os.PathLike, vocab_size: int,
                   min_frequency: int = 2) -> tuple[str, str]:
    """Learn a GPT-2 style byte-level BPE of ``vocab_size`` tokens (the 256 byte symbols and ``<|endoftext|>``
    included) from ``documents``; writes ``{output_prefix}-vocab.json`` and ``{output_prefix}-merges.txt`` (the
    names of Megatron's ``gpt2-vocab.json``, ``gpt2-merges.txt`` for the prefix ``gpt2``) and returns their
    paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    check_gpt2_training_options(vocab_size=vocab_size, min_frequency=min_frequency)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = _byte_level()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[EOD_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = iter(documents)
    first = next(texts, None)
    if first is None:  # the trainer would write a vocabulary of the byte symbols alone
        raise DataError("the corpus is empty: the input holds no text to train a tokenizer on; check --input "
                        "(and --json-keys for jsonl)")
    tok.train_from_iterator(itertools.chain([first], texts), trainer)
    folder, name = os.path.split(os.path.abspath(output_prefix))
    os.makedirs(folder, exist_ok=True)
    vocab, merges = tok.model.save(folder, name)
    return vocab, merges
