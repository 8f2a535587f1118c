"""Reading other frameworks' pickled ``.pt`` files (DeepSpeed, Megatron-LM) without running their code.

A ``.pt`` file is a pickle, and a pickle may name any importable callable
(``os.system``, ``builtins.eval``) for the unpickler to call. DeepSpeed's and
Megatron-LM's checkpoints legitimately name a few of their own small classes
besides tensors: DeepSpeed's ``LossScaler``, ``ZeroStageEnum`` and
``fragment_address``, Megatron's ``argparse.Namespace`` of arguments. This
module reads such files with no DeepSpeed or Megatron installed and nothing
from the file executed:

1. **scan**: the pickle's opcodes are listed with :mod:`pickletools` (which
   only parses) and every global it names must be on the allowlist
   (:class:`PlainGlobals`). The first one that is not is refused in one line
   naming the file and the global (:class:`UnsafePickleError`), before any
   object is built;
2. **load**: ``torch.load(weights_only=True)`` (torch's restricted unpickler:
   tensors, containers, numbers, strings) with
   ``torch.serialization.safe_globals`` naming the allowed globals, each bound
   to a stand-in of this module, never to the framework's class:

   * an *enum* (``PlainGlobals.enums``; pickled as ``Cls(value)``) becomes
     :class:`EnumValue` ``(class_path, value)``;
   * a *record* (``PlainGlobals.records``; pickled as ``Cls.__new__`` plus a
     state dict) becomes a plain ``dict`` of its attributes;
   * ``classes`` are real classes that hold only attributes
     (``argparse.Namespace``), kept as they are.

So a file is refused when it names anything else, and what it names on the
list is only ever data. Use :func:`load`.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Tuple

import torch

from hybrid.checkpoint import CheckpointError


class UnsafePickleError(CheckpointError):
    """A pickled file names a global that is not on the allowlist: it was not loaded."""


class EnumValue(NamedTuple):
    """An enum member read from a pickle: the enum class's dotted path and the member's value."""

    enum: str
    value: Any


@dataclasses.dataclass(frozen=True)
class PlainGlobals:
    """The globals a pickle may name, as dotted paths (``module.QualName``), by what they become."""

    enums: FrozenSet[str] = frozenset()  # pickled as Cls(value) -> EnumValue(path, value)
    records: FrozenSet[str] = frozenset()  # pickled as Cls.__new__(Cls) + state -> dict of the state
    classes: Tuple[type, ...] = ()  # attribute-only classes kept as they are (argparse.Namespace)

    def __or__(self, other: "PlainGlobals") -> "PlainGlobals":
        return PlainGlobals(self.enums | other.enums, self.records | other.records,
                            tuple(dict.fromkeys(self.classes + other.classes)))

    def names(self) -> FrozenSet[str]:
        return self.enums | self.records | frozenset(_path(c) for c in self.classes)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# What DeepSpeed's ZeRO checkpoints name besides tensors (deepspeed 0.19: the optimizer files' loss scaler,
# the stage, and the stage 1/2 per-parameter slice map).
DEEPSPEED = PlainGlobals(
    enums=frozenset({"deepspeed.runtime.zero.config.ZeroStageEnum"}),
    records=frozenset({"deepspeed.runtime.fp16.loss_scaler.LossScaler",
                       "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                       "deepspeed.utils.tensor_fragment.fragment_address"}))
# Megatron-LM's checkpoints: the run's arguments.
MEGATRON = PlainGlobals(classes=(argparse.Namespace,))


# ---- the scan ------------------------------------------------------------------------------------------
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING"}


def pickle_globals(data: bytes) -> Iterator[str]:
    """Every global one pickle names, as ``module.name``, in order. Only parses (``pickletools.genops``).

    ``GLOBAL`` carries the name; ``STACK_GLOBAL`` (protocol 4) takes the two strings pushed before it, which
    are tracked through the memo as well (a repeated name is fetched from it)."""
    strings: List[Any] = []  # the values pushed, as far as a name's two strings need them
    memo: Dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            module, _, qual = arg.partition(" ")
            yield f"{module}.{qual}"
            strings.append(None)
        elif name == "STACK_GLOBAL":
            module, qual = ([None, None] + strings)[-2:]
            yield f"{module}.{qual}" if isinstance(module, str) and isinstance(qual, str) else \
                "<a name built on the stack>"
            strings.append(None)
        elif name in _STRING_OPS:
            strings.append(arg if isinstance(arg, str) else arg.decode("latin-1"))
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = strings[-1] if strings else None
        elif name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(int(arg)))
        else:
            strings.append(None)


def _pickles_of(path: Path) -> List[bytes]:
    """The pickle(s) a torch file holds: ``*/data.pkl`` of the zip format, else the legacy format's
    sequence (magic number, protocol, system info, the object, the storage keys), raw storage bytes after."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return [z.read(n) for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
    raw = path.read_bytes()
    out, f = [], io.BytesIO(raw)
    for _ in range(5):
        start = f.tell()
        try:
            for op, _, pos in pickletools.genops(f):
                pass
        except Exception:  # the storage bytes after the last pickle, or not a pickle at all: torch.load decides
            break
        out.append(raw[start:f.tell()])
    return out


def check_globals(path: Path, allowed: PlainGlobals) -> None:
    """Refuse ``path`` (:class:`UnsafePickleError`) if its pickle names a global that is neither torch's
    own (tensors, storages, dtypes: torch's ``weights_only`` set) nor on ``allowed``."""
    known = allowed.names()
    torch_safe = _torch_safe_globals()
    for data in _pickles_of(path):
        try:
            names = list(pickle_globals(data))
        except Exception as e:  # a truncated or garbled pickle: nothing can be run from it either
            raise UnsafePickleError(f"{path}: refused to load: not a readable pickle ({e})") from None
        for name in names:
            if name not in known and name not in torch_safe:
                raise _refusal(path, name)


def _refusal(path: Path, name: str) -> UnsafePickleError:
    return UnsafePickleError(f"{path}: refused to load: it names the global {name}, which is not a plain-data "
                             f"class on hybrid.convert.safe_pickle's allowlist (nothing from the file was run)")


def _torch_safe_globals() -> FrozenSet[str]:
    from torch import _weights_only_unpickler as wou

    return frozenset(wou._get_allowed_globals())


# ---- the load ------------------------------------------------------------------------------------------
class _Record:
    """Stand-in for a pickled record class: keeps the state it is built with (``__new__`` + BUILD, or a
    call with keyword / positional arguments) so that :func:`_plain` can hand it out as a dict."""

    path = "?"

    def __init__(self, *args, **kwargs):
        self.__dict__["_state"] = dict(kwargs, **{f"arg{i}": a for i, a in enumerate(args)})

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.setdefault("_state", {}).update(state if isinstance(state, dict) else {"state": state})


def _record_class(path: str) -> type:
    return type(path.rsplit(".", 1)[-1], (_Record,), {"path": path})


def _enum_builder(path: str) -> Callable[[Any], EnumValue]:
    def build(value: Any) -> EnumValue:
        return EnumValue(path, value)

    return build


def _stand_ins(allowed: PlainGlobals) -> List[Any]:
    """``safe_globals`` entries: ``(stand-in, path)`` for enums and records, real attribute-only classes."""
    out: List[Any] = [(_enum_builder(p), p) for p in sorted(allowed.enums)]
    out += [(_record_class(p), p) for p in sorted(allowed.records)]
    return out + list(allowed.classes)


def _plain(obj: Any, seen: Optional[Dict[int, Any]] = None) -> Any:
    """``obj`` with every record stand-in replaced by the dict of its state (shared objects stay shared)."""
    seen = {} if seen is None else seen
    if id(obj) in seen:
        return seen[id(obj)]
    if isinstance(obj, _Record):
        out: Any = {}
        seen[id(obj)] = out
        out.update({k: _plain(v, seen) for k, v in obj.__dict__.get("_state", {}).items()})
        return out
    if isinstance(obj, dict):  # OrderedDict too, kept as its own type
        seen[id(obj)] = obj
        for k in list(obj):
            obj[k] = _plain(obj[k], seen)
        return obj
    if isinstance(obj, list):
        seen[id(obj)] = obj
        obj[:] = [_plain(v, seen) for v in obj]
        return obj
    if isinstance(obj, tuple) and not isinstance(obj, EnumValue):
        out = type(obj)(*(_plain(v, seen) for v in obj)) if hasattr(obj, "_fields") else \
            tuple(_plain(v, seen) for v in obj)
        seen[id(obj)] = out
        return out
    if isinstance(obj, argparse.Namespace):
        seen[id(obj)] = obj
        for k, v in vars(obj).items():
            setattr(obj, k, _plain(v, seen))
    return obj


_GLOBAL_IN_TORCH_MESSAGE = re.compile(r"GLOBAL (\S+)")


def load(path, *, allowed: PlainGlobals = DEEPSPEED | MEGATRON, map_location: Any = "cpu",
         mmap: bool = False) -> Any:
    """The object a pickled torch file holds, as plain data (see the module docstring).

    Raises :class:`UnsafePickleError` (one line: the file and the global) for a file that names anything
    off ``allowed`` and torch's tensor set, and ``CheckpointError`` for a file that is not there.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    check_globals(path, allowed)
    try:
        with torch.serialization.safe_globals(_stand_ins(allowed)):
            obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # torch's own refusal, for what the scan let through
        text = str(e)
        named = _GLOBAL_IN_TORCH_MESSAGE.search(text)
        if named:
            raise _refusal(path, named.group(1)) from None
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise UnsafePickleError(f"{path}: refused to load: {first}") from None
    return _plain(obj)
