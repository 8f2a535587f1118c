"""Which transformer layers each pipeline stage builds.

A model of ``L`` layers run on ``p`` pipeline ranks with ``v`` model chunks per
rank ("virtual stages", interleaved schedules) is cut into ``p * v`` consecutive
*parts*. Part ``k`` lives on pipeline rank ``k % p`` as that rank's chunk
``k // p``, so consecutive parts sit on consecutive ranks and the last rank's
chunk ``c`` feeds rank 0's chunk ``c + 1``.

The balancing rule (:func:`balanced_layer_counts`): the embedding and the output
head (with its loss) each cost about one layer, so ``L + 2`` units of work are
spread as evenly as possible over the parts, the first part holding the
embedding and the last the head. When the units do not divide evenly, the
extra ones go to the *last* parts: under 1F1B the first stage keeps the most
micro-batches' activations alive, so it is the one to keep light. A part may
be left with no layer (the embedding or the head alone) but never with fewer
than zero; an explicit per-part list (``pipeline.layers_per_stage``) overrides
the rule.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from hybrid.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The layer ranges of every part: ``ranges[k] = (first_layer, end_layer)`` of part ``k``."""

    pp: int
    chunks: int
    ranges: Tuple[Tuple[int, int], ...]

    @property
    def num_parts(self) -> int:
        return self.pp * self.chunks

    def part(self, pp_rank: int, chunk: int) -> int:
        """The model part held as ``chunk`` by pipeline rank ``pp_rank``."""
        return chunk * self.pp + pp_rank

    def layers_of(self, pp_rank: int, chunk: int = 0) -> range:
        """Global layer indices of one chunk of one rank."""
        first, end = self.ranges[self.part(pp_rank, chunk)]
        return range(first, end)

    def layers_of_rank(self, pp_rank: int) -> List[int]:
        """Every global layer index this pipeline rank builds, over all its chunks."""
        return [i for c in range(self.chunks) for i in self.layers_of(pp_rank, c)]

    def holds_embedding(self, pp_rank: int) -> bool:
        return pp_rank == 0

    def holds_head(self, pp_rank: int) -> bool:
        return pp_rank == self.pp - 1

    def counts(self) -> List[int]:
        return [end - first for first, end in self.ranges]


def balanced_layer_counts(num_layers: int, parts: int) -> List[int]:
    """Layers per part under the module's rule (embedding and head one unit each, extra units at the end).

    >>> balanced_layer_counts(3, 2)
    [1, 2]
    >>> balanced_layer_counts(24, 4)
    [5, 6, 7, 6]
    """
    if parts == 1:
        return [num_layers]
    units = num_layers + 2
    base, extra = divmod(units, parts)
    loads = [base + (1 if k >= parts - extra else 0) for k in range(parts)]
    counts = [load - (k == 0) - (k == parts - 1) for k, load in enumerate(loads)]
    if min(counts) < 0:
        raise ConfigError(f"cannot split {num_layers} layers over {parts} pipeline parts: each part needs at "
                          f"least the embedding, the head or a layer; lower pipeline_model_parallel_size or the "
                          f"virtual stages")
    return counts


def split_layers(num_layers: int, pp: int, chunks: int = 1,
                 layers_per_stage: Optional[Sequence[int]] = None) -> StageSplit:
    """The :class:`StageSplit` of ``num_layers`` over ``pp`` ranks with ``chunks`` parts each.

    ``layers_per_stage``: an explicit count per part (``pp * chunks`` entries, in part order), summing to
    ``num_layers``; otherwise :func:`balanced_layer_counts`.
    """
    parts = pp * chunks
    if layers_per_stage is not None:
        counts = [int(n) for n in layers_per_stage]
        if len(counts) != parts:
            raise ConfigError(f"pipeline.layers_per_stage has {len(counts)} entries but the pipeline has {parts} "
                              f"parts (pp={pp} x {chunks} virtual stages); give one count per part")
        if min(counts) < 0 or sum(counts) != num_layers:
            raise ConfigError(f"pipeline.layers_per_stage {counts} must be non-negative and sum to num_layers="
                              f"{num_layers}")
    else:
        counts = balanced_layer_counts(num_layers, parts)
    ranges, first = [], 0
    for n in counts:
        ranges.append((first, first + n))
        first += n
    return StageSplit(pp=pp, chunks=chunks, ranges=tuple(ranges))


def split_from_config(pipeline, num_layers: int, pp: int) -> StageSplit:
    """The split a :class:`~hybrid.config.schema.PipelineConfig` asks for, for ``num_layers`` over ``pp`` ranks.

    ``layers_per_virtual_stage`` gives ``num_layers / (pp x layers_per_virtual_stage)`` chunks per rank (it must
    divide); ``layers_per_stage`` fixes every part's count.
    """
    chunks = 1
    if pipeline.layers_per_virtual_stage is not None:
        per = pipeline.layers_per_virtual_stage
        if num_layers % (pp * per) != 0:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per} x pipeline_model_parallel_size {pp} "
                              f"must divide num_layers={num_layers}")
        chunks = num_layers // (pp * per)
        if pipeline.layers_per_stage is None:
            return split_layers(num_layers, pp, chunks, [per] * (pp * chunks))
    return split_layers(num_layers, pp, chunks, pipeline.layers_per_stage)
