"""How indivisible units (attention heads, key/value groups) split over the tensor-parallel ranks: the one rule.

Plain data, no torch: :mod:`model_zoo.config` checks a model against it
without the training stack, and :mod:`hybrid.param_meta` cuts tensors by it.
"""

from __future__ import annotations


def split_units(units: int, tp: int, what: str = "units") -> int:
    """How many pieces ``units`` indivisible units (heads) are cut into over ``tp`` ranks: ``min(units, tp)``.

    The rule: ``units % tp == 0`` (each rank holds ``units / tp`` of them) or
    ``tp % units == 0`` (each unit is held by ``tp / units`` ranks); anything
    else is refused, naming ``what``.
    """
    if units % tp and tp % units:
        raise ValueError(f"{what}={units} and the tensor-parallel size tp={tp} must divide one another "
                         f"(tp % {units} == 0 replicates each over tp/{units} ranks; {units} % tp == 0 splits "
                         f"them over the ranks); choose such a tp")
    return min(units, tp)
