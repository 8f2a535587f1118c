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


def _fails(capsys, argv, message, out):
    assert tool.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_an_output_under_a_file_or_that_is_a_directory_is_one_line(tmp_path, capsys):
    root = _fake_stdlib(tmp_path / "lib")
    (tmp_path / "FILE").write_text("in the way\n")
    out = tmp_path / "FILE" / "m.jsonl"
    _fails(capsys, ["--stdlib", str(root), "--output", str(out)],
           f"--output {out}: {tmp_path / 'FILE'} is a file, not a directory; choose another --output", out)
    (tmp_path / "DIR").mkdir()
    assert tool.main(["--stdlib", str(root), "--output", str(tmp_path / "DIR")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --output {tmp_path / 'DIR'} is a directory; give the jsonl file to write, e.g. " \
                  f"{tmp_path / 'DIR' / 'stdlib.jsonl'}\n", err
    assert (tmp_path / "DIR").is_dir() and not list((tmp_path / "DIR").iterdir())
    assert not (tmp_path / "DIR.partial").exists()


def test_writing_no_document_is_an_error_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    (tmp_path / "empty").mkdir()
    _fails(capsys, ["--stdlib", str(tmp_path / "empty"), "--output", str(out)],
           f"--stdlib {tmp_path / 'empty'} holds no .py files", out)
    root = _fake_stdlib(tmp_path / "lib")
    _fails(capsys, ["--stdlib", str(root), "--output", str(out), "--max-bytes", "10"],
           "--max-bytes 10 is smaller than the first document's line (", out)
    _fails(capsys, ["--stdlib", str(root), "--output", str(out), "--min-chars", "1000"],
           f"no docstring in the .py files under --stdlib {root} has --min-chars 1000 characters", out)
    # an earlier good output is left as it was
    assert tool.main(["--stdlib", str(root), "--output", str(out)]) == 0
    before = out.read_bytes()
    assert tool.main(["--stdlib", str(root), "--output", str(out), "--max-bytes", "10"]) == 1
    assert out.read_bytes() == before and not (tmp_path / "c.jsonl.partial").exists()
