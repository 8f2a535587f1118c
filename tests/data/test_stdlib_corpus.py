"""tools/make_stdlib_corpus.py: docstrings as jsonl, deterministic, capped."""

import json

from tests.data.testkit import load_tool

tool = load_tool("make_stdlib_corpus")

FAKE_MODULE = '''"""Module docstring that is long enough to keep in the corpus."""

import os


class Widget:
    """A widget docstring, also comfortably above the minimum length."""

    def spin(self):
        """Spin the widget around its axis a number of times."""
        return "not a docstring, just a string literal in a return"


def short():
    """Too short."""
'''


def _fake_stdlib(root):
    (root / "pkg").mkdir(parents=True)
    (root / "b_mod.py").write_text(FAKE_MODULE)
    (root / "a_mod.py").write_text('"""Alpha module: sorted first by path, so it comes first."""\n')
    (root / "pkg" / "__init__.py").write_text('"""Module docstring that is long enough to keep in the corpus."""\n')
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text('"""Test suites are left out of the corpus entirely."""\n')
    (root / "broken.py").write_text("def (:\n")  # unparsable sources are passed over
    return root


def _read(path):
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_docstrings_in_path_and_source_order(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    out = tmp_path / "c.jsonl"
    assert tool.main(["--stdlib", str(root), "--output", str(out)]) == 0
    assert _read(out) == [
        "Alpha module: sorted first by path, so it comes first.",
        "Module docstring that is long enough to keep in the corpus.",  # the package repeat is deduplicated
        "A widget docstring, also comfortably above the minimum length.",
        "Spin the widget around its axis a number of times.",
    ]
    assert tool.main(["--stdlib", str(root), "--output", str(out), "--unit", "module", "--no-dedupe"]) == 0
    docs = _read(out)
    assert len(docs) == 3 and docs[1].startswith("Module docstring") and docs[1].endswith("number of times.")


def test_real_stdlib_is_deterministic_and_capped(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert tool.main(["--output", str(a), "--max-documents", "60"]) == 0
    assert tool.main(["--output", str(b), "--max-documents", "60"]) == 0
    assert a.read_bytes() == b.read_bytes()
    docs = _read(a)
    assert len(docs) == 60 and all(len(d) >= 40 for d in docs) and len(set(docs)) == 60
    capped = tmp_path / "c.jsonl"
    assert tool.main(["--output", str(capped), "--max-bytes", "5000"]) == 0
    assert 0 < capped.stat().st_size <= 5000
    assert _read(capped) == docs[: len(_read(capped))]
