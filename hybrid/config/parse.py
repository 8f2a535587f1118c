"""Nested mappings <-> typed config dataclasses, and dotted-path overrides.

Parsing converts types (with the same rules for dicts, JSON and YAML) and
rejects unknown keys with the nearest valid one; every range and cross-key
rule is checked afterwards by :func:`hybrid.config.validate.validate`.

Numbers given as strings are accepted for numeric keys because YAML 1.1 reads
``1e-3`` (no dot) as a string; anything that does not parse is an error.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from hybrid.config.errors import ConfigError, unknown_key_error
from hybrid.config.schema import HybridConfig


def parse_native(data: Any) -> HybridConfig:
    from hybrid.config.validate import validate

    if isinstance(data, HybridConfig):
        data = to_plain(data)  # re-parse so that values set on the object are type-checked too
    cfg = parse_section(HybridConfig, data, "")
    validate(cfg)
    return cfg


def parse_section(cls, data: Any, path: str):
    """Build dataclass ``cls`` from ``data`` (a mapping); ``path`` names the section in errors."""
    if not isinstance(data, Mapping):
        where = f"config section '{path}'" if path else "the config"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r} in '{path or 'the config'}'")
        if key not in fields:
            raise _unknown(path, key, fields)
        kwargs[key] = convert(value, hints[key], _join(path, key), fields[key].metadata)
    return cls(**kwargs)


def _unknown(path: str, key: str, fields) -> ConfigError:
    """Unknown-key error; at the top level a near-miss of a DeepSpeed key is suggested too."""
    import difflib

    if not path and not difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6):
        from hybrid.config.deepspeed import known_top_level_keys

        close = difflib.get_close_matches(key, sorted(known_top_level_keys()), n=1, cutoff=0.6)
        if close:
            return ConfigError(f"unknown config key '{key}'. Did you mean the DeepSpeed key '{close[0]}'? "
                               f"(a config is read as DeepSpeed-style when it uses DeepSpeed's key names)")
    return unknown_key_error(path, key, fields)


def convert(value: Any, annotation, key: str, metadata: Mapping = None):
    """Convert ``value`` to ``annotation`` or raise a ConfigError naming ``key``."""
    metadata = metadata or {}
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
            raise ConfigError(f"config key '{key}' must be a list of {len(args)} numbers, got {value!r}")
        return tuple(convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false, got {value!r} "
                              f"({type(value).__name__})")
        return value
    if annotation is int:
        return _to_int(value, key)
    if annotation is float:
        return _to_float(value, key)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string, got {value!r} ({type(value).__name__})")
        return value.lower() if "choices" in metadata else value
    raise TypeError(f"unsupported annotation {annotation!r} for config key '{key}'")  # a schema bug


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"config key '{key}' must be a number, got {value!r} ({type(value).__name__})")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
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
    raise ConfigError(f"config key '{key}' must be an integer, got {value!r} ({type(value).__name__})")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_SECTION_NAMES = {name for name, hint in typing.get_type_hints(HybridConfig).items()
                  if dataclasses.is_dataclass(hint)}


def to_plain(cfg) -> dict:
    """A nested dict of plain Python values (tuples become lists) for JSON/YAML."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_plain(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def flatten_overrides(overrides: Mapping[str, Any]) -> dict:
    """Turn ``{"zero": {"stage": 2}, "optimizer.lr": 1e-4}`` into dotted paths.

    A section name given a mapping merges into that section key by key, so
    ``zero={"stage": 2}`` keeps the section's other keys; a section dataclass
    (``zero=ZeroConfig(stage=2)``) sets every key of the section.
    """
    flat = {}
    for key, value in overrides.items():
        if key in _SECTION_NAMES and dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_plain(value)
        if key in _SECTION_NAMES and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                flat[f"{key}.{sub}"] = sub_value
        else:
            flat[key] = value
    return flat


def apply_overrides(cfg: HybridConfig, overrides: Mapping[str, Any]) -> HybridConfig:
    """Return a new validated config with ``overrides`` (dotted paths or section mappings) applied."""
    data = to_plain(cfg)
    for path, value in flatten_overrides(overrides).items():
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
    return parse_native(data)
