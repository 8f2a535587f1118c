"""hybrid.argument_parser: a usage error is one line naming the problem, with argparse's exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.argument_parser import EXIT_USAGE, ArgumentParser

ROOT = Path(__file__).resolve().parent.parent


def test_a_usage_error_is_one_line_and_exit_status_2(capsys):
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--pp", type=int, nargs="+", required=True)
    with pytest.raises(SystemExit) as ended:
        parser.parse_args(["--pp", "x"])
    assert ended.value.code == EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tool: error: argument --pp: invalid int value: 'x'"), err
    assert "usage:" not in err and "--help" in err


def test_sub_command_parsers_are_one_line_too(capsys):
    parser = ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build").add_argument("--jobs", type=int)
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "--jobs", "many"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --jobs: invalid int value: 'many'" in err, err


def test_help_still_lists_every_flag(capsys):
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--pp", type=int)
    with pytest.raises(SystemExit) as ended:
        parser.parse_args(["--help"])
    assert ended.value.code == 0 and "--pp" in capsys.readouterr().out


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "hybrid.plan", "--model", "gpt2", "--pp", "x"],
    [sys.executable, "-m", "hybrid.train", "--zero-stage"],
    [sys.executable, "tools/convert_checkpoint.py", "--no-such-flag"],
], ids=["plan", "train", "convert_checkpoint"])
def test_commands_answer_a_usage_error_in_one_line(command):
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.count("\n") == 1 and ": error: " in done.stderr, done.stderr
