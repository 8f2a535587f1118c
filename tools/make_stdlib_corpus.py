#!/usr/bin/env python
"""Write a jsonl corpus from the docstrings of this Python installation's standard library.

    python tools/make_stdlib_corpus.py --output corpus/stdlib.jsonl --max-documents 20000

Every Python carries this text, so the CPU demo needs no download. Sources are
parsed with ``ast`` (nothing is imported, so no module side effects run), in
sorted path order, and docstrings are taken in source order: the output is
identical across runs on one installation. Each line is ``{"text": ...}``.

``--unit docstring`` (default) makes one document per docstring; ``--unit
module`` joins a module's docstrings into one document. Test suites are left
out, short docstrings (``--min-chars``) are dropped and repeated ones are kept
once. ``--max-documents`` and ``--max-bytes`` cap the output.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

if __package__ in (None, ""):
    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)

from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tools.outputs import make_output_dir  # noqa: E402

# Test suites and their data: large, repetitive, and partly not valid Python 3.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path relative to ``root``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def docstrings_in_order(tree: ast.AST) -> Iterator[str]:
    """Docstrings of the module, its classes and functions, depth first in source order."""
    doc = ast.get_docstring(tree, clean=True) if isinstance(tree, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                                   ast.AsyncFunctionDef)) else None
    if doc:
        yield doc
    for child in ast.iter_child_nodes(tree):
        yield from docstrings_in_order(child)


def module_documents(path: Path, unit: str, min_chars: int) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return
    docs = [inspect.cleandoc(d).strip() for d in docstrings_in_order(tree)]
    docs = [d for d in docs if len(d) >= min_chars]
    if unit == "module":
        if docs:
            yield "\n\n".join(docs)
    else:
        yield from docs


def iter_corpus(root: Path, unit: str = "docstring", min_chars: int = 40, dedupe: bool = True) -> Iterator[str]:
    seen: set[bytes] = set()
    for path in stdlib_sources(root):
        for text in module_documents(path, unit, min_chars):
            if dedupe:
                digest = hashlib.sha1(text.encode("utf-8")).digest()
                if digest in seen:
                    continue
                seen.add(digest)
            yield text


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="jsonl file to write")
    p.add_argument("--unit", choices=("docstring", "module"), default="docstring")
    p.add_argument("--min-chars", type=int, default=40, help="drop docstrings shorter than this")
    p.add_argument("--max-documents", type=int, default=0, help="stop after this many documents (0: no cap)")
    p.add_argument("--max-bytes", type=int, default=0, help="stop before the output passes this size (0: no cap)")
    p.add_argument("--no-dedupe", action="store_true", help="keep repeated docstrings")
    p.add_argument("--stdlib", default=None, help="standard library directory (default: this interpreter's)")
    return p


def _why_empty(root: Path, args, first_size) -> str:
    """Why no document was written, naming the flag to change."""
    if first_size is not None:
        return (f"--max-bytes {args.max_bytes} is smaller than the first document's line ({first_size} bytes); "
                f"no document fits, nothing was written: raise --max-bytes (0: no cap)")
    if not stdlib_sources(root):
        return f"--stdlib {root} holds no .py files (test suites are left out); nothing was written"
    return (f"no docstring in the .py files under --stdlib {root} has --min-chars {args.min_chars} characters; "
            f"nothing was written: lower --min-chars or point --stdlib at another directory")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_documents < 0 or args.max_bytes < 0 or args.min_chars < 0:
        print("error: --max-documents, --max-bytes and --min-chars must be >= 0", file=sys.stderr)
        return 1
    root = Path(args.stdlib) if args.stdlib else stdlib_root()
    if not root.is_dir():
        print(f"error: standard library directory {root} not found (--stdlib)", file=sys.stderr)
        return 1
    out = Path(args.output)
    if out.is_dir():
        print(f"error: --output {out} is a directory; give the jsonl file to write, e.g. {out / 'stdlib.jsonl'}",
              file=sys.stderr)
        return 1
    try:
        make_output_dir(out, "--output")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tmp = out.with_name(out.name + ".partial")
    docs = size = 0
    first_size = None  # the first document's size: what --max-bytes must allow for one document
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for text in iter_corpus(root, args.unit, args.min_chars, dedupe=not args.no_dedupe):
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                nbytes = len(line.encode("utf-8"))
                if first_size is None:
                    first_size = nbytes
                if args.max_bytes and size + nbytes > args.max_bytes:
                    break
                f.write(line)
                docs += 1
                size += nbytes
                if args.max_documents and docs >= args.max_documents:
                    break
        if docs == 0:
            raise ValueError(_why_empty(root, args, first_size))
        os.replace(tmp, out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        tmp.unlink(missing_ok=True)  # left only by a failed run: os.replace moved a good one
    print(f"wrote {docs} documents ({size / 1e6:.2f} MB) from {root} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
