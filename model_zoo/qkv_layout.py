"""The fused q/k/v projection: which rows of ``qkv_proj`` hold which heads, in one place.

The model, the HF converters, the parameter metadata and the planner all read
:func:`qkv_layout`. The full (TP=1) weight ``[(nh + 2 ng) d, h]`` is the
query heads, then the key heads, then the value heads, each head's ``d``
rows contiguous (``nh`` query heads, ``ng`` key/value groups, head dim
``d``): the concatenation of HF's ``q_proj``, ``k_proj`` and ``v_proj``.
Query head ``j`` attends with key/value group ``j // (nh / ng)``.

Under TP each rank holds ``nh / tp`` query heads and the ``max(1, ng / tp)``
key/value heads they use, as ``[q_local; k_local; v_local]``. With
``tp > ng`` each key/value head is replicated over ``tp / ng`` consecutive
ranks (:mod:`hybrid.param_meta` blocks). Plain multi-head attention keeps
the equal-thirds ``stride=3`` record that checkpoints already carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from hybrid import param_meta
from model_zoo.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class QKVLayout:
    num_heads: int
    query_groups: int
    head_dim: int

    @property
    def sections(self) -> Tuple[int, int, int]:
        """Full rows of q, k and v, in that order."""
        kv = self.query_groups * self.head_dim
        return self.num_heads * self.head_dim, kv, kv

    @property
    def out_features(self) -> int:
        return sum(self.sections)

    @property
    def grouped(self) -> bool:
        return self.query_groups != self.num_heads

    def tp_split(self) -> Dict[str, Any]:
        """The ``ColumnParallelLinear`` keyword that lays the rows out over TP (``stride`` or ``blocks``)."""
        if not self.grouped:
            return {"stride": 3}
        return {"blocks": tuple(zip(self.sections, (self.num_heads, self.query_groups, self.query_groups)))}

    def tp_meta(self) -> param_meta.TPMeta:
        return param_meta.TPMeta(dim=0, **self.tp_split())

    def local_heads(self, tp: int) -> Tuple[int, int]:
        """``(query heads, key/value heads)`` one of ``tp`` ranks holds."""
        groups = self.query_groups // param_meta.split_units(self.query_groups, tp, "num_query_groups")
        return self.num_heads // tp, groups


def qkv_layout(config: GPTConfig) -> QKVLayout:
    return QKVLayout(config.num_heads, config.query_groups, config.head_dim)
