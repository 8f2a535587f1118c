"""A learning rate computed by hand, for tests that compare the engine's schedule with the formula itself."""

import math


def warmup_cosine(position, peak, floor, warmup, decay):
    """Linear warmup from 0 over ``warmup``, then cosine decay to ``floor`` at ``decay`` (positions in steps or
    samples alike): the rate at ``position``."""
    if position < warmup:
        return peak * position / warmup
    if position >= decay:
        return floor
    ratio = (position - warmup) / (decay - warmup)
    return floor + (peak - floor) * (1 + math.cos(math.pi * ratio)) / 2
