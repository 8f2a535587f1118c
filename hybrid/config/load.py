"""One entry point for every form a config can take: object, dict, JSON file, YAML file.

A mapping is read as DeepSpeed-style when it has a key only DeepSpeed uses
(``train_batch_size``, ``zero_optimization``, ``fp16``, ...), an
``optimizer``/``scheduler`` object with ``params``, or a DeepSpeed scheduler
type (``"WarmupLR"``); otherwise it is hybrid's native layout.
A mapping that mixes native-only and DeepSpeed-only keys is an error.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Union

from hybrid.config.deepspeed import data_types_problems, from_deepspeed, known_top_level_keys
from hybrid.config.errors import ConfigError, one_error_for_all
from hybrid.config.parse import parse_native
from hybrid.config.schema import HybridConfig
from hybrid.config.spellings import FLAT_NAMES

ConfigSource = Union[None, HybridConfig, Mapping[str, Any], str, os.PathLike]

_DEEPSPEED_SCHEDULERS = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


def load_config(source: ConfigSource = None) -> HybridConfig:
    """A validated :class:`HybridConfig` from ``source``.

    ``source`` is None (all defaults), a HybridConfig, a native or DeepSpeed
    mapping, or the path of a ``.json``/``.yaml``/``.yml`` file holding one.
    """
    if source is None:
        return HybridConfig()
    if isinstance(source, HybridConfig):
        return parse_native(source, HybridConfig)
    if isinstance(source, (str, os.PathLike)):
        return load_config_file(source)
    if isinstance(source, Mapping):
        return _from_mapping(source, where="the config")
    raise ConfigError(f"a config must be a HybridConfig, a dict, or a path to a JSON/YAML file; "
                      f"got {type(source).__name__}")


def check_deepspeed_dtypes(source: ConfigSource, precision: str, given_by: str) -> None:
    """When ``source`` is a DeepSpeed config, refuse its dtype keys (``data_types``, ``communication_data_type``)
    that do not fit ``precision``, the run's precision after ``given_by`` (the flags, the overrides) set keys on
    top of it. Loading the file checked them against its own precision only."""
    if isinstance(source, (str, os.PathLike)):
        data, where = read_config_file(source), f"{source}: "
    else:
        data, where = source, ""
    if not isinstance(data, Mapping) or not is_deepspeed_style(data):
        return
    problems = [ConfigError(f"{problem} ({given_by} set precision {precision})")
                for problem in data_types_problems(data, precision)]
    if problems:
        raise ConfigError(f"{where}{one_error_for_all(problems, 'DeepSpeed keys')}")


def load_config_file(path: Union[str, os.PathLike]) -> HybridConfig:
    path = Path(path)
    data = read_config_file(path)
    try:
        return _from_mapping(data, where=f"config file {path}")
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def read_config_file(path: Union[str, os.PathLike]) -> Any:
    """Parse a JSON or YAML file (chosen by suffix) into Python data, with errors naming the file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path} must end in .json, .yaml or .yml (got {suffix or 'no suffix'!r})")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give the JSON or YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text ({err.reason} at byte {err.start}); give the "
                          f"JSON or YAML file") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}") from None
    if suffix == ".json":
        try:
            return parse_json(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
        except DuplicateKeyError as err:
            raise ConfigError(f"config file {path}: {err}") from None
    import yaml

    try:
        data = yaml.load(text, Loader=_unique_keys_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    except DuplicateKeyError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    return {} if data is None else data


class DuplicateKeyError(ValueError):
    """A JSON object or YAML mapping that names one key twice (both parsers would silently keep the last)."""


def _duplicate(key: Any, lines: str) -> DuplicateKeyError:
    return DuplicateKeyError(f"key {key!r} is given twice in one object{lines}; the parser would silently keep "
                             f"the last value: keep one")


def parse_json(text: str) -> Any:
    """``json.loads(text)``, refusing an object with a duplicate key (:class:`DuplicateKeyError`, naming the
    key and the lines where it appears as a key). Shared by every JSON a user hands in: configs, DeepSpeed
    configs, a Hugging Face ``config.json``."""
    def unique(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                found = [text.count("\n", 0, m.start()) + 1
                         for m in re.finditer(rf'"{re.escape(json.dumps(key)[1:-1])}"\s*:', text)]
                raise _duplicate(key, f" (lines {', '.join(map(str, found))})" if len(found) > 1 else "")
            seen[key] = value
        return seen

    return json.loads(text, object_pairs_hook=unique)


def _unique_keys_yaml_loader():
    """A ``yaml.SafeLoader`` refusing a mapping with a duplicate key (imported late: YAML is optional here)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise _duplicate(key, f" (lines {seen[key]} and {key_node.start_mark.line + 1})")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def is_deepspeed_style(data: Mapping[str, Any]) -> bool:
    native_top = {f for f in HybridConfig.__dataclass_fields__}
    if any(k in known_top_level_keys() and k not in native_top and not _is_flat_switch(k, v)
           for k, v in data.items()):
        return True
    for section in ("optimizer", "scheduler"):
        value = data.get(section)
        if isinstance(value, Mapping) and "params" in value:
            return True
    scheduler = data.get("scheduler")
    return isinstance(scheduler, Mapping) and scheduler.get("type") in _DEEPSPEED_SCHEDULERS


def _reject_deepspeed_near_misses(data: Mapping[str, Any]) -> None:
    """An unknown top-level key close to a DeepSpeed key (not a native one) gets that suggestion."""
    native = set(HybridConfig.__dataclass_fields__)
    for key in data:
        if isinstance(key, str) and key not in native and not difflib.get_close_matches(key, native, n=1,
                                                                                         cutoff=0.6):
            close = difflib.get_close_matches(key, sorted(known_top_level_keys()), n=1, cutoff=0.6)
            if close:
                raise ConfigError(f"unknown config key '{key}'. Did you mean the DeepSpeed key '{close[0]}'? "
                                  f"(a config is read as DeepSpeed-style when it uses DeepSpeed's key names)")


def _is_flat_switch(key: Any, value: Any) -> bool:
    """``bf16: true`` is the trainer's flat ``--bf16`` switch; DeepSpeed's ``bf16`` is an object."""
    return key in FLAT_NAMES and not isinstance(value, Mapping)


def _from_mapping(data: Any, where: str) -> HybridConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    if not is_deepspeed_style(data):
        _reject_deepspeed_near_misses(data)
        return parse_native(data, HybridConfig)
    native_only = sorted(k for k in data if k in HybridConfig.__dataclass_fields__
                         and k not in known_top_level_keys())
    if native_only:
        ds_only = sorted(k for k in data if k in known_top_level_keys()
                         and k not in HybridConfig.__dataclass_fields__)
        raise ConfigError(f"{where} mixes hybrid keys ({', '.join(native_only)}) with DeepSpeed keys "
                          f"({', '.join(ds_only) or 'optimizer/scheduler with params'}); write it in one style")
    return from_deepspeed(data)
