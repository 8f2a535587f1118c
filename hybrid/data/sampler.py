"""Global-batch sampling that does not depend on the data-parallel layout.

Global batch ``k`` (counted from the start of training) is the dataset indices
``[c_k, c_k + G_k)``, where ``c_k`` is the samples consumed before it and
``G_k`` its size: ``global_batch_size`` throughout, or the size a batch
ramp-up gives after ``c_k`` samples (:class:`~hybrid.config.batch.GlobalBatchSchedule`).
Data-parallel rank ``r`` of ``dp`` takes the contiguous slice
``[c_k + r*G_k/dp, c_k + (r+1)*G_k/dp)`` and cuts it into micro-batches of
``micro_batch_size``. Concatenating, rank by rank, the micro-batches of all
ranks gives the global batch in order, whatever ``dp`` and the micro-batch size
are.

The only state is ``consumed_samples``: a run resumed with it (in any layout)
continues with exactly the next sample, on the same batch sizes.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Union

import torch

from hybrid.config.batch import GlobalBatchSchedule


class GlobalBatchSampler:
    """Yields, per global batch, this DP rank's micro-batches: a list of lists of indices.

    ``global_batch_size``: the size of every global batch, or a
    :class:`~hybrid.config.batch.GlobalBatchSchedule` of sizes that may ramp up.
    Each yielded item has ``G // (micro_batch_size * dp_size)`` lists of
    ``micro_batch_size`` dataset indices, ``G`` that batch's size. Batches start
    at ``consumed_samples`` and stop before a global batch would pass
    ``total_samples`` (an incomplete last batch is dropped).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: Union[int, GlobalBatchSchedule],
        dp_rank: int,
        dp_size: int,
    ):
        schedule = (global_batch_size if isinstance(global_batch_size, GlobalBatchSchedule)
                    else GlobalBatchSchedule.constant(global_batch_size))
        for name, value in (("micro_batch_size", micro_batch_size), ("global_batch_size", schedule.final),
                            ("dp_size", dp_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        for size in schedule.sizes():
            if size % (micro_batch_size * dp_size):
                raise ValueError(
                    f"--global-batch-size {size} is not divisible by --micro-batch-size "
                    f"{micro_batch_size} x data-parallel size {dp_size} = {micro_batch_size * dp_size}; "
                    f"choose a global batch that is a multiple of {micro_batch_size * dp_size}"
                )
        if total_samples < 0 or not 0 <= consumed_samples:
            raise ValueError(f"need total_samples >= 0 and consumed_samples >= 0, got {total_samples}, "
                             f"{consumed_samples}")
        if consumed_samples > total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} exceeds the dataset's {total_samples} samples; "
                f"the resumed run needs a dataset built for more samples (raise --train-iters or --train-samples)"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.schedule = schedule
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def __len__(self) -> int:
        """Global batches left."""
        return self.schedule.steps_within(self.total_samples, self.consumed_samples)

    def micro_batches_at(self, consumed: int) -> list[list[int]]:
        """This rank's micro-batches of the global batch that starts after ``consumed`` samples."""
        local = self.schedule.size_at(consumed) // self.dp_size
        first, m = consumed + self.dp_rank * local, self.micro_batch_size
        return [list(range(first + j * m, first + (j + 1) * m)) for j in range(local // m)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        consumed = self.consumed_samples
        for _ in range(len(self)):
            yield self.micro_batches_at(consumed)
            consumed += self.schedule.size_at(consumed)

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
        return sum(len(batch) for batch in self.sampler)


def collate_samples(samples: Sequence[dict]) -> dict:
    """Stack sample dicts into a micro-batch: each value [L] becomes [B, L]."""
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def iter_global_batches(dataset, sampler: GlobalBatchSampler) -> Iterator[list[dict]]:
    """For each global batch, this rank's collated micro-batches (dicts of [micro, L] tensors)."""
    for batch in sampler:
        yield [collate_samples([dataset[i] for i in micro]) for micro in batch]
