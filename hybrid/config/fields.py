"""How a key of the config tree is declared: :func:`field` (a key, with its help, flag, aliases and
constraints in its ``metadata``), :func:`section` (a nested section) and :class:`Alias` (another spelling).

:mod:`hybrid.config.flags` reads the metadata these write; :mod:`hybrid.config.schema` and
:mod:`hybrid.config.trainer_sections` declare the tree with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Alias:
    """Another command-line spelling of one key (see :mod:`hybrid.config.flags`).

    Exactly one of these shapes:

    * ``const``: a switch without a value that sets the key to ``const``
      (``--bf16`` sets ``precision`` to ``bf16``). A ``weak`` switch applies only
      when nothing else set the key (``--recompute-activations`` means
      selective unless ``--recompute-granularity`` is given);
    * ``index``: the flag sets one element of a tuple key (``--adam-beta2``);
    * ``convert``: the flag takes a value in its own unit, which ``convert``
      maps to the key's (``--initial-loss-scale 65536`` is power 16); it raises
      ``ValueError`` for a value it cannot map.

    ``compat``: a spelling kept so that Megatron-LM launch scripts run as they are
    (``--use-distributed-optimizer``); error notes and docs/config.md's flag
    column name the key's own flags instead (docs/training.md lists these).
    """

    flag: str
    help: str
    const: Any = None
    weak: bool = False
    index: Optional[int] = None
    convert: Optional[Callable[[Any], Any]] = None
    compat: bool = False

    @property
    def is_switch(self) -> bool:
        return self.index is None and self.convert is None


def field(default=dataclasses.MISSING, *, help: str, factory=dataclasses.MISSING, flag: Optional[str] = None,
           aliases: Tuple[Alias, ...] = (), **constraints):
    meta = {"help": help, "aliases": tuple(aliases), **constraints}
    if flag is not None:
        meta["flag"] = flag
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls, help: str):
    """A nested section; ``help`` titles its group in ``--help``."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "section": True})
