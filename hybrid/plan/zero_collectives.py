"""Which data-parallel collectives the ZeRO optimizer runs, and when: derived from what its stage partitions.

The memory, communication and step-time models ask the same questions of a
stage; each answer follows from :data:`hybrid.layout.STAGE_TRAITS` and is
written here once. (A stage that partitions its parameters gathers them per
unit when a module runs: that path reads ``traits.parameters`` directly.)
"""

from __future__ import annotations

from hybrid.layout import StageTraits


def reduces_by_scatter(traits: StageTraits) -> bool:
    """Gradients are reduce-scattered (else all-reduced).

    With the optimizer state partitioned a rank steps only its partition, so
    it needs only that partition's summed gradient.
    """
    return traits.optimizer_states


def reduces_every_micro_batch(traits: StageTraits) -> bool:
    """Gradients are reduced after every micro-batch's backward (else once, after the last one).

    A rank that keeps only its gradient partition has no full buffer to
    accumulate micro-batches in, so each backward's gradients are reduced as
    they are produced.
    """
    return traits.gradients


def gathers_after_step(traits: StageTraits) -> bool:
    """The updated parameters are all-gathered after the optimizer step.

    Each rank updates only its partition of whole parameters; when the
    parameters themselves are partitioned they are gathered where they are
    used instead.
    """
    return traits.optimizer_states and not traits.parameters
