"""Reading a file whose bytes passed their checksum but whose content cannot be parsed, in one line.

A checkpoint file is verified against ``metadata.json`` before it is read, so a
file that then fails to parse was written damaged (or hashed after damage): the
error is a :class:`~hybrid.checkpoint.errors.CheckpointFormatError` naming the
file, never the library's own multi-line text. A ``weights_only`` refusal keeps
only the unpickler's reason: torch's advice to retry with ``weights_only=False``
would run the file's code.
"""

from __future__ import annotations

import pickle
import re
from typing import Any

import safetensors
import torch

from hybrid.checkpoint.errors import CheckpointFormatError


def read_error_detail(error: BaseException) -> str:
    """One line saying why ``torch.load`` or ``safetensors`` could not read a file."""
    text = str(error).strip()
    if "mmap can only be used with files saved with" in text:  # torch's advice here is for the writer
        return "not a PyTorch zip archive"
    if isinstance(error, pickle.UnpicklingError):
        reason = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\.\s|\n|$)", text, re.S)
        if reason and reason[1].strip():
            return reason[1].strip()
    return text.splitlines()[0].strip() if text else type(error).__name__


def damaged(path, error: BaseException) -> CheckpointFormatError:
    """The error for a verified checkpoint file that cannot be parsed."""
    return CheckpointFormatError(f"checkpoint file {path} cannot be read ({read_error_detail(error)}), although it "
                                 f"matches the sha256 in metadata.json: it was written damaged; load another "
                                 f"iteration")


def open_checkpoint_safetensors(path):
    """``safetensors.safe_open`` of a verified checkpoint file; a CheckpointFormatError if it is unreadable."""
    try:
        return safetensors.safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - the library raises its own error types
        raise damaged(path, e) from None


def load_checkpoint_torch_file(path, **kwargs) -> Any:
    """``torch.load(weights_only=True)`` of a verified checkpoint file (``map_location`` default cpu); a
    CheckpointFormatError if it is unreadable (garbage, or objects other than tensors)."""
    kwargs.setdefault("map_location", "cpu")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise damaged(path, e) from None
