"""Errors raised by the checkpoint storage layer.

Every message names the file or directory involved and what to do about it.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint storage error."""


class CheckpointNotFoundError(CheckpointError):
    """The path holds no checkpoint at all."""


class IncompleteCheckpointError(CheckpointError):
    """An iteration directory without ``metadata.json``: its save never finished."""


class MissingShardError(CheckpointError):
    """A file listed in ``metadata.json`` is absent from the iteration directory."""


class ChecksumMismatchError(CheckpointError):
    """A file's size or sha256 differs from the one recorded in ``metadata.json``."""


class CheckpointFormatError(CheckpointError):
    """``metadata.json`` or a value handed to the writer does not follow the format."""


class CheckpointLockedError(CheckpointError):
    """The save directory is in use by another job (its ``save.lock`` names a live holder)."""
