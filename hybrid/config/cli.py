"""The command line of ``hybrid-train``, derived from the schema: flags, ``--config FILE``, one config.

Every key of :class:`~hybrid.config.schema.HybridConfig` has a flag (its
spellings are :mod:`hybrid.config.spellings`'); the parser groups them by
section and shows each flag's key and default. :func:`config_from_command_line`
reads, in increasing precedence:

1. the defaults of the schema;
2. ``--config FILE`` (YAML or JSON): the nested tree (``zero: {stage: 1}``),
   today's flat trainer keys (``zero_stage: 1``, ``lr: 3e-4``, dashes or
   underscores), or a DeepSpeed config;
3. the flags given.

then fills in the trainer's derived values (:mod:`hybrid.config.derive`) and
validates (:func:`hybrid.config.validate.validate`). Values from flags are
typed by the same parser as files, so an error names the key and the flag.
"""

from __future__ import annotations

import argparse
import difflib
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hybrid.argument_parser import ArgumentParser
from hybrid.config.deepspeed import deepspeed_settings, from_deepspeed
from hybrid.config.derive import derive_for_training
from hybrid.config.errors import ConfigError, one_error_for_all, suggestion
from hybrid.config.flags import Given, Leaf, Spelling, apply_given, has_key, put
from hybrid.config.load import check_deepspeed_dtypes, is_deepspeed_style, read_config_file
from hybrid.config.megatron_flags import MEGATRON_FLAGS, check_megatron_flags
from hybrid.config.parse import parse_section
from hybrid.config.schema import HybridConfig
from hybrid.config.spellings import FLAT_NAMES, SECTIONS, SPELLINGS
from hybrid.config.validate import validate

CONFIG_FLAG = "--config"
_MEGATRON_DEST = "megatron_"  # argparse dests of the Megatron-only flags: this prefix and the flag's index
_ROOT_KEYS = tuple(HybridConfig.__dataclass_fields__)


def _describe(value: Any) -> str:
    if value is None or value == []:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value)
    return str(value)


def _metavar(leaf: Leaf):
    choices = leaf.meta.get("choices")
    if choices:
        return "{" + ",".join(str(c) for c in choices) + "}"
    name = leaf.flag[2:].upper().replace("-", "_")
    if typing.get_origin(leaf.kind) is tuple:
        return tuple(f"{name}_{i + 1}" for i in range(len(typing.get_args(leaf.kind))))
    return name


def _help(text: str, leaf: Leaf) -> str:
    # argparse formats help with %; the schema's texts are plain.
    return f"{text} [{leaf.key}; default: {_describe(leaf.default)}]".replace("%", "%%")


def build_parser(prog: str = "hybrid-train", description: str = "") -> Tuple[argparse.ArgumentParser,
                                                                              Dict[str, Spelling]]:
    """The parser, and the spelling behind each argparse ``dest``.

    Nothing has a parser default (absent flags stay absent, so they neither
    override ``--config`` nor count as given); abbreviations are off, so a
    flag added later cannot make an abbreviation in a launch script ambiguous.
    """
    parser = ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS,
                                     allow_abbrev=False)
    parser.add_argument(CONFIG_FLAG, metavar="FILE", help="YAML or JSON file: the nested tree, flat trainer keys "
                                                         "or a DeepSpeed config; flags override it")
    groups = {"": parser.add_argument_group("top-level keys")}
    for name in SECTIONS:
        field = HybridConfig.__dataclass_fields__[name]
        groups[name] = parser.add_argument_group(f"{name}: {field.metadata['help']}")
    dests: Dict[str, Spelling] = {}
    for spelling in SPELLINGS.values():
        leaf, alias = spelling.leaf, spelling.alias
        if spelling.negated:
            continue  # added with its flag by BooleanOptionalAction
        group = groups[leaf.key.split(".")[0] if "." in leaf.key else ""]
        dest = f"setting_{len(dests)}"
        dests[dest] = spelling
        if alias is not None and alias.is_switch:
            group.add_argument(spelling.flag, dest=dest, action="store_true", help=_help(alias.help, leaf))
        elif alias is not None:
            group.add_argument(spelling.flag, dest=dest, metavar="VALUE", help=_help(alias.help, leaf))
        elif leaf.kind is bool:
            group.add_argument(spelling.flag, dest=dest, action=argparse.BooleanOptionalAction,
                               help=_help(leaf.meta["help"], leaf))
        else:
            nargs = _nargs(leaf)
            group.add_argument(spelling.flag, dest=dest, metavar=_metavar(leaf), help=_help(leaf.meta["help"], leaf),
                               **({"nargs": nargs} if nargs is not None else {}))
    megatron = parser.add_argument_group("Megatron-LM flags without a key of their own (accepted: no effect, "
                                         "named in a note; refused: the run stops, naming what to use instead)")
    for i, entry in enumerate(MEGATRON_FLAGS):
        words = ("no effect: " if entry.accepted else "refused: ") + entry.reason
        if entry.values is not None:
            words = f"accepted as {' or '.join(entry.values)} ({entry.reason}); otherwise refused"
        megatron.add_argument(entry.flag, dest=f"{_MEGATRON_DEST}{i}", help=words.replace("%", "%%"),
                              **({"metavar": "VALUE"} if entry.takes_value else {"action": "store_true"}))
    return parser, dests


def _megatron_given(given: Dict[str, Any]) -> List[Tuple[str, Optional[str]]]:
    """Takes the Megatron-only flags out of ``given`` (the parsed namespace's dict): ``(flag, value)`` each, in
    the order of :data:`MEGATRON_FLAGS`."""
    out = []
    for dest in sorted((d for d in given if d.startswith(_MEGATRON_DEST)), key=lambda d: int(d[len(_MEGATRON_DEST):])):
        entry = MEGATRON_FLAGS[int(dest[len(_MEGATRON_DEST):])]
        value = given.pop(dest)
        out.append((entry.flag, value if entry.takes_value else None))
    return out


def _nargs(leaf: Leaf):
    origin = typing.get_origin(leaf.kind)
    if origin is list:
        return "+"
    if origin is tuple:
        return len(typing.get_args(leaf.kind))
    return None


def config_from_command_line(argv: Optional[Sequence[str]] = None, prog: str = "hybrid-train",
                             description: str = "", notes: Optional[List[str]] = None,
                             underlay: Optional[Callable[[HybridConfig], Mapping[str, Any]]] = None) -> HybridConfig:
    """Defaults, then ``--config FILE``, then flags: one validated config with the trainer's derived values.

    Unknown flags exit through argparse (status 2, with the nearest flag);
    everything else raises :class:`~hybrid.config.ConfigError`. Megatron-LM
    flags without a key (:mod:`hybrid.config.megatron_flags`) that change
    nothing here are appended to ``notes``, one line each; a refused one raises.
    ``underlay``: given the settings the file and flags make, more settings (dotted keys) for the keys that
    neither sets, between them and the defaults (the trainer's ``--use-checkpoint-args``).
    """
    parser, dests = build_parser(prog, description)
    namespace, extras = parser.parse_known_args(argv)
    if extras:
        parser.error(_unrecognized(extras))
    given = vars(namespace)
    try:
        accepted = check_megatron_flags(_megatron_given(given))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if notes is not None:
        notes.extend(accepted)
    path = given.pop("config", None)
    tree: Dict[str, Any] = tree_from_file(path) if path else {}
    apply_given(tree, [Given(dests[dest], value) for dest, value in given.items()])
    if underlay is not None:
        for key, value in underlay(parse_section(HybridConfig, tree, "")).items():
            if not has_key(tree, key):
                put(tree, key, value)
    cfg = derive_for_training(parse_section(HybridConfig, tree, ""))
    validate(cfg)
    if path and given:
        check_deepspeed_dtypes(path, cfg.precision, given_by="the command line")
    return cfg


def _unrecognized(extras: List[str]) -> str:
    text = f"unrecognized arguments: {' '.join(extras)}"
    flags = sorted(set(SPELLINGS) | {CONFIG_FLAG})
    for extra in extras:
        close = difflib.get_close_matches(extra.split("=")[0], flags, n=1, cutoff=0.6)
        if extra.startswith("--") and close:
            text += f" (did you mean {close[0]}?)"
            break
    return text


# ---- --config FILE ------------------------------------------------------------------------------------

def tree_from_file(path: str) -> Dict[str, Any]:
    """The partial nested tree a config file sets (native, flat trainer keys, or DeepSpeed)."""
    try:
        data = read_config_file(path)
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping of settings at the top level, got {type(data).__name__}")
        if is_deepspeed_style(data):
            from_deepspeed(data)  # validates, naming the DeepSpeed keys
            tree: Dict[str, Any] = {}
            for key, value in deepspeed_settings(data).items():
                put(tree, key, value)
            return tree
        return tree_from_mapping(data)
    except ConfigError as err:
        raise ConfigError(f"{CONFIG_FLAG} {path}: {err}", keys=err.keys,
                          message=f"{CONFIG_FLAG} {path}: {err.message}") from None


def tree_from_mapping(data: Mapping[str, Any]) -> Dict[str, Any]:
    """A partial nested tree from a native mapping whose top level may also use flat trainer keys.

    A top-level key is read as a key of the tree when it is one (a section
    given a mapping), else as a flat trainer key, where ``null`` leaves the
    setting unset; anything else is an error naming the nearest valid name.
    One error names every problem of the mapping: its unknown top-level keys, and
    the unknown keys, types, choices and bounds of the rest.
    """
    tree: Dict[str, Any] = {}
    flat: List[Given] = []
    problems: List[ConfigError] = []
    for raw, value in data.items():
        if not isinstance(raw, str):
            raise ConfigError(f"config keys must be strings, got {raw!r}")
        key = raw.replace("-", "_")
        section_given_a_scalar = key in SECTIONS and not isinstance(value, Mapping)
        if key in _ROOT_KEYS and not (section_given_a_scalar and key in FLAT_NAMES):
            tree[key] = dict(value) if isinstance(value, Mapping) else value
        elif key in FLAT_NAMES:
            if value is not None:
                flat.append(Given(FLAT_NAMES[key], value))
        else:
            problems.append(ConfigError(f"unknown config key '{raw}'."
                                        f"{suggestion(key, set(_ROOT_KEYS) | set(FLAT_NAMES))}", keys=(raw,)))
    apply_given(tree, flat, overriding=False)  # one file: its flat and nested keys must agree
    try:  # the keys and types of the rest now, so that one error names every problem of the file
        parse_section(HybridConfig, tree, "")
    except ConfigError as err:
        problems.append(err)
    if problems:
        raise one_error_for_all(problems, "config keys")
    return tree
