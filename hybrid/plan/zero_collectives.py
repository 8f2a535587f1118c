"""Which data-parallel collectives the ZeRO optimizer runs, and when: derived from what its stage partitions.

The memory, communication and step-time models ask the same questions of a
stage; each answer follows from :data:`hybrid.layout.STAGE_TRAITS` and is
written here once. (A stage that partitions its parameters gathers them per
unit when a module runs: that path reads ``traits.parameters`` directly; whether
the updated weights are all-gathered after the step is
:attr:`hybrid.layout.StageTraits.gathers_after_step`, which the optimizer reads too.)
"""

from __future__ import annotations

from hybrid.layout import StageTraits, keeps_whole_gradients


def reduces_by_scatter(traits: StageTraits) -> bool:
    """Gradients are reduce-scattered (else all-reduced).

    With the optimizer state partitioned a rank steps only its partition, so
    it needs only that partition's summed gradient.
    """
    return traits.optimizer_states


def reduces_every_micro_batch(traits: StageTraits, reduce_once: bool = False) -> bool:
    """Gradients are reduced after every micro-batch's backward (else once, after the last one).

    A rank that keeps only its gradient partition has no full buffer to
    accumulate micro-batches in, so each backward's gradients are reduced as
    they are produced. ``reduce_once`` (``zero.reduce_once``) makes a stage
    that partitions gradients of whole parameters (stage 2) keep them whole
    and reduce once, with stage 1's collectives; the rule is
    :func:`hybrid.layout.keeps_whole_gradients`.
    """
    return not keeps_whole_gradients(traits, reduce_once)

