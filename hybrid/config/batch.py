"""``global_batch = micro_batch x accumulation x dp``: fill in the unknown, or refuse.

Errors carry the keys they are about; :meth:`HybridConfig.resolve_batch` adds their flags.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hybrid.config.errors import ConfigError

_BATCH_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "global_batch_size")


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes. ``micro_batch_size`` and ``global_batch_size`` are None only when
    neither was configured (a plain training loop that feeds its own batches)."""

    micro_batch_size: Optional[int]
    gradient_accumulation_steps: int
    global_batch_size: Optional[int]
    dp_size: int


def resolve_batch(micro: Optional[int], accum: Optional[int], global_batch: Optional[int],
                  dp_size: int) -> BatchSizes:
    """Any two of (micro, accum, global) determine the third for ``dp_size`` data-parallel ranks.

    With only micro or only global given, accumulation defaults to 1; with
    nothing given, accumulation is 1 and the sizes stay unknown.
    """
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"data-parallel size must be an integer >= 1, got {dp_size!r}")
    for name, value in (("micro_batch_size", micro), ("gradient_accumulation_steps", accum),
                        ("global_batch_size", global_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", keys=(name,))

    def describe() -> str:
        return (f"(micro_batch_size={micro}, gradient_accumulation_steps={accum}, "
                f"global_batch_size={global_batch}, data-parallel size={dp_size})")

    if global_batch is None:
        accum = 1 if accum is None else accum
        derived = micro * accum * dp_size if micro is not None else None
        return BatchSizes(micro, accum, derived, dp_size)
    if micro is None and accum is None:
        accum = 1
    if micro is None:
        per_step = accum * dp_size
        if global_batch % per_step != 0:
            raise ConfigError(f"global_batch_size {global_batch} is not divisible by gradient_accumulation_steps "
                            f"x data-parallel size = {accum} x {dp_size} = {per_step} {describe()}; "
                            f"choose a global batch that is a multiple of {per_step}", keys=_BATCH_KEYS)
        return BatchSizes(global_batch // per_step, accum, global_batch, dp_size)
    if accum is None:
        per_step = micro * dp_size
        if global_batch % per_step != 0:
            raise ConfigError(f"global_batch_size {global_batch} is not divisible by micro_batch_size x "
                            f"data-parallel size = {micro} x {dp_size} = {per_step} {describe()}; "
                            f"choose a global batch that is a multiple of {per_step}", keys=_BATCH_KEYS)
        return BatchSizes(micro, global_batch // per_step, global_batch, dp_size)
    if micro * accum * dp_size != global_batch:
        raise ConfigError(f"global_batch_size {global_batch} != micro_batch_size x gradient_accumulation_steps x "
                        f"data-parallel size = {micro} x {accum} x {dp_size} = {micro * accum * dp_size} "
                        f"{describe()}; set two of the three and let hybrid derive the third", keys=_BATCH_KEYS)
    return BatchSizes(micro, accum, global_batch, dp_size)
