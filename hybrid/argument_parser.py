"""The argument parser of every command line of the project: a usage error is one line.

argparse prints the whole usage block before its error, which for a command
with dozens of flags buries the one line that says what is wrong (``python -m
hybrid.plan`` printed 38 lines for ``--pp x``). :class:`ArgumentParser` prints
only that line and where to find the flags; ``--help`` still shows everything.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USAGE = 2  # argparse's exit status for a usage error, kept so scripts see the same code


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line, ending with where the flags are listed.

    Sub-command parsers made by :meth:`add_subparsers` are of this class too
    (argparse gives them the parent's class).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help lists the flags)\n")
