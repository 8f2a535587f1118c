"""Nested mappings <-> typed config dataclasses, and dotted-path overrides.

Parsing converts types (with the same rules for dicts, JSON and YAML) and
rejects unknown keys with the nearest valid one, all of a tree's in one error;
every range and cross-key rule is checked afterwards by
:func:`hybrid.config.validate.validate`.

Numbers given as strings are accepted for numeric keys because YAML 1.1 reads
``1e-3`` (no dot) as a string; anything that does not parse is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from typing import Any, List, Mapping

from hybrid.config.errors import ConfigError, one_error_for_all, unknown_key_error
from hybrid.config.flags import meta_error, sections
from hybrid.config.schema import HybridConfig
from hybrid.config.validate import field_problem, validate


def config_from_dict(data: Any) -> HybridConfig:
    """A validated :class:`HybridConfig` from a native (non-DeepSpeed) nested mapping, or a config re-checked.

    The inverse of :func:`to_plain`; :func:`hybrid.config.load_config` also reads DeepSpeed-style mappings.
    """
    return parse_native(data, HybridConfig)


def parse_native(data: Any, root):
    """A validated ``root`` (the config class) from a native nested mapping, or a ``root`` object re-checked."""
    if isinstance(data, root):
        data = to_plain(data)  # re-parse so that values set on the object are type-checked too
    cfg = parse_section(root, data, "")
    validate(cfg)
    return cfg


def parse_section(cls, data: Any, path: str):
    """Build dataclass ``cls`` from ``data`` (a mapping); ``path`` names the section in errors."""
    if not isinstance(data, Mapping):
        where = f"config section '{path}'" if path else "the config"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}", keys=(path,))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    problems: List[ConfigError] = []  # every key of the tree is read before any error is raised
    for key, value in data.items():
        try:
            if not isinstance(key, str):
                raise ConfigError(f"config keys must be strings, got {key!r} in '{path or 'the config'}'")
            if key not in fields:
                raise unknown_key_error(path, key, fields)
            kwargs[key] = leaf = convert(value, hints[key], _join(path, key), fields[key].metadata)
            if not dataclasses.is_dataclass(leaf):
                problems += filter(None, [field_problem(_join(path, key), leaf, fields[key].metadata)])
        except ConfigError as err:  # a nested section's error already lists all of that section's problems
            problems.append(err)
    if problems:
        raise one_error_for_all(problems, "config keys")
    return cls(**kwargs)


def convert(value: Any, annotation, key: str, metadata: Mapping = None):
    """Convert ``value`` to ``annotation`` or raise a ConfigError naming ``key`` and its flags."""
    metadata = metadata or {}
    if value is not None and "convert" in metadata:  # a key read in its own spelling (--moe-layer-freq's pattern)
        try:
            return metadata["convert"](value)
        except ValueError as e:
            raise meta_error(f"config key '{key}': {e}", key, metadata) from None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            value = to_plain(value)
        return parse_section(annotation, value, key)
    if origin is typing.Union and type(None) in args:
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return convert(value, inner, key, metadata)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise meta_error(f"config key '{key}' must be a list of {len(args)} numbers, got {value!r}", key,
                             metadata)
        return tuple(convert(v, a, f"{key}[{i}]", metadata) for i, (v, a) in enumerate(zip(value, args)))
    if origin is list and args == (int,):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise meta_error(f"config key '{key}' must be a list of integers, got {value!r}", key, metadata)
        return [_to_int(v, f"{key}[{i}]", metadata) for i, v in enumerate(items)]
    if origin is list:
        return _to_str_list(value, key, metadata)
    if annotation is bool:
        if not isinstance(value, bool):
            raise meta_error(f"config key '{key}' must be true or false, got {value!r} ({type(value).__name__})",
                             key, metadata)
        return value
    if annotation is int:
        return _to_int(value, key, metadata)
    if annotation is float:
        return _to_float(value, key, metadata)
    if annotation is str:
        if not isinstance(value, str):
            raise meta_error(f"config key '{key}' must be a string, got {value!r} ({type(value).__name__})", key,
                             metadata)
        return value.lower() if "choices" in metadata else value
    raise TypeError(f"unsupported annotation {annotation!r} for config key '{key}'")  # a schema bug


def _to_str_list(value: Any, key: str, metadata: Mapping) -> list:
    """A list of strings; a string is split on whitespace, numbers in a list (blend weights) become text."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                for v in value):
        return [str(v) for v in value]
    raise meta_error(f"config key '{key}' must be a list of strings (or one whitespace-separated string), got "
                     f"{value!r} ({type(value).__name__})", key, metadata)


def _to_float(value: Any, key: str, metadata: Mapping) -> float:
    if isinstance(value, bool):
        raise meta_error(f"config key '{key}' must be a number, got {value!r}", key, metadata)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise meta_error(f"config key '{key}' must be a number, got {value!r} ({type(value).__name__})", key,
                     metadata)


def _to_int(value: Any, key: str, metadata: Mapping) -> int:
    if isinstance(value, bool):
        raise meta_error(f"config key '{key}' must be an integer, got {value!r}", key, metadata)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value.strip())  # exactly, where float() would round past 2**53
    number = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is not None and number == number and number not in (float("inf"), float("-inf")) \
            and number == int(number):
        return int(number)
    raise meta_error(f"config key '{key}' must be an integer, got {value!r} ({type(value).__name__})", key,
                     metadata)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def to_plain(cfg) -> dict:
    """A nested dict of plain Python values (tuples become lists) for JSON/YAML; :func:`config_from_dict` reads
    it back."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_plain(value)
        elif isinstance(value, (tuple, list)):
            value = list(value)  # a copy: the plain dict shares nothing with the config
        out[f.name] = value
    return out


def to_dotted(cfg) -> dict:
    """``{"zero.stage": 1, "optimizer.lr": 0.001, ...}``: every key of ``cfg`` as a dotted path."""
    out = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value

    walk(to_plain(cfg), "")
    return out


def flatten_overrides(overrides: Mapping[str, Any], root) -> dict:
    """Turn ``{"zero": {"stage": 2}, "optimizer.lr": 1e-4}`` into dotted paths (``root``: the config class).

    A section name given a mapping merges into that section key by key, so
    ``zero={"stage": 2}`` keeps the section's other keys; a section dataclass
    (``zero=ZeroConfig(stage=2)``) sets every key of the section.
    """
    names = sections(root)
    flat = {}
    for key, value in overrides.items():
        if key in names and dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_plain(value)
        if key in names and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                flat[f"{key}.{sub}"] = sub_value
        else:
            flat[key] = value
    return flat


def apply_overrides(cfg, overrides: Mapping[str, Any]):
    """Return a new validated config with ``overrides`` (dotted paths or section mappings) applied.

    ``apply_overrides(cfg, {"optimizer.lr": 3e-4, "zero": {"stage": 1}})``; the config itself is not changed.
    """
    data = to_plain(cfg)
    for path, value in flatten_overrides(overrides, type(cfg)).items():
        parts = path.split(".")
        node, prefix = data, ""
        for part in parts[:-1]:
            if part not in node or not isinstance(node[part], dict):
                raise unknown_key_error(prefix, part, [k for k, v in node.items() if isinstance(v, dict)],
                                        what="config section")
            node, prefix = node[part], _join(prefix, part)
        leaf = parts[-1]
        if leaf not in node:
            raise unknown_key_error(prefix, leaf, node)
        if isinstance(node[leaf], dict) and not isinstance(value, Mapping):
            raise ConfigError(f"config key '{path}' is a section; override its keys, e.g. "
                              f"'{path}.{next(iter(node[leaf]))}'")
        node[leaf] = value
    return parse_native(data, type(cfg))
