#!/usr/bin/env python
"""Train a SentencePiece tokenizer (BPE or unigram) from text or jsonl files.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/spm \\
        --vocab-size 8000 --model-type bpe

Writes ``{output-prefix}.model`` and ``{output-prefix}.vocab``. jsonl input takes
the text under ``--json-keys``; other files are plain text with one document
per blank-line-separated block. The model keeps ids unk=0, bos=1, eos=2; eos
is the end-of-document token that ``preprocess_data.py --append-eod`` uses.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

if __package__ in (None, ""):
    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)

from tqdm import tqdm

from hybrid.data.preprocess import BAD_LINE_POLICIES, INPUT_FORMATS, BadInputError, BadLine, iter_texts
from hybrid.data.tokenizer import MODEL_TYPES, train_sentencepiece


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text or jsonl files")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys holding text (default: text)")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto", help="auto: .jsonl/.json -> jsonl")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--byte-fallback", action="store_true", help="encode unknown characters as byte pieces")
    p.add_argument("--input-sentence-size", type=int, default=0, help="sample this many lines (0: all)")
    p.add_argument("--max-sentence-length", type=int, default=16384, help="longer lines (bytes) are skipped")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--on-bad-line", choices=BAD_LINE_POLICIES, default="abort")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    bad: list[BadLine] = []
    texts = itertools.chain.from_iterable(
        iter_texts(path, args.json_keys, args.input_format, args.on_bad_line, bad) for path in args.input
    )
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
        finally:
            bar.close()  # before any message, so that the error is a line of its own
    except (BadInputError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if bad:
        print(f"skipped {len(bad)} bad line(s): " + ", ".join(f"line {b.line} ({b.reason})" for b in bad[:20]))
    print(f"wrote {model} (vocab {args.vocab_size}, {args.model_type}) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
