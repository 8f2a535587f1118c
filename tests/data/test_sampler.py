"""Layout invariance of global batches, exact resume, and batching helpers."""

import itertools

import pytest
import torch

from hybrid.data.gpt_dataset import GPTDataset
from hybrid.data.sampler import GlobalBatchSampler, MicroBatchSampler, collate_samples, iter_global_batches
from tests.data.testkit import unique_token_dataset

G = 16
TOTAL = 200


def _global_batch_tokens(dataset, dp, micro, consumed=0, batches=None):
    """For each global batch: the samples of all DP ranks, rank by rank, micro-batch by micro-batch."""
    per_rank = [list(GlobalBatchSampler(TOTAL, consumed, micro, G, r, dp)) for r in range(dp)]
    n = len(per_rank[0]) if batches is None else batches
    out = []
    for k in range(n):
        indices = [i for r in range(dp) for mb in per_rank[r][k] for i in mb]
        tokens = torch.cat([collate_samples([dataset[i] for i in mb])["tokens"]
                            for r in range(dp) for mb in per_rank[r][k]])
        out.append((indices, tokens))
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    ds_idx, _ = unique_token_dataset(tmp_path_factory.mktemp("s") / "u", num_docs=120, seed=3)
    return GPTDataset(ds_idx, 8, TOTAL, seed=2, use_cache=False)


def test_global_batches_do_not_depend_on_dp_or_micro_batch(dataset):
    reference = _global_batch_tokens(dataset, 1, G)
    assert len(reference) == TOTAL // G
    for k, (indices, _) in enumerate(reference):
        assert indices == list(range(k * G, (k + 1) * G))
    for dp, micro in itertools.product((1, 2, 4), (1, 2, 4)):
        got = _global_batch_tokens(dataset, dp, micro)
        assert [i for i, _ in got] == [i for i, _ in reference], (dp, micro)
        for (_, t_ref), (_, t) in zip(reference, got):
            assert torch.equal(t_ref, t), (dp, micro)


def test_each_rank_gets_a_contiguous_slice_in_micro_batches():
    s = GlobalBatchSampler(TOTAL, 0, micro_batch_size=2, global_batch_size=G, dp_rank=1, dp_size=2)
    assert next(iter(s)) == [[8, 9], [10, 11], [12, 13], [14, 15]]


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 4), (4, 1)])
def test_resume_from_consumed_samples_continues_exactly(dataset, dp_before, dp_after):
    straight = _global_batch_tokens(dataset, 1, 4)
    steps = 5
    consumed = steps * G  # what a checkpoint saved after 5 iterations
    first = _global_batch_tokens(dataset, dp_before, 2, batches=steps)
    resumed = _global_batch_tokens(dataset, dp_after, 1, consumed=consumed)
    combined = first + resumed
    assert [i for i, _ in combined] == [i for i, _ in straight]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(combined, straight))


def test_resume_at_a_non_multiple_of_the_new_global_batch():
    s = GlobalBatchSampler(100, 24, 2, 8, 0, 1)
    assert next(iter(s))[0] == [24, 25] and len(s) == 9


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="--global-batch-size 10 is not divisible by --micro-batch-size 2 x "
                                         "data-parallel size 4 = 8"):
        GlobalBatchSampler(100, 0, 2, 10, 0, 4)
    with pytest.raises(ValueError, match="dp_rank 4 outside"):
        GlobalBatchSampler(100, 0, 1, 8, 4, 4)
    with pytest.raises(ValueError, match="consumed_samples 120 exceeds"):
        GlobalBatchSampler(100, 120, 1, 8, 0, 1)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        GlobalBatchSampler(100, 0, 0, 8, 0, 1)


def test_last_incomplete_global_batch_is_dropped():
    s = GlobalBatchSampler(TOTAL, 0, 1, G, 0, 1)
    assert len(s) == TOTAL // G and list(s)[-1][-1] == [TOTAL // G * G - 1]


def test_collate_and_loaders(dataset):
    sampler = GlobalBatchSampler(64, 0, micro_batch_size=4, global_batch_size=16, dp_rank=1, dp_size=2)
    batches = list(iter_global_batches(dataset, sampler))
    assert len(batches) == 4 and len(batches[0]) == 2
    mb = batches[0][0]
    assert {k: tuple(v.shape) for k, v in mb.items()} == {
        "tokens": (4, 8), "labels": (4, 8), "loss_mask": (4, 8), "position_ids": (4, 8)}
    assert mb["tokens"].dtype == torch.int64 and mb["loss_mask"].dtype == torch.float32
    assert torch.equal(mb["tokens"][0], dataset[8]["tokens"])
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=MicroBatchSampler(sampler),
                                         collate_fn=collate_samples)
    assert len(loader) == 8
    flat = [mb for batch in batches for mb in batch]
    for got, want in zip(loader, flat):
        assert all(torch.equal(got[k], want[k]) for k in want)


# ---- with a batch ramp-up --------------------------------------------------------------------------------

from fractions import Fraction  # noqa: E402

from hybrid.config.batch import GlobalBatchSchedule  # noqa: E402

# 4 -> 16 by 4 over 40 samples: n = 3 increments, each lasting 40 / 3 samples (not a whole number)
RAMP = GlobalBatchSchedule(16, 4, 4, 40)
RAMP_TOTAL = 150


def _ramp_size(consumed):
    """The ramp's batch after ``consumed`` samples, written independently of the library."""
    passed = (Fraction(consumed) / Fraction(40, 3)).__floor__()
    return min(4 + 4 * passed, 16)


def _ramp_path(total, consumed=0):
    """(c_k, G_k) of every whole global batch from ``consumed`` up to ``total``."""
    path = []
    while consumed + _ramp_size(consumed) <= total:
        path.append((consumed, _ramp_size(consumed)))
        consumed += _ramp_size(consumed)
    return path


def _ramp_batches(dp, micro, consumed=0, total=RAMP_TOTAL):
    """For each global batch: the indices of all DP ranks, rank by rank, micro-batch by micro-batch."""
    samplers = [GlobalBatchSampler(total, consumed, micro, RAMP, r, dp) for r in range(dp)]
    per_rank = [list(s) for s in samplers]
    assert all(len(s) == len(batches) == len(per_rank[0]) for s, batches in zip(samplers, per_rank))
    out = []
    for k in range(len(per_rank[0])):
        assert all(len(mb) == micro for r in range(dp) for mb in per_rank[r][k])
        out.append([i for r in range(dp) for mb in per_rank[r][k] for i in mb])
    return out


def test_the_hand_worked_path_of_the_ramp():
    # stage = floor(c * 3 / 40): c = 0, 4, 8, 12 -> 4 (36 < 40); 16, 24 -> 8 (48, 72 < 80); 32 -> 12 (96 < 120);
    # 44 -> 16 (132 >= 120), then 16 throughout: 60, 76, 92, 108, 124; 140 + 16 > 150 is dropped
    assert _ramp_path(RAMP_TOTAL) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 8), (24, 8), (32, 12), (44, 16),
                                      (60, 16), (76, 16), (92, 16), (108, 16), (124, 16)]


@pytest.mark.parametrize("dp,micro", list(itertools.product((1, 2, 4), (1, 2))))
def test_with_a_ramp_each_global_batch_is_the_next_contiguous_range(dp, micro):
    if any(size % (micro * dp) for size in (4, 8, 12, 16)):
        with pytest.raises(ValueError, match=r"--global-batch-size 4 is not divisible by --micro-batch-size"):
            GlobalBatchSampler(RAMP_TOTAL, 0, micro, RAMP, 0, dp)
        return
    got = _ramp_batches(dp, micro)
    path = _ramp_path(RAMP_TOTAL)
    assert len(got) == len(path) == 13
    for indices, (c, size) in zip(got, path):
        assert indices == list(range(c, c + size)), (dp, micro, c)
    sampler = GlobalBatchSampler(RAMP_TOTAL, 0, micro, RAMP, dp - 1, dp)
    for c, size in path:
        assert len(sampler.micro_batches_at(c)) == size // (micro * dp)


@pytest.mark.parametrize("dp_before,dp_after,steps", [(1, 2, 5), (2, 4, 6), (4, 1, 3), (2, 1, 7), (1, 4, 9)])
def test_with_a_ramp_a_resumed_sampler_continues_the_straight_sequence(dp_before, dp_after, steps):
    straight = _ramp_batches(1, 1)
    before = _ramp_batches(dp_before, 2 if dp_before < 4 else 1)[:steps]  # 4 = 1 x 4: micro 2 would not divide
    consumed = _ramp_path(RAMP_TOTAL)[steps][0]  # 24, 32, 12, 44, 76: mid-ramp and past it
    assert consumed == sum(len(b) for b in before)
    resumed = _ramp_batches(dp_after, 1, consumed=consumed)
    assert len(resumed) == len(straight) - steps
    assert before + resumed == straight


@pytest.mark.parametrize("consumed,total", [(0, 150), (0, 3), (0, 4), (0, 23), (0, 24), (5, 150), (13, 45),
                                            (30, 31), (44, 60), (44, 59), (100, 150), (150, 150)])
def test_with_a_ramp_len_is_the_number_of_batches_yielded(consumed, total):
    for dp, micro in ((1, 1), (2, 2), (4, 1)):
        sampler = GlobalBatchSampler(total, consumed, micro, RAMP, 0, dp)
        batches = list(sampler)
        assert len(sampler) == len(batches) == len(_ramp_path(total, consumed)), (consumed, total, dp)
        assert len(MicroBatchSampler(sampler)) == sum(len(b) for b in batches)
        # from any start the batches follow the ramp's sizes and stay within total
        c = consumed
        for batch in batches:
            assert len(batch) * micro * dp == _ramp_size(c)
            c += _ramp_size(c)
        assert c <= total
