"""The data pipeline's user-facing error types.

A :class:`DataError` is about the data a user gave (a prefix that does not
exist, a split too small for the sequence length, an empty corpus, a cache
directory no rank can write); its message names the file and the flag to
change, and the trainer prints it as one line instead of a traceback. Errors
that mean a bug in hybrid stay plain ``ValueError``/``RuntimeError``.
"""

from __future__ import annotations


class DataError(ValueError):
    """Data hybrid cannot use; the message says which file and what to change."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data file (``.bin``, ``.idx``, a cache file) that should exist does not."""


class SplitTooSmallError(DataError):
    """A split holds fewer tokens than one sample needs (``seq_length + 1``).

    Its own type because the trainer skips a test split this small (with a
    note) where a training or validation split this small stops the run.
    """
