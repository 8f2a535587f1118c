"""Tokenize a corpus into indexed datasets, in parallel, with order preserved.

Input is either jsonl (one JSON object per line; the text sits under one or
more keys) or plain text where blank lines separate documents. For each key
the output is ``{output_prefix}_{key}_document.bin/.idx``, one sequence per
document, in input order.

The main process reads raw lines and groups them into chunks; workers decode,
parse and tokenize chunks; the main process writes results strictly in chunk
order. Output is therefore byte-identical for any number of workers.

Bad lines (invalid UTF-8, invalid JSON, not an object, missing key, non-string
value) are never dropped silently: with ``on_bad_line="abort"`` the first one
stops the run with its line number and no output is left behind; with
``"skip"`` they are left out, counted and listed in the result. Blank lines of
a jsonl file are not records and are passed over.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import numpy as np

from .errors import DataError
from .indexed import IndexedDatasetWriter, best_dtype
from hybrid.tokenizer_files import TokenizerSpec

from .tokenizer_choice import load_tokenizer
from .worker_pool import WorkerPoolError, ordered_map

INPUT_FORMATS = ("auto", "jsonl", "text")
BAD_LINE_POLICIES = ("abort", "skip")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# A chunk is at most ``chunk_docs`` documents or about ``chunk_bytes``: seconds of work. Ten minutes without its
# result means a stuck worker, not a slow one (a single multi-gigabyte line is the exception: raise the limit).
WORKER_TIMEOUT_S = 600.0


class BadInputError(DataError):
    """A bad input line under ``on_bad_line="abort"``."""


@dataclass(frozen=True)
class BadLine:
    line: int  # 1-based line number in the input file
    reason: str


@dataclass
class PreprocessResult:
    output_prefixes: dict[str, str]
    documents: int = 0
    empty_documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / max(self.elapsed_s, 1e-9)

    def summary(self, max_listed: int = 20) -> str:
        mb = self.input_bytes / 1e6
        lines = [
            f"documents: {self.documents} ({self.empty_documents} empty), tokens: {self.total_tokens}, "
            f"input: {mb:.2f} MB in {self.elapsed_s:.2f} s "
            f"({self.documents / max(self.elapsed_s, 1e-9):.0f} docs/s, {mb / max(self.elapsed_s, 1e-9):.2f} MB/s, "
            f"{self.tokens_per_s:.0f} tokens/s)"
        ]
        for key, prefix in self.output_prefixes.items():
            lines.append(f"  {key}: {prefix}.bin/.idx ({self.tokens.get(key, 0)} tokens)")
        if self.bad_lines:
            lines.append(f"skipped {len(self.bad_lines)} bad line(s):")
            lines += [f"  line {b.line}: {b.reason}" for b in self.bad_lines[:max_listed]]
            if len(self.bad_lines) > max_listed:
                lines.append(f"  ... and {len(self.bad_lines) - max_listed} more")
        return "\n".join(lines)


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def detect_format(path: str, input_format: str = "auto") -> str:
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {INPUT_FORMATS}, got {input_format!r}")
    if input_format != "auto":
        return input_format
    return "jsonl" if path.lower().endswith(_JSONL_SUFFIXES) else "text"


def read_records(path: str, fmt: str) -> Iterator[tuple[int, bytes | None, int]]:
    """Yield ``(first line number, raw bytes, bytes consumed)`` per document.

    jsonl: one record per non-blank line. text: blank-line-separated blocks.
    Blank stretches yield ``raw=None`` so that the bytes consumed, separators
    included, add up to the file size for the progress bar.
    """
    with open(path, "rb") as f:
        if fmt == "jsonl":
            for line_no, raw in enumerate(f, start=1):
                yield line_no, (raw if raw.strip() else None), len(raw)
            return
        block: list[bytes] = []
        start, used = 0, 0
        for line_no, raw in enumerate(f, start=1):
            used += len(raw)
            if raw.strip():
                if not block:
                    start = line_no
                block.append(raw)
            elif block:
                yield start, b"".join(block).rstrip(b"\r\n"), used
                block, used = [], 0
        if block:
            yield start, b"".join(block).rstrip(b"\r\n"), used
        elif used:
            yield 0, None, used


def chunk_records(records, max_docs: int, max_bytes: int) -> Iterator[list[tuple[int, bytes, int]]]:
    chunk, size = [], 0
    for rec in records:
        chunk.append(rec)
        size += rec[2]
        if len(chunk) >= max_docs or size >= max_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: TokenizerSpec):
    # Each worker process loads the tokenizer once, on its first chunk.
    return load_tokenizer(spec)


def _parse(raw: bytes, fmt: str, keys: Sequence[str]) -> tuple[list[str] | None, str | None]:
    """The texts of one record per key, or ``(None, reason)`` when the record is bad."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 at byte {e.start}"
    if fmt == "text":
        return [text], None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    texts = []
    for key in keys:
        if key not in obj:
            return None, f"missing key {key!r}"
        if not isinstance(obj[key], str):
            return None, f"key {key!r} holds {type(obj[key]).__name__}, expected a string"
        texts.append(obj[key])
    return texts, None


def iter_texts(
    path: str,
    json_keys: Sequence[str] = ("text",),
    input_format: str = "auto",
    on_bad_line: str = "abort",
    bad_lines: list[BadLine] | None = None,
) -> Iterator[str]:
    """Yield the text under each key of each record of ``path`` (for tokenizer training).

    Bad records raise :class:`BadInputError` (``"abort"``) or are appended to
    ``bad_lines`` (``"skip"``).
    """
    if on_bad_line not in BAD_LINE_POLICIES:
        raise ValueError(f"on_bad_line must be one of {BAD_LINE_POLICIES}, got {on_bad_line!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path} not found (--input)")
    fmt = detect_format(path, input_format)
    for line_no, raw, _ in read_records(path, fmt):
        if raw is None:
            continue
        texts, reason = _parse(raw, fmt, json_keys)
        if texts is None:
            if on_bad_line == "abort":
                raise BadInputError(f"{path}:{line_no}: {reason}; fix the line or pass --on-bad-line skip")
            if bad_lines is not None:
                bad_lines.append(BadLine(line_no, reason))
            continue
        yield from texts


@dataclass
class _ChunkResult:
    tokens: list[np.ndarray]  # per key: 1-D, the chunk's documents concatenated
    lengths: list[np.ndarray]  # per key: int64 [documents]
    bad: list[tuple[int, str]]
    documents: int
    empty_documents: int
    input_bytes: int


def encode_chunk(task) -> _ChunkResult:
    """Worker entry point: parse and tokenize one chunk of records."""
    spec, fmt, keys, append_eod, dtype, records = task
    tok = _tokenizer(spec)
    texts_per_key: list[list[str]] = [[] for _ in keys]
    bad, docs = [], 0
    for line_no, raw, _ in records:
        if raw is None:
            continue
        texts, reason = _parse(raw, fmt, keys)
        if texts is None:
            bad.append((line_no, reason))
            continue
        docs += 1
        for bucket, text in zip(texts_per_key, texts):
            bucket.append(text)
    tokens, lengths, empty = [], [], 0
    eod = [tok.eod_id] if append_eod else []
    for texts in texts_per_key:
        ids = [seq + eod for seq in tok.encode_batch(texts)] if texts else []
        lens = np.fromiter((len(s) for s in ids), dtype=np.int64, count=len(ids))
        empty += int(np.count_nonzero(lens == 0))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lens.sum()))
        tokens.append(flat)
        lengths.append(lens)
    return _ChunkResult(tokens, lengths, bad, docs, empty, sum(r[2] for r in records))


def _encoded_chunks(tasks, workers: int, start_method: str | None, timeout_s: float, input_path: str):
    """``encode_chunk`` over ``tasks`` in order: in this process, or on ``workers`` processes."""
    if workers <= 1:
        yield from map(encode_chunk, tasks)
        return
    try:
        yield from ordered_map(encode_chunk, tasks, workers, window=4 * workers, timeout_s=timeout_s,
                               start_method=start_method)
    except WorkerPoolError as e:
        raise DataError(f"preprocessing {input_path} stopped: {e}. Nothing was written. A worker the OS "
                        f"stopped for memory needs fewer --workers; a stuck one, a longer --worker-timeout") from e


def preprocess(
    input_path: str,
    tokenizer: TokenizerSpec | str,
    output_prefix: str,
    json_keys: Sequence[str] = ("text",),
    workers: int = 1,
    append_eod: bool = False,
    on_bad_line: str = "abort",
    input_format: str = "auto",
    log_interval: int = 1000,
    progress: bool = True,
    chunk_docs: int = 256,
    chunk_bytes: int = 1 << 20,
    start_method: str | None = None,
    worker_timeout_s: float = WORKER_TIMEOUT_S,
) -> PreprocessResult:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document`` per key, with ``tokenizer`` (a
    :class:`~hybrid.tokenizer_files.TokenizerSpec`, or the path of a SentencePiece model).

    Raises :class:`BadInputError` on the first bad line when ``on_bad_line`` is
    ``"abort"`` (nothing is written). ``log_interval`` is how many documents
    pass between refreshes of the docs/s figure on the progress bar.
    ``start_method`` is the workers' multiprocessing start method (see
    :mod:`hybrid.data.worker_pool` for the default). A worker that dies, or a
    chunk not encoded ``worker_timeout_s`` after it is waited on, stops the run
    with a :class:`DataError`; nothing is written.
    """
    if on_bad_line not in BAD_LINE_POLICIES:
        raise ValueError(f"on_bad_line must be one of {BAD_LINE_POLICIES}, got {on_bad_line!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not worker_timeout_s > 0:
        raise ValueError(f"the worker timeout must be > 0 seconds (--worker-timeout), got {worker_timeout_s}")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file {input_path} not found (--input)")
    keys = list(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise ValueError(f"json keys must be non-empty and distinct, got {keys}")
    fmt = detect_format(input_path, input_format)
    if fmt == "text" and len(keys) != 1:
        raise ValueError(f"plain-text input has a single document stream; pass one --json-keys name, got {keys}")
    spec = TokenizerSpec(tokenizer_model=tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    # absolute paths: a worker may start in another directory
    spec = replace(spec, **{s: os.path.abspath(getattr(spec, s)) for s in spec.files if getattr(spec, s) is not None})
    if not spec.given:
        raise ValueError(f"no tokenizer given: pass {spec.name}'s files")
    dtype = best_dtype(load_tokenizer(spec).vocab_size)
    result = PreprocessResult(output_prefixes={k: output_prefix_for(output_prefix, k) for k in keys})
    result.tokens = {k: 0 for k in keys}
    records = read_records(input_path, fmt)
    tasks = (
        (spec, fmt, keys, append_eod, dtype, chunk)
        for chunk in chunk_records(records, chunk_docs, chunk_bytes)
    )
    bar = _progress_bar(os.path.getsize(input_path), progress)
    start = time.perf_counter()
    writers = [IndexedDatasetWriter(result.output_prefixes[k], dtype) for k in keys]
    results = _encoded_chunks(tasks, workers, start_method, worker_timeout_s, input_path)
    try:
        next_log = log_interval
        for res in results:
            if res.bad and on_bad_line == "abort":
                line, reason = res.bad[0]
                raise BadInputError(
                    f"{input_path}:{line}: {reason}; fix the line or pass --on-bad-line skip to leave such "
                    f"lines out (they are counted and listed)"
                )
            result.bad_lines += [BadLine(line, reason) for line, reason in res.bad]
            for key, writer, toks, lens in zip(keys, writers, res.tokens, res.lengths):
                writer.add_documents(toks, lens)
                result.tokens[key] += toks.size
            result.documents += res.documents
            result.empty_documents += res.empty_documents
            result.input_bytes += res.input_bytes
            if bar is not None:
                bar.update(res.input_bytes)
                if result.documents >= next_log:
                    rate = result.documents / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{result.documents} docs, {rate:.0f} docs/s", refresh=False)
                    next_log = result.documents + log_interval
        _check_not_empty(input_path, result)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        results.close()  # stops the worker pool now, also when aborting
        if bar is not None:
            rate = result.documents / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{result.documents} docs, {rate:.0f} docs/s", refresh=True)
            bar.close()
    for writer in writers:
        writer.finalize()
    result.elapsed_s = time.perf_counter() - start
    return result


def _check_not_empty(input_path: str, result: PreprocessResult) -> None:
    """A dataset without a token trains nothing: refuse it rather than write it and exit 0."""
    skipped = f" ({len(result.bad_lines)} bad line(s) skipped)" if result.bad_lines else ""
    if result.documents == 0:
        raise DataError(f"the corpus {input_path} is empty: it holds no documents{skipped}; nothing was "
                        f"written. Check --input (and --json-keys)")
    if sum(result.tokens.values()) == 0:
        raise DataError(f"the corpus {input_path} is empty: its {result.documents} document(s) tokenize to no "
                        f"tokens; nothing was written. Check --input and --json-keys (or pass --append-eod)")


def _progress_bar(total_bytes: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", dynamic_ncols=True)
