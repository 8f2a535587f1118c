"""SentencePiece tokenizer: a thin wrapper for encoding, and training from text.

The end-of-document (EOD) token is the model's ``</s>`` (eos) piece; models
trained by :func:`train_sentencepiece` use ids unk=0, bos=1, eos=2, no pad.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable, Iterable, Iterator, Optional, Sequence

import sentencepiece as spm

from .errors import DataError, DataFileNotFoundError

MODEL_TYPES = ("bpe", "unigram")

# SentencePiece's own bounds on its trainer's options (trainer_interface.cc), checked before any input is read so
# that a refusal names the option, not a C++ assertion after the corpus was loaded.
MIN_VOCAB_SIZE = 8
MAX_THREADS = 1024
MIN_SENTENCE_LENGTH, MAX_SENTENCE_LENGTH = 10, 1 << 30
MIN_CHARACTER_COVERAGE = 0.98
MIN_SAMPLED_SENTENCES = 101


class SentencePieceTokenizer:
    """Encode/decode with a trained ``.model`` file.

    ``eod_id`` is the eos id; a model without an eos piece cannot mark document
    ends and is rejected when ``eod_id`` is read.
    """

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = os.fspath(model_path)
        if os.path.isdir(self.model_path):
            raise DataError(f"tokenizer model {self.model_path} is a directory; pass the .model file that "
                            f"tools/train_tokenizer.py wrote (--tokenizer-model)")
        if not os.path.isfile(self.model_path):
            raise DataFileNotFoundError(
                f"tokenizer model {self.model_path} not found; train one with tools/train_tokenizer.py "
                f"and pass the .model file (--tokenizer-model)"
            )
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except (RuntimeError, OSError) as e:  # sentencepiece's parse failure is a RuntimeError naming ModelProto
            raise DataError(f"tokenizer model {self.model_path} is not a SentencePiece model ({str(e).strip()}); "
                            f"pass the .model file that tools/train_tokenizer.py wrote (--tokenizer-model)") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        eos = self._sp.eos_id()
        if eos < 0:
            raise DataError(
                f"tokenizer {self.model_path} has no eos piece to use as end-of-document; "
                f"retrain it with an eos id (tools/train_tokenizer.py keeps eos_id=2)"
            )
        return eos

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One thread: preprocessing parallelism comes from worker processes.
        return self._sp.encode(list(texts), out_type=int, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def _lines_of(documents: Iterable[str]) -> Iterator[str]:
    """SentencePiece trains on lines; a multi-line document yields each non-blank line."""
    for doc in documents:
        for line in doc.splitlines():
            if line.strip():
                yield line


def check_training_options(*, vocab_size: int, model_type: str, character_coverage: float, max_sentence_length: int,
                           input_sentence_size: int, num_threads: Optional[int],
                           flag_of: Callable[[str], str] = lambda name: name) -> None:
    """ValueError naming the first option of :func:`train_sentencepiece` outside SentencePiece's bounds.

    ``flag_of`` turns an option's name into what the message calls it (a command line's flag).
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{flag_of('model_type')} must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"{flag_of('vocab_size')} must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    if num_threads is not None and not 1 <= num_threads <= MAX_THREADS:
        raise ValueError(f"{flag_of('num_threads')} must be 1 to {MAX_THREADS}, got {num_threads} "
                         f"(leave it out to use every core)")
    if not MIN_SENTENCE_LENGTH <= max_sentence_length <= MAX_SENTENCE_LENGTH:
        raise ValueError(f"{flag_of('max_sentence_length')} must be {MIN_SENTENCE_LENGTH} to {MAX_SENTENCE_LENGTH} "
                         f"bytes, got {max_sentence_length}")
    if input_sentence_size != 0 and input_sentence_size < MIN_SAMPLED_SENTENCES:
        raise ValueError(f"{flag_of('input_sentence_size')} must be 0 (use every line) or at least "
                         f"{MIN_SAMPLED_SENTENCES}, got {input_sentence_size}")
    if not MIN_CHARACTER_COVERAGE <= character_coverage <= 1.0:
        raise ValueError(f"{flag_of('character_coverage')} must be {MIN_CHARACTER_COVERAGE} to 1.0 (SentencePiece's "
                         f"range), got {character_coverage}")


def train_sentencepiece(
    documents: Iterable[str],
    model_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    byte_fallback: bool = False,
    max_sentence_length: int = 16384,
    input_sentence_size: int = 0,
    num_threads: int | None = None,
    verbose: bool = False,
) -> str:
    """Train a SentencePiece model from an iterable of documents; returns the ``.model`` path.

    ``input_sentence_size`` > 0 samples that many lines (0 uses all). Lines
    longer than ``max_sentence_length`` bytes are skipped by SentencePiece.
    """
    check_training_options(vocab_size=vocab_size, model_type=model_type, character_coverage=character_coverage,
                           max_sentence_length=max_sentence_length, input_sentence_size=input_sentence_size,
                           num_threads=num_threads)
    lines = _lines_of(documents)
    first = next(lines, None)
    if first is None:
        # SentencePiece would fail with an internal message about its input; say what is wrong instead.
        raise DataError("the corpus is empty: the input holds no line of text to train a tokenizer on; "
                        "check --input (and --json-keys for jsonl)")
    model_prefix = os.fspath(model_prefix)
    parent = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(parent, exist_ok=True)
    options = dict(
        sentence_iterator=itertools.chain([first], lines),
        model_prefix=model_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        max_sentence_length=max_sentence_length,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=input_sentence_size > 0,
        num_threads=num_threads or os.cpu_count() or 1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=0 if verbose else 2,
    )
    # minloglevel silences the trainer; its logstream option would redirect file
    # descriptor 2, which hides progress bars and fails under captured stderr.
    spm.SentencePieceTrainer.train(**options)
    return model_prefix + ".model"
