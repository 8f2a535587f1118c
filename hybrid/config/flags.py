"""How keys are spelled on the command line, and what a given spelling sets: the rules, for any config tree.

The rules, each written once:

* a key's flag is the ``flag`` of its field metadata, else ``--`` and the
  dotted key with ``.`` and ``_`` written as ``-`` (``zero.bucket_size`` ->
  ``--zero-bucket-size``); a boolean key also has ``--no-<flag>``;
* every :class:`~hybrid.config.fields.Alias` in the metadata adds one flag;
* the *flat name* of a flag is the flag without ``--``, dashes as underscores
  (``--zero-bucket-size`` -> ``zero_bucket_size``). Flat names are the keys of
  the earlier, flat trainer settings: ``--config`` files may use them at the
  top level, and checkpoints of earlier releases stored the settings that way.

:func:`apply_given` applies given spellings (from the command line or from a
file's flat keys) to a partial nested tree, which
:func:`hybrid.config.parse.parse_section` then types and fills with defaults.
:func:`key_error` is how every rule names the flags of the keys it is about.

The functions take the root dataclass (or a field's metadata) as an argument
rather than importing the schema, so that the schema's own methods can use
this module; :mod:`hybrid.config.spellings` holds the tables of
:class:`~hybrid.config.schema.HybridConfig`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from hybrid.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One key of the tree: its dotted path, its dataclass field and its type annotation."""

    key: str
    field: dataclasses.Field
    hint: Any

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    @property
    def kind(self) -> Any:
        """The annotation without ``Optional``: ``int``, ``str``, ``List[str]``, ``Tuple[float, float]``..."""
        if typing.get_origin(self.hint) is typing.Union:
            (inner,) = [a for a in typing.get_args(self.hint) if a is not type(None)]
            return inner
        return self.hint

    @property
    def flag(self) -> str:
        return own_flag(self.key, self.meta)

    @property
    def aliases(self) -> tuple:
        """The :class:`~hybrid.config.fields.Alias` spellings of the key."""
        return self.meta.get("aliases", ())

    def error(self, message: str) -> ConfigError:
        return _error_with_flags(message, (self.key,), [flags_for(self.key, self.meta)])


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One flag of one key: the key's own flag, its ``--no-`` form (booleans), or an :class:`Alias`."""

    flag: str
    leaf: Leaf
    alias: Any = None  # an Alias, or None for the key's own flag
    negated: bool = False

    @property
    def flat_name(self) -> str:
        return flat_name(self.flag)


def flat_name(flag: str) -> str:
    """The flag's name as a key: without ``--``, dashes as underscores (``--num-layers`` -> ``num_layers``)."""
    return flag[2:].replace("-", "_")


def own_flag(key: str, meta: Mapping[str, Any]) -> str:
    """The key's own flag: its metadata ``flag``, else derived from the dotted key."""
    return meta.get("flag") or "--" + key.replace(".", "-").replace("_", "-")


def flags_for(key: str, meta: Mapping[str, Any]) -> Tuple[str, ...]:
    """The flags that set ``key``, whose field metadata is ``meta``: its own, then its aliases' (but the
    compatibility spellings, which only launch scripts written for Megatron-LM use)."""
    return (own_flag(key, meta),) + tuple(a.flag for a in meta.get("aliases", ()) if not a.compat)


def leaves(root) -> Dict[str, Leaf]:
    """Every key of the dataclass tree ``root``, by dotted path, in field order."""
    return {leaf.key: leaf for leaf in _walk(root, "")}


def _walk(cls, prefix: str) -> Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            yield from _walk(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield Leaf(prefix + f.name, f, hints[f.name])


def sections(root) -> Tuple[str, ...]:
    """The names of the nested sections of ``root``."""
    return tuple(f.name for f in dataclasses.fields(root) if f.metadata.get("section"))


def spellings(all_leaves: Mapping[str, Leaf]) -> Dict[str, Spelling]:
    """Every flag of every leaf; two keys sharing a flag is a schema bug (``TypeError``)."""
    out: Dict[str, Spelling] = {}
    for leaf in all_leaves.values():
        own = [Spelling(leaf.flag, leaf)]
        if leaf.kind is bool:
            own.append(Spelling("--no-" + leaf.flag[2:], leaf, negated=True))
        own += [Spelling(a.flag, leaf, alias=a) for a in leaf.aliases]
        for s in own:
            if s.flag in out:
                raise TypeError(f"flag {s.flag} is spelled by both '{out[s.flag].leaf.key}' and '{leaf.key}'")
            out[s.flag] = s
    return out


def _field_meta(root, key: str) -> Optional[Mapping[str, Any]]:
    """The metadata of dotted ``key`` (``optimizer.betas[1]`` counts as ``optimizer.betas``) in ``root``."""
    cls: Any = root
    parts = key.split("[")[0].split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return None
        if i == len(parts) - 1:
            return fields[part].metadata
        cls = typing.get_type_hints(cls)[part]
    return None


def flags_of(root, key: str) -> Tuple[str, ...]:
    """The flags that set ``key`` of the tree ``root``; () for a name that is not a key."""
    meta = _field_meta(root, key)
    return flags_for(key.split("[")[0], meta) if meta is not None and not meta.get("section") else ()


def key_error(root, message: str, *keys: str) -> ConfigError:
    """A :class:`ConfigError` about ``keys`` of the tree ``root``, its text ending with the flags that set them.

    Errors name the config key in the message and the flag in this note, so the
    same text serves a YAML file and a command line.
    """
    return _error_with_flags(message, keys, [flags_of(root, k) for k in keys])


def meta_error(message: str, key: str, meta: Mapping[str, Any]) -> ConfigError:
    """:func:`key_error` for one key whose field metadata is at hand (while parsing a section)."""
    return _error_with_flags(message, (key,), [flags_for(key.split("[")[0], meta)])


def _error_with_flags(message: str, keys: Sequence[str], flag_lists: Sequence[Sequence[str]]) -> ConfigError:
    flags: List[str] = []
    for some in flag_lists:
        flags += [f for f in some if f not in flags]
    text = f"{message} (set by {', '.join(flags)})" if flags else message
    return ConfigError(text, keys=keys, message=message)


# ---- applying given spellings to a partial tree -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Given:
    """A spelling and the value it was given: a string or list from the command line, any value from a file.

    Switches and booleans carry ``True``/``False`` (a switch given ``False`` in a
    file counts as not given).
    """

    spelling: Spelling
    value: Any


def get_path(tree: Mapping, key: str, default: Any = None) -> Any:
    """The value at dotted ``key`` of the nested mapping ``tree``, or ``default`` when absent."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def has_key(tree: Mapping, key: str) -> bool:
    marker = object()
    return get_path(tree, key, marker) is not marker


def put(tree: Dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in the nested dict ``tree``, creating sections as needed."""
    *parents, leaf = key.split(".")
    node = tree
    prefix = ""
    for part in parents:
        prefix = f"{prefix}.{part}" if prefix else part
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config section '{prefix}' must be a mapping of keys to values, got "
                              f"{type(child).__name__}")
        node = child
    node[leaf] = value


def _switch_given(g: Given) -> bool:
    """Whether a switch (or a ``--no-`` flag) was really given: files may write ``bf16: false``."""
    if isinstance(g.value, bool):
        return g.value
    raise g.spelling.leaf.error(f"'{g.spelling.flat_name}' is a switch ({g.spelling.flag}): give true or false, "
                                f"got {g.value!r} ({type(g.value).__name__})")


def _whole_value(g: Given) -> Tuple[bool, Any]:
    """(given, value for the key) of a spelling that sets the whole key."""
    s, leaf = g.spelling, g.spelling.leaf
    if s.negated:
        return (True, False) if _switch_given(g) else (False, None)
    if s.alias is None:
        return True, g.value
    if s.alias.convert is not None:
        try:
            return True, s.alias.convert(g.value)
        except (TypeError, ValueError) as err:
            raise leaf.error(f"{s.flag} {g.value!r}: {err}") from None
    return (True, s.alias.const) if _switch_given(g) else (False, None)


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists: a file's list and a flag's tuple of the same items agree."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def apply_given(tree: Dict[str, Any], given: Sequence[Given], overriding: bool = True) -> None:
    """Set the keys that ``given`` spells in ``tree`` (a partial nested dict), in place.

    Per key: spellings that set the whole key must agree (``--bf16 --fp16`` is
    an error); element flags (``--adam-beta2``) then set their element; a weak
    switch (``--recompute-activations``) applies only when nothing set the key,
    neither in ``tree`` nor in ``given``. ``overriding``: ``given`` may replace
    what ``tree`` holds (flags over a file); else ``tree`` and ``given`` come
    from one source (one file's nested and flat keys) and must agree too.
    """
    by_key: Dict[str, List[Given]] = {}
    for g in given:
        by_key.setdefault(g.spelling.leaf.key, []).append(g)
    for key, group in by_key.items():
        leaf = group[0].spelling.leaf
        weak = [g for g in group if g.spelling.alias is not None and g.spelling.alias.weak]
        elements = [g for g in group if g.spelling.alias is not None and g.spelling.alias.index is not None]
        whole = [g for g in group if g not in weak and g not in elements]
        chosen: List[Tuple[str, Any]] = []
        for g in whole:
            given_, value = _whole_value(g)
            if given_:
                chosen.append((g.spelling.flag, value))
        distinct = {repr(v) for _, v in chosen}
        if len(distinct) > 1:
            flags = " and ".join(f for f, _ in chosen)
            values = ", ".join(repr(v) for _, v in chosen)
            raise leaf.error(f"{flags} are mutually exclusive: they set '{key}' to different values ({values}); "
                             f"give one")
        if chosen:
            if not overriding and has_key(tree, key) and _plain(get_path(tree, key)) != _plain(chosen[-1][1]):
                name = next(g.spelling.flat_name for g in whole if g.spelling.flag == chosen[-1][0])
                raise leaf.error(f"config keys '{name}' and '{key}' both set '{key}', to different values "
                                 f"({chosen[-1][1]!r}, {get_path(tree, key)!r}); give one")
            put(tree, key, chosen[-1][1])
        for g in elements:
            current = get_path(tree, key, leaf.default)
            items = list(current) if isinstance(current, (list, tuple)) else list(leaf.default)
            items[g.spelling.alias.index] = g.value
            put(tree, key, items)
        if weak and not chosen and not elements and not has_key(tree, key):
            for g in weak:
                given_, value = _whole_value(g)
                if given_:
                    put(tree, key, value)
