"""The spellings of :class:`~hybrid.config.schema.HybridConfig`'s keys, computed once from the schema.

Read-only tables (constants, not state) built by :mod:`hybrid.config.flags`:

* ``LEAVES``: every key by dotted path;
* ``SPELLINGS``: every flag (``--zero-stage``, ``--bf16``, ``--no-fused-kernels``...);
* ``FLAT_NAMES``: every flat trainer name (``zero_stage``, ``bf16``, ``no_fused_kernels``...);
* ``SECTIONS``: the names of the nested sections.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Tuple

from hybrid.config.flags import Leaf, Spelling, leaves, sections, spellings
from hybrid.config.schema import HybridConfig

LEAVES: Mapping[str, Leaf] = MappingProxyType(leaves(HybridConfig))
SPELLINGS: Mapping[str, Spelling] = MappingProxyType(spellings(LEAVES))
FLAT_NAMES: Mapping[str, Spelling] = MappingProxyType({s.flat_name: s for s in SPELLINGS.values()})
SECTIONS: Tuple[str, ...] = sections(HybridConfig)
