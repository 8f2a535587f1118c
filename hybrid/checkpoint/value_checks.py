"""Reject values that would not survive the checkpoint's safe formats.

``metadata.json`` must be plain JSON, and optimizer / per-rank files must load
with ``torch.load(weights_only=True)``. Checking at save time turns a
checkpoint that would fail to load hours later into an immediate error that
names the offending entry by its path, e.g. ``optimizer_state['state'][3]``.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from hybrid.checkpoint.errors import CheckpointFormatError

_SCALARS = (str, int, float, bool, type(None))
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_WEIGHTS_ONLY_DICTS = (dict, collections.OrderedDict)


def check_json_value(value: Any, where: str) -> None:
    """Raise unless ``value`` is plain JSON: dicts with string keys, lists, strings,
    finite numbers, booleans and None (tuples are accepted and become lists)."""
    if value is None or isinstance(value, (str, int)):  # bool is an int
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointFormatError(f"{where}: {value} is not valid JSON; store a finite "
                                        f"number, null, or a string")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointFormatError(f"{where}: key {key!r} is a {type(key).__name__}; JSON "
                                            f"object keys must be strings")
            check_json_value(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json_value(item, f"{where}[{i}]")
        return
    hint = " (move tensors into the optimizer or per-rank state files)" \
        if isinstance(value, torch.Tensor) else ""
    raise CheckpointFormatError(f"{where}: {type(value).__module__}.{type(value).__name__} is not "
                                f"plain JSON{hint}")


def check_weights_only_value(value: Any, where: str) -> None:
    """Raise unless ``value`` loads with ``torch.load(weights_only=True)`` using only
    plain tensors, dicts, lists, tuples, strings, numbers, booleans and None."""
    if type(value) in _TENSOR_TYPES:
        return
    if isinstance(value, torch.Tensor):
        raise CheckpointFormatError(f"{where}: tensor subclass {type(value).__name__} cannot be "
                                    f"loaded with weights_only=True; store a plain tensor "
                                    f"(e.g. its local shard, detached)")
    if type(value) in _SCALARS:
        return
    if type(value) in _WEIGHTS_ONLY_DICTS:
        for key, item in value.items():
            if type(key) not in _SCALARS:
                raise CheckpointFormatError(f"{where}: dict key {key!r} is a {type(key).__name__}; "
                                            f"use str or int keys")
            check_weights_only_value(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_weights_only_value(item, f"{where}[{i}]")
        return
    raise CheckpointFormatError(
        f"{where}: {type(value).__module__}.{type(value).__name__} cannot be loaded with "
        f"torch.load(weights_only=True); convert it to a tensor, number, string, list or dict")
