#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE or unigram), or a GPT-2 byte-level BPE, from text or jsonl files.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/spm \\
        --vocab-size 8000 --model-type bpe
    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/gpt2 \\
        --vocab-size 8000 --tokenizer-type GPT2BPETokenizer

SentencePiece writes ``{output-prefix}.model`` and ``{output-prefix}.vocab``;
it keeps ids unk=0, bos=1, eos=2, and eos is the end-of-document token that
``preprocess_data.py --append-eod`` uses. GPT2BPETokenizer writes
``{output-prefix}-vocab.json`` and ``{output-prefix}-merges.txt`` (for
``--vocab-file``, ``--merge-file``), with ``<|endoftext|>`` as end of document.
jsonl input takes the text under ``--json-keys``; other files are plain text
with one document per blank-line-separated block.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time

if __package__ in (None, ""):
    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)

from tqdm import tqdm

from hybrid.argument_parser import ArgumentParser
from hybrid.data.preprocess import BAD_LINE_POLICIES, INPUT_FORMATS, BadInputError, BadLine, iter_texts
from hybrid.data.gpt2_bpe import check_gpt2_training_options, train_gpt2_bpe
from hybrid.data.tokenizer import MODEL_TYPES, check_training_options, train_sentencepiece
from hybrid.tokenizer_files import flag_of
from tools.outputs import make_output_dir


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text or jsonl files")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys holding text (default: text)")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto", help="auto: .jsonl/.json -> jsonl")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--tokenizer-type", type=str.lower, choices=("sentencepiecetokenizer", "gpt2bpetokenizer"),
                   default="sentencepiecetokenizer",
                   metavar="{SentencePieceTokenizer,GPT2BPETokenizer}", help="what to train (default SentencePiece)")
    p.add_argument("--min-frequency", type=int, default=2, help="GPT2BPETokenizer: merges of pairs seen at least "
                                                                "this often")
    p.add_argument("--model-type", choices=MODEL_TYPES, default="bpe", help="SentencePiece: bpe or unigram")
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--byte-fallback", action="store_true", help="encode unknown characters as byte pieces")
    p.add_argument("--input-sentence-size", type=int, default=0, help="sample this many lines (0: all)")
    p.add_argument("--max-sentence-length", type=int, default=16384, help="longer lines (bytes) are skipped")
    p.add_argument("--num-threads", type=int, default=None, help="training threads, 1 to 1024 (default: all cores)")
    p.add_argument("--on-bad-line", choices=BAD_LINE_POLICIES, default="abort")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(args) -> None:
    """Refuse out-of-range numeric flags before any input is read (ValueError naming the flag)."""
    if args.tokenizer_type == "gpt2bpetokenizer":
        check_gpt2_training_options(vocab_size=args.vocab_size, min_frequency=args.min_frequency, flag_of=flag_of)
        return
    check_training_options(vocab_size=args.vocab_size, model_type=args.model_type,
                           character_coverage=args.character_coverage, max_sentence_length=args.max_sentence_length,
                           input_sentence_size=args.input_sentence_size, num_threads=args.num_threads,
                           flag_of=flag_of)


def explain(error: Exception, args) -> str:
    """One line for an error: SentencePiece's known refusals in terms of the flags, others as they are."""
    text = str(error).strip()
    too_many = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", text)
    if too_many:
        return (f"--vocab-size {too_many[1]} is too large for this corpus: SentencePiece can make at most "
                f"{too_many[2]} pieces from it; pass --vocab-size {too_many[2]} or less, or give more text")
    if "[!sentences_.empty()]" in text:
        return (f"no line of the input is at most --max-sentence-length {args.max_sentence_length} bytes long "
                f"(longer lines are skipped); raise --max-sentence-length")
    return text.splitlines()[0] if text else type(error).__name__


class _Reader:
    """The input documents, for SentencePiece to pull from native code.

    An error raised inside the iterator reaches Python again as a RuntimeError
    ("INTERNAL: ...", with a stack excerpt): the original is kept here, so that
    it can be reported as it was raised.
    """

    def __init__(self, items):
        self._items = items
        self.error: Exception | None = None

    def __iter__(self):
        try:
            yield from self._items
        except Exception as e:  # noqa: BLE001 - re-raised as is by main()
            self.error = e
            raise


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        make_output_dir(args.output_prefix, "--output-prefix")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    bad: list[BadLine] = []
    texts = _Reader(itertools.chain.from_iterable(
        iter_texts(path, args.json_keys, args.input_format, args.on_bad_line, bad) for path in args.input
    ))
    bar = tqdm(desc="reading documents", unit=" docs", disable=args.no_progress)

    def counted(items):
        # SentencePiece pulls the iterator from native code; a tqdm-wrapped iterator
        # loses its final refresh there, so the bar is updated by hand.
        for item in items:
            bar.update(1)
            yield item

    docs = counted(texts)
    start = time.perf_counter()
    try:
        try:
            if args.tokenizer_type == "gpt2bpetokenizer":
                model = " and ".join(train_gpt2_bpe(docs, args.output_prefix, args.vocab_size, args.min_frequency))
            else:
                model = train_sentencepiece(
                    docs,
                    args.output_prefix,
                    vocab_size=args.vocab_size,
                    model_type=args.model_type,
                    character_coverage=args.character_coverage,
                    byte_fallback=args.byte_fallback,
                    max_sentence_length=args.max_sentence_length,
                    input_sentence_size=args.input_sentence_size,
                    num_threads=args.num_threads,
                    verbose=args.verbose,
                )
        except Exception as e:
            if texts.error is not None and texts.error is not e:  # wrapped by SentencePiece: report the original
                raise texts.error from None
            raise
        finally:
            bar.close()  # before any message, so that the error is a line of its own
    except (BadInputError, OSError, ValueError, RuntimeError) as e:
        print(f"error: {explain(e, args)}", file=sys.stderr)
        return 1
    if bad:
        print(f"skipped {len(bad)} bad line(s): " + ", ".join(f"line {b.line} ({b.reason})" for b in bad[:20]))
    kind = "GPT-2 byte-level BPE" if args.tokenizer_type == "gpt2bpetokenizer" else args.model_type
    print(f"wrote {model} (vocab {args.vocab_size}, {kind}) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
