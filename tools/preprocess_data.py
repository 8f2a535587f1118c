#!/usr/bin/env python
"""Tokenize a corpus into Megatron-compatible indexed datasets.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-model tok/spm.model --output-prefix data/corpus \\
        --workers 2 --append-eod

GPT-2's tokenizer instead: ``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file
merges.txt`` (its end-of-document token is ``<|endoftext|>``).

Writes ``{output-prefix}_{key}_document.bin/.idx`` for each key. ``--input`` is
jsonl (one JSON object per line) or plain text with one document per
blank-line-separated block (chosen by extension, or ``--input-format``).
Output is byte-identical for any ``--workers``. A bad line aborts the run with
its line number unless ``--on-bad-line skip`` is given, in which case bad
lines are counted and listed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)

from hybrid.argument_parser import ArgumentParser
from hybrid.data.preprocess import BAD_LINE_POLICIES, INPUT_FORMATS, WORKER_TIMEOUT_S, BadInputError, preprocess
from hybrid.data.tokenizer_choice import add_tokenizer_arguments, spec_from_arguments
from tools.outputs import make_output_dir


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="jsonl, or plain text with blank-line-separated documents")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto")
    add_tokenizer_arguments(p, "the tokenizer to encode with")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--worker-timeout", type=float, default=WORKER_TIMEOUT_S, metavar="SECONDS",
                   help=f"stop the run when a chunk's result is this late (default {WORKER_TIMEOUT_S:g})")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between docs/s refreshes")
    p.add_argument("--on-bad-line", choices=BAD_LINE_POLICIES, default="abort",
                   help="abort (default): stop at the first bad line; skip: leave bad lines out and list them")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1 (documents between docs/s refreshes), "
                             f"got {args.log_interval}")
        tokenizer = spec_from_arguments(args)
        make_output_dir(args.output_prefix, "--output-prefix")
        result = preprocess(
            args.input,
            tokenizer,
            args.output_prefix,
            json_keys=args.json_keys,
            workers=args.workers,
            worker_timeout_s=args.worker_timeout,
            append_eod=args.append_eod,
            on_bad_line=args.on_bad_line,
            input_format=args.input_format,
            log_interval=args.log_interval,
            progress=not args.no_progress,
        )
    except (BadInputError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
