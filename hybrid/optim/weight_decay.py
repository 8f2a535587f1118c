"""Which parameters get weight decay: the default rules the engine picks from (``optimizer.decay_1d_params``).

A rule is ``fn(name, param) -> True`` for a parameter that gets **no** weight decay. Plain functions of the
parameter's shape, so offline converters (which must match a run's parameter groups) read the same rule.
"""

from __future__ import annotations


def exclude_1d_params(name: str, param) -> bool:
    """True for biases and norm weights (any parameter with at most one dimension): no weight decay."""
    return param.dim() <= 1


def decay_everything(name: str, param) -> bool:
    """Every parameter decays (``optimizer.decay_1d_params``)."""
    return False
