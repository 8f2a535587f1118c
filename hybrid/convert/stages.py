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
"""

from __future__ import annotations

import dataclasses
from typing import Any, FrozenSet, List, Mapping, Optional, Tuple

from hybrid.config.errors import ConfigError
from hybrid.convert.consolidate import ConversionError
from hybrid.param_meta import is_pipeline_tied
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
                                 chunks=None if chunk_sets is None else tuple(chunk_sets)))
    return split, shares
