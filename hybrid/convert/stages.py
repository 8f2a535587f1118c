"""What each pipeline rank of a target layout holds, as the model itself builds it.

An offline tool has no model, but a pipeline rank's files hold exactly what
that rank's :class:`model_zoo.GPTModel` registers: the layers the stage split
gives it (:func:`hybrid.pipeline.split.split_from_config`, named by their
global index), the embedding on the first rank, the final norm and head on
the last, and the last rank's copy of tied word embeddings (marked
:func:`hybrid.param_meta.is_pipeline_tied`). Rather than restate that, each
rank's model is built here on the ``meta`` device (no memory, no
initialisation) from a :meth:`hybrid.topology.Topology.local` that stands in
for that rank, and read: its ``state_dict`` names (the model file) and its
trainable parameters in the optimizer's order
(:func:`hybrid.zero.flat_buffer.collect_trainable`), and which model chunks
reach each of them (:func:`hybrid.pipeline.chunks.chunk_parameters`).

Names and order do not depend on the TP size, so the models are built at TP 1.

Nor on the expert-parallel size: the model is built at ``ep = 1`` (a model
file holds every expert), and an expert-parallel rank's optimizer halves are
the share's dense parameters (:func:`dense_share`) and its own experts
(:func:`expert_share`), each in the share's order: the order in which
:class:`~hybrid.zero.expert_split.ExpertSplitOptimizer`'s halves register them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, FrozenSet, List, Mapping, Optional, Tuple

from hybrid.config.errors import ConfigError
from hybrid.convert.consolidate import ConversionError
from hybrid.param_meta import is_expert, is_pipeline_tied
from hybrid.pipeline.chunks import chunk_parameters
from hybrid.pipeline.split import StageSplit, split_from_config
from hybrid.zero.flat_buffer import collect_trainable, param_chunk_sets


@dataclasses.dataclass(frozen=True)
class StageShare:
    """One pipeline rank's share of the model.

    ``entries``: the names its model file holds (``model.state_dict()`` order);
    ``trainable``: its trainable parameters in registration order, a tied one once (the optimizer's order);
    ``tied``: those of them tied across pipeline stages (each in a flat group of its own);
    ``chunks``: per trainable parameter, the model chunks whose backward passes reach it, where the rank runs
    more than one (:func:`hybrid.zero.flat_buffer.param_chunk_sets`: flat segments end where they change).
    """

    entries: Tuple[str, ...]
    trainable: Tuple[str, ...]
    tied: FrozenSet[str] = frozenset()
    chunks: Optional[Tuple[FrozenSet[int], ...]] = None
    experts: FrozenSet[str] = frozenset()  # the trainable expert parameters (hybrid.param_meta.is_expert)

    def select(self, keep) -> "StageShare":
        """The share of the trainable parameters ``keep(name)`` accepts (their order and chunk sets kept);
        ``entries`` stay whole (the model file holds every entry of the stage)."""
        kept = [i for i, n in enumerate(self.trainable) if keep(n)]
        return dataclasses.replace(
            self, trainable=tuple(self.trainable[i] for i in kept),
            tied=frozenset(n for n in self.tied if keep(n)), experts=frozenset(n for n in self.experts if keep(n)),
            chunks=None if self.chunks is None else tuple(self.chunks[i] for i in kept))


_EXPERTS = ".experts."


def expert_of(name: str) -> int:
    """The global index ``e`` of the routed expert parameter ``layers.{i}.mlp.experts.{e}.*`` (docs/moe.md's
    names: experts are named by their global index)."""
    try:
        return int(name.split(_EXPERTS, 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        raise ConversionError(f"{name!r} is marked as an expert parameter but is not named "
                              f"'layers.{{i}}.mlp.experts.{{e}}.*'") from None


def expert_rank(name: str, num_experts: int, ep: int) -> int:
    """The ep rank holding expert parameter ``name``: expert ``e`` lives on ep rank ``e // (E / ep)``."""
    return expert_of(name) // (num_experts // ep)


def dense_share(share: StageShare) -> StageShare:
    """What the dense half of an expert-parallel rank's optimizer holds: every trainable non-expert."""
    return share.select(lambda n: n not in share.experts)


def expert_share(share: StageShare, ep_rank: int, num_experts: int, ep: int) -> StageShare:
    """What the expert half of ep rank ``ep_rank``'s optimizer holds: its own experts."""
    return share.select(lambda n: n in share.experts and expert_rank(n, num_experts, ep) == ep_rank)


def pipeline_shares(model_config: Mapping[str, Any], pipeline, pp: int) -> Tuple[StageSplit, List[StageShare]]:
    """The stage split and every rank's :class:`StageShare` of the GPT ``model_config`` (a checkpoint's
    ``metadata.json`` ``model_config``) over ``pp`` pipeline ranks split as ``pipeline`` (a
    :class:`~hybrid.config.schema.PipelineConfig`) says."""
    from hybrid.topology import Topology
    from model_zoo import GPTModel
    from model_zoo.config import GPTConfig

    if not model_config:
        raise ConversionError("the checkpoint records no model_config, so which parameters each pipeline stage "
                              "holds is unknown; reshard it without pipeline parallelism (--pipeline-model-"
                              "parallel-size 1) and let the pipeline job reshard on load")
    try:
        config = GPTConfig.from_dict(dict(model_config))
        split = split_from_config(pipeline, config.num_layers, pp)
    except (ConfigError, ValueError, TypeError) as e:
        raise ConversionError(f"cannot split the checkpoint's model over {pp} pipeline stages: {e}") from None
    shares = []
    for stage in range(pp):
        model = GPTModel(config, Topology.local(pp=pp, pp_rank=stage), device="meta", split=split)
        trainable, _ = collect_trainable(model)
        chunks, chunk_params = chunk_parameters(model, stage)
        chunk_sets = param_chunk_sets([p for _, p in trainable], chunk_params, chunks)
        shares.append(StageShare(entries=tuple(model.state_dict()), trainable=tuple(n for n, _ in trainable),
                                 tied=frozenset(n for n, p in trainable if is_pipeline_tied(p)),
                                 chunks=None if chunk_sets is None else tuple(chunk_sets),
                                 experts=frozenset(n for n, p in trainable if is_expert(p))))
    return split, shares
