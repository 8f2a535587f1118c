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
import re
import sys
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hybrid.argument_parser import ArgumentParser
from hybrid.config.deepspeed import deepspeed_notes, deepspeed_settings, from_deepspeed
from hybrid.config.derive import derive_for_training
from hybrid.config.errors import ConfigError, one_error_for_all, suggestion
from hybrid.config.flags import Given, Leaf, Spelling, apply_given, get_path, has_key, put
from hybrid.config.load import check_deepspeed_dtypes, is_deepspeed_style, read_config_file
from hybrid.config.megatron_flags import (DENSE_MOE_NOTE, FSDP_PREFETCH_NOTE, MEGATRON_FLAGS, MOE_FAMILIES,
                                          MOE_FAMILY, MOE_VALUES_NOT_HERE, ONE_EXPERT_NOTE, RESPELLINGS,
                                          TOKENIZER_NOT_YET, TOKENIZER_SPELLINGS, family_of, megatron_verdicts)
from hybrid.config.parse import parse_section
from hybrid.config.schema import HybridConfig
from hybrid.config.spellings import FLAT_NAMES, LEAVES, SECTIONS, SPELLINGS
from hybrid.config.trainer_sections import MOE_MODEL_KEYS
from hybrid.config.validate import validate

CONFIG_FLAG = "--config"
DEEPSPEED_CONFIG_FLAG = "--deepspeed-config"  # Megatron-DeepSpeed's --deepspeed_config FILE: a DeepSpeed JSON
_NEAR = 0.8  # how alike (difflib's ratio) a flag must be to a known one to be suggested for it
_MEGATRON_DEST = "megatron_"  # argparse dests of the Megatron-only flags: this prefix and the flag's index
_ROOT_KEYS = tuple(HybridConfig.__dataclass_fields__)


class _Switch(argparse.BooleanOptionalAction):
    """A boolean key's ``--flag``/``--no-flag``: on exactly for its own flag, so that a flag that itself starts
    with ``--no-`` (Megatron-LM's ``--no-load-optim``) turns its key on, where argparse's action would read any
    ``--no-`` spelling as off."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings:
            setattr(namespace, self.dest, option_string == self.option_strings[0])


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
    parser.add_argument(DEEPSPEED_CONFIG_FLAG, metavar="FILE", dest="deepspeed_config",
                        help="a DeepSpeed JSON config (Megatron-DeepSpeed's --deepspeed_config), read as --config "
                             "reads one; flags override it")
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
            group.add_argument(spelling.flag, dest=dest, action=_Switch,
                               help=_help(leaf.meta["help"], leaf))
        else:
            nargs = _nargs(leaf)
            group.add_argument(spelling.flag, dest=dest, metavar=_metavar(leaf), help=_help(leaf.meta["help"], leaf),
                               **({"nargs": nargs} if nargs is not None else {}))
    megatron = parser.add_argument_group("Megatron-LM flags without a key of their own (accepted: no effect, "
                                         "named in a note; refused: the run stops, naming what to use instead)")
    for i, entry in enumerate(MEGATRON_FLAGS):
        if entry.flag in SPELLINGS:  # a key of its own now (MoE, context parallelism): the key's flag wins
            continue
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
                             underlay: Optional[Callable[[HybridConfig], Mapping[str, Any]]] = None,
                             check: Optional[Callable[[HybridConfig], None]] = None) -> HybridConfig:
    """Defaults, then ``--config FILE``, then flags: one validated config with the trainer's derived values.

    Every problem of the command line is reported at once: unknown flags, refused Megatron-LM flags (each with
    its reason, :mod:`hybrid.config.megatron_flags`) and invalid values. With an unknown flag among them the
    parser exits as argparse does (status 2, naming the nearest flag only when it is near); else a
    :class:`~hybrid.config.ConfigError` lists them. Megatron-LM flags and values that change nothing here
    (and DeepSpeed keys of a config file that change nothing) are appended to ``notes``, one line each.
    ``underlay``: given the settings the file and flags make, more settings (dotted keys) for the keys that
    neither sets, between them and the defaults (the trainer's ``--use-checkpoint-args``). ``check``: the validation
    to run instead of :func:`~hybrid.config.validate.validate`, its rules included (the trainer's, for its world
    size); its ConfigError joins the others.
    """
    parser, dests = build_parser(prog, description)
    found: List[str] = []  # notes
    problems: List[ConfigError] = []
    argv = _respelled(_dashed(list(sys.argv[1:] if argv is None else argv), parser), found, problems)
    namespace, extras = parser.parse_known_args(argv)
    given = vars(namespace)
    megatron = _megatron_given(given)
    accepted, refusals = megatron_verdicts(megatron)
    found += accepted
    problems += [ConfigError(line) for line in refusals]
    unknown, families = _sort_unrecognized(extras)
    at = len(problems)  # where the lines of the refused families go, beside the other refused flags
    _read_megatron_values(given, dests, found, problems)
    path, ds_path = given.pop("config", None), given.pop("deepspeed_config", None)
    tree: Dict[str, Any] = {}
    cfg = None
    try:
        if path and ds_path:
            raise ConfigError(f"{CONFIG_FLAG} {path} and {DEEPSPEED_CONFIG_FLAG} {ds_path}: give one config file")
        if path or ds_path:
            tree = tree_from_file(path or ds_path, notes=found, deepspeed_only=bool(ds_path))
        apply_given(tree, [Given(dests[dest], value) for dest, value in given.items()])
        if underlay is not None:
            for key, value in underlay(parse_section(HybridConfig, tree, "")).items():
                if not has_key(tree, key):
                    put(tree, key, value)
        _settings_that_mean_off(tree, found, megatron_fsdp="--use-megatron-fsdp" in dict(megatron))
        _moe_settings(tree, found, problems)
        cfg = derive_for_training(parse_section(HybridConfig, tree, ""), notes=found)
        (validate if check is None else check)(cfg)
        if (path or ds_path) and given:
            check_deepspeed_dtypes(path or ds_path, cfg.precision, given_by="the command line")
    except ConfigError as err:
        problems.append(err)
    problems[at:at] = _refuse_families(families, _is_dense(tree), found)
    if unknown:
        parser.error(_unrecognized(unknown) + ("" if not problems else "; and " + str(_one_error(problems))))
    if problems:
        raise _one_error(problems)
    if notes is not None:
        notes.extend(found)
    return cfg


def _one_error(problems: List[ConfigError]) -> ConfigError:
    """One error for the launch: a single source's error as it is (a file's or the config's own list of keys),
    else every problem numbered in one list."""
    return problems[0] if len(problems) == 1 else one_error_for_all(problems, "settings")


def _dashed(argv: List[str], parser: argparse.ArgumentParser) -> List[str]:
    """``argv`` with Megatron-DeepSpeed's underscore spellings (``--deepspeed_config``) of known flags dashed."""
    known = set(parser._option_string_actions)
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        dashed = flag.replace("_", "-")
        if flag.startswith("--") and flag not in known and dashed in known:
            arg = dashed + eq + value
        out.append(arg)
    return out


def _respelled(argv: List[str], notes: List[str], problems: List[ConfigError]) -> List[str]:
    """``argv`` with Megatron's other spellings of hybrid's flags (:data:`RESPELLINGS`) written as hybrid's, each
    named in a note; a value with no counterpart is added to ``problems``."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        spelling = RESPELLINGS.get(flag)
        i += 1
        if spelling is None:
            out.append(argv[i - 1])
            continue
        if spelling.value is None and not eq and i < len(argv):
            value, i = argv[i], i + 1
        shown = f"{flag} {value}" if spelling.value is None else flag
        if spelling.values is not None:
            if value not in spelling.values:
                problems.append(ConfigError(f"{shown} is a Megatron-LM setting hybrid does not take: accepted: "
                                            f"{', '.join(spelling.values)}"))
                continue
            value = spelling.values[value]
        value = spelling.value if spelling.value is not None else value
        if spelling.yields_to is not None and any(a.split("=")[0] == spelling.yields_to for a in argv):
            notes.append(f"{shown} (no effect: {spelling.yields_to} is given)")
            continue
        notes.append(f"{shown} (read as {spelling.flag} {value})")
        out += [spelling.flag, value]
    return out


def _sort_unrecognized(extras: List[str]) -> Tuple[List[str], List[Tuple[str, Any]]]:
    """Sort the arguments argparse did not know: ``(unknown, families)``, the unrecognized ones and, each with
    the values that follow it, the Megatron-LM flags of a refused family
    (:data:`~hybrid.config.megatron_flags.MEGATRON_FAMILIES`) as ``(shown, family)``."""
    unknown: List[str] = []
    families: List[Tuple[str, Any]] = []
    i = 0
    while i < len(extras):
        flag = extras[i].split("=")[0]
        values = [extras[i].split("=", 1)[1]] if "=" in extras[i] else []
        i += 1
        while i < len(extras) and not extras[i].startswith("--"):
            values.append(extras[i])
            i += 1
        family = family_of(flag) if flag.startswith("--") else None
        shown = " ".join([flag] + values)
        if family is None:
            unknown.append(shown)
        else:
            families.append((shown, family))
    return unknown, families


def _refuse_families(families: List[Tuple[str, Any]], dense: bool, notes: List[str]) -> List[ConfigError]:
    """An error for each flag of a refused family (:func:`_sort_unrecognized`), naming its reason; on a
    ``dense`` model the MoE families' flags add a note instead."""
    refused = []
    for shown, family in families:
        if family in MOE_FAMILIES and dense:
            notes.append(f"{shown} ({DENSE_MOE_NOTE})")
            continue
        near = difflib.get_close_matches(shown.split()[0], list(SPELLINGS), n=1, cutoff=_NEAR) \
            if family is MOE_FAMILY else []  # a misspelt MoE key (--moe-routr-topk) is refused with a hint
        hint = f" (did you mean {near[0]}?)" if near else ""
        refused.append(ConfigError(f"{shown} is a Megatron-LM flag hybrid does not take: {family.reason}{hint}"))
    return refused


def _is_dense(tree: Dict[str, Any]) -> bool:
    """Whether the partial ``tree`` describes a dense model: ``model.num_experts`` unset or 1 (Megatron-DeepSpeed's
    ``--num-experts 1`` is the dense MLP), and no MoE preset."""
    experts = get_path(tree, "model.num_experts")  # a flag's value is still its text here
    if experts is not None and str(experts).strip() != "1":
        return False
    preset = get_path(tree, "model.preset")
    if preset is None:
        return True
    from model_zoo.presets import get_preset, list_presets

    return str(preset) not in list_presets() or not get_preset(str(preset)).is_moe  # an unknown one: named later


def _moe_settings(tree: Dict[str, Any], notes: List[str], problems: List[ConfigError]) -> None:
    """The MoE settings of the partial ``tree``, whose model is dense or not (:func:`_is_dense`).

    On a dense model every MoE key given changes nothing: each is removed with a note (as Megatron-LM ignores
    them), ``--num-experts 1`` and ``--expert-model-parallel-size 1`` too (a larger one stays, for the rule that
    refuses it). On an MoE model, a value Megatron-Core takes and hybrid does not
    (:data:`~hybrid.config.megatron_flags.MOE_VALUES_NOT_HERE`) is added to ``problems`` with what to use."""
    dense = _is_dense(tree)
    for key in ("model.num_experts", "expert_parallel_size") + MOE_MODEL_KEYS:
        if not has_key(tree, key):
            continue
        flag = LEAVES[key].flag
        value = get_path(tree, key)
        shown = flag if value is True else f"{flag} {_describe(value)}"
        if dense:
            if key == "expert_parallel_size" and str(value).strip() != "1":
                continue  # refused by the model's rule: expert parallelism needs experts
            if value is not False:
                why = ONE_EXPERT_NOTE if key == "model.num_experts" else \
                    "one expert-parallel rank: " + DENSE_MOE_NOTE if key == "expert_parallel_size" else DENSE_MOE_NOTE
                notes.append(f"{shown} ({why})")
            _remove(tree, key)
            continue
        why = MOE_VALUES_NOT_HERE.get(flag, {}).get(str(value).strip().lower())
        if why is not None:
            problems.append(ConfigError(f"{shown} is a Megatron-LM setting hybrid does not take: {why}",
                                        keys=(key,)))
            _remove(tree, key)


def _remove(tree: Dict[str, Any], key: str) -> None:
    *path, leaf = key.split(".")
    node = tree
    for part in path:
        node = node[part]
    del node[leaf]


def _read_megatron_values(given: Dict[str, Any], dests: Mapping[str, Spelling], notes: List[str],
                          problems: List[ConfigError]) -> None:
    """Megatron-LM's values for keys hybrid has, read as Megatron reads them: a tokenizer type that is one of
    hybrid's under another name (``Llama2Tokenizer``), and a quoted ``--split`` (``"'99,1,0'"``, as a script
    that quotes inside an unquoted array passes it)."""
    for dest, value in list(given.items()):
        flag = dests[dest].flag if dest in dests else None
        if flag == "--tokenizer-type" and isinstance(value, str):
            kind = value.lower()
            if kind in TOKENIZER_NOT_YET:
                problems.append(ConfigError(f"--tokenizer-type {value}: {TOKENIZER_NOT_YET[kind]}",
                                            keys=("data.tokenizer_type",)))
                del given[dest]
            elif kind in TOKENIZER_SPELLINGS:
                name, why = TOKENIZER_SPELLINGS[kind]
                notes.append(f"--tokenizer-type {value} (" + (f"read as {name}: {why}" if name else why) + ")")
                if name is None:
                    del given[dest]
                else:
                    given[dest] = name
        elif flag == "--split" and isinstance(value, str) and re.search(r"[^0-9.,/\s]", value):
            numbers = re.findall(r"[.0-9]+", value)
            if numbers:
                given[dest] = ",".join(numbers)
                notes.append(f"--split {value} (read as {given[dest]}: its numbers, as Megatron-LM reads it)")


def _settings_that_mean_off(tree: Dict[str, Any], notes: List[str], megatron_fsdp: bool = False) -> None:
    """Settings of the partial ``tree`` that ask for nothing here, turned off with a note as Megatron-LM does:
    sequence parallelism with one tensor-parallel rank, validation on a split with no validation share, and
    (``megatron_fsdp``: ``--use-megatron-fsdp`` given) Megatron-FSDP's parameter prefetch at ZeRO stage 3."""
    if megatron_fsdp and str(get_path(tree, "zero.stage")).strip() == "3" \
            and get_path(tree, "zero.overlap_param_gather") is True:
        put(tree, "zero.overlap_param_gather", False)
        notes.append(FSDP_PREFETCH_NOTE)
    tp = get_path(tree, "tensor_parallel_size") or 1  # a flag's value is still its text here
    if get_path(tree, "model.sequence_parallel") is True and str(tp).strip() == "1":
        put(tree, "model.sequence_parallel", False)
        notes.append("--sequence-parallel (turned off: it splits activations over the tensor-parallel group, and "
                     "there is one tensor-parallel rank, as Megatron-LM does)")
    split = get_path(tree, "data.split")
    interval = get_path(tree, "eval.interval", 1)  # a flag's value is still its text here
    if isinstance(split, str) and get_path(tree, "data.path") and not get_path(tree, "data.train_path") \
            and str(interval).strip() != "0":
        shares = [float(x) for x in re.findall(r"[.0-9]+", split) if x.strip(".")]
        if len(shares) >= 2 and shares[1] == 0 and sum(shares) > 0:
            put(tree, "eval.interval", 0)
            notes.append(f"--split {split} (no validation share: validation is skipped, as Megatron-LM skips an "
                         f"empty split)")


def _unrecognized(extras: List[str]) -> str:
    """``unrecognized arguments: ...``, and the nearest known flag of each unknown one that has a near one."""
    text = f"unrecognized arguments: {' '.join(extras)}"
    flags = sorted(set(SPELLINGS) | {CONFIG_FLAG, DEEPSPEED_CONFIG_FLAG} | {f.flag for f in MEGATRON_FLAGS})
    hints = []
    for extra in extras:
        flag = extra.split()[0].split("=")[0]
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=_NEAR) if flag.startswith("--") else []
        if close:
            hints.append((flag, close[0]))
    if len(hints) == 1:
        text += f" (did you mean {hints[0][1]}?)"
    elif hints:
        text += " (did you mean " + ", ".join(f"{near} for {flag}" for flag, near in hints) + "?)"
    return text


# ---- --config FILE ------------------------------------------------------------------------------------

def tree_from_file(path: str, notes: Optional[List[str]] = None, deepspeed_only: bool = False) -> Dict[str, Any]:
    """The partial nested tree a config file sets (native, flat trainer keys, or DeepSpeed); ``notes`` receives
    one line naming the DeepSpeed keys that change nothing here. ``deepspeed_only``: the file must be a DeepSpeed
    config (``--deepspeed-config``)."""
    flag = DEEPSPEED_CONFIG_FLAG if deepspeed_only else CONFIG_FLAG
    try:
        data = read_config_file(path)
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a mapping of settings at the top level, got {type(data).__name__}")
        if deepspeed_only and data and not is_deepspeed_style(data):
            raise ConfigError("it is not a DeepSpeed config (no DeepSpeed key such as train_batch_size or "
                              "zero_optimization); give hybrid's own config with --config")
        if is_deepspeed_style(data) or (deepspeed_only and not data):
            from_deepspeed(data)  # validates, naming the DeepSpeed keys
            if notes is not None:
                notes.extend(deepspeed_notes(data))
            tree: Dict[str, Any] = {}
            for key, value in deepspeed_settings(data).items():
                put(tree, key, value)
            return tree
        return tree_from_mapping(data)
    except ConfigError as err:
        raise ConfigError(f"{flag} {path}: {err}", keys=err.keys, message=f"{flag} {path}: {err.message}") from None


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
