"""Global-batch sampling that does not depend on the data-parallel layout.

Global batch ``k`` (counted from the start of training) is the dataset indices
``[k*G, (k+1)*G)``, ``G = global_batch_size``. Data-parallel rank ``r`` of
``dp`` takes the contiguous slice ``[k*G + r*G/dp, k*G + (r+1)*G/dp)`` and cuts
it into micro-batches of ``micro_batch_size``. Concatenating, rank by rank,
the micro-batches of all ranks gives the global batch in order, whatever
``dp`` and the micro-batch size are.

The only state is ``consumed_samples``: a run resumed with it (in any layout)
continues with exactly the next sample.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch


class GlobalBatchSampler:
    """Yields, per global batch, this DP rank's micro-batches: a list of lists of indices.

    Each yielded item has ``global_batch_size // (micro_batch_size * dp_size)``
    lists of ``micro_batch_size`` dataset indices. Batches start at
    ``consumed_samples`` and stop before a global batch would pass
    ``total_samples`` (an incomplete last batch is dropped).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ):
        for name, value in (("micro_batch_size", micro_batch_size), ("global_batch_size", global_batch_size),
                            ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                f"{micro_batch_size} x data-parallel size {dp_size} = {micro_batch_size * dp_size}; "
                f"choose a global batch that is a multiple of {micro_batch_size * dp_size}"
            )
        if total_samples < 0 or not 0 <= consumed_samples:
            raise ValueError(f"need total_samples >= 0 and consumed_samples >= 0, got {total_samples}, "
                             f"{consumed_samples}")
        if consumed_samples > total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} exceeds the dataset's {total_samples} samples; "
                f"the resumed run needs a dataset built for more samples (raise --train-iters)"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch_size = global_batch_size // dp_size
        self.num_micro_batches = self.local_batch_size // micro_batch_size

    def __len__(self) -> int:
        """Global batches left."""
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def global_batch(self, k: int) -> list[list[int]]:
        """This rank's micro-batches of global batch ``k`` counted from ``consumed_samples``."""
        first = self.consumed_samples + k * self.global_batch_size + self.dp_rank * self.local_batch_size
        m = self.micro_batch_size
        return [list(range(first + j * m, first + (j + 1) * m)) for j in range(self.num_micro_batches)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        for k in range(len(self)):
            yield self.global_batch(k)

    def iter_micro_batches(self) -> Iterator[list[int]]:
        """The micro-batches of every global batch in order, flattened."""
        for batch in self:
            yield from batch


class MicroBatchSampler(torch.utils.data.Sampler):
    """Adapter for ``torch.utils.data.DataLoader(batch_sampler=...)``: one micro-batch at a time."""

    def __init__(self, sampler: GlobalBatchSampler):
        self.sampler = sampler

    def __iter__(self):
        return self.sampler.iter_micro_batches()

    def __len__(self) -> int:
        return len(self.sampler) * self.sampler.num_micro_batches


def collate_samples(samples: Sequence[dict]) -> dict:
    """Stack sample dicts into a micro-batch: each value [L] becomes [B, L]."""
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def iter_global_batches(dataset, sampler: GlobalBatchSampler) -> Iterator[list[dict]]:
    """For each global batch, this rank's collated micro-batches (dicts of [micro, L] tensors)."""
    for batch in sampler:
        yield [collate_samples([dataset[i] for i in micro]) for micro in batch]
