"""The range arithmetic agrees with hybrid.param_meta.shard / merge, the definition of the TP layout."""

import itertools

import pytest
import torch

from hybrid import param_meta
from hybrid.convert.ranges import assemble, shard_runs, source_runs
from hybrid.param_meta import TPMeta

# (meta, full shape): plain, row-parallel, fused qkv (stride 3), SwiGLU [gate; up] (stride 2), padded vocab.
CASES = [
    (TPMeta(dim=0), (24, 5)),
    (TPMeta(dim=1), (5, 24)),
    (TPMeta(dim=0, stride=3), (36, 4)),
    (TPMeta(dim=0, stride=3), (36,)),
    (TPMeta(dim=0, stride=2), (48, 3)),
    (TPMeta(dim=0, logical_size=21, pad_multiple=4), (21, 3)),
]


@pytest.mark.parametrize("meta,shape", CASES)
@pytest.mark.parametrize("saved_tp,target_tp", [(1, 2), (2, 1), (2, 3), (3, 2), (4, 2), (2, 2)])
def test_assemble_equals_merge_then_shard(meta, shape, saved_tp, target_tp):
    if meta.logical_size is None:
        assert all(shape[meta.dim] % (meta.stride * t) == 0 for t in (saved_tp, target_tp))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    pieces = [param_meta.shard(full, meta, saved_tp, r) for r in range(saved_tp)]
    calls = []

    def read(rank, start, stop):
        calls.append(stop - start)
        return pieces[rank].narrow(meta.dim, start, stop - start)

    target_meta = TPMeta(meta.dim, meta.stride, meta.logical_size, pad_multiple=3 if meta.logical_size else 1)
    for rank in range(target_tp):
        want = param_meta.shard(full, target_meta, target_tp, rank)
        got = assemble(read, want.shape, full.dtype, meta, saved_tp, shape[meta.dim], target_meta, target_tp, rank)
        assert torch.equal(got, want)
    # Only the rows the targets hold were read: every logical entry once over all target ranks.
    assert sum(calls) == shape[meta.dim]
    merged = param_meta.merge(pieces, meta)
    whole = assemble(read, full.shape, full.dtype, meta, saved_tp, shape[meta.dim],
                     TPMeta(meta.dim, meta.stride, meta.logical_size), 1, 0)
    assert torch.equal(whole, merged) and torch.equal(whole, full)


def test_runs_cover_the_range_exactly_once():
    meta = TPMeta(dim=0, stride=3)
    for start, stop in itertools.combinations(range(0, 37, 5), 2):
        runs = list(source_runs(meta, 36, 2, start, stop))
        assert [r.full_start for r in runs] == sorted(r.full_start for r in runs)
        assert runs[0].full_start == start and sum(r.length for r in runs) == stop - start
    # 10 rows padded to 16 for tp=2: rank 1 holds rows 8-9 and 6 rows of zero padding.
    pad = shard_runs(TPMeta(dim=0, logical_size=10, pad_multiple=4), 10, 2, 1)
    assert [(r.local_start, r.full_start, r.length) for r in pad] == [(0, 8, 2), (2, None, 6)]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="divisible by 6"):
        list(source_runs(TPMeta(dim=0, stride=3), 32, 2, 0, 4))
    with pytest.raises(ValueError, match="outside the full size"):
        list(source_runs(TPMeta(dim=0), 8, 2, 0, 9))


# Grouped-query q/k/v: 8 query heads and 2 key/value heads of 2 rows each, split and replicated over TP.
GQA = TPMeta(dim=0, blocks=((16, 8), (4, 2), (4, 2)))


@pytest.mark.parametrize("saved_tp,target_tp", [(1, 2), (2, 4), (4, 1), (4, 2), (8, 4)])
def test_blocks_assemble_equals_shard_and_replicate_key_value_heads(saved_tp, target_tp):
    full = torch.randn(24, 3, generator=torch.Generator().manual_seed(1))
    pieces = [param_meta.shard(full, GQA, saved_tp, r) for r in range(saved_tp)]
    assert torch.equal(param_meta.merge(pieces, GQA), full)

    def read(rank, start, stop):
        return pieces[rank].narrow(0, start, stop - start)

    for rank in range(target_tp):
        want = param_meta.shard(full, GQA, target_tp, rank)
        got = assemble(read, want.shape, full.dtype, GQA, saved_tp, 24, GQA, target_tp, rank)
        assert torch.equal(got, want)
    # At tp=4 rank r holds query heads 2r, 2r+1 and key/value head r // 2: rows 4r..4r+3, then k and v rows.
    tp4 = [param_meta.shard(full, GQA, 4, r) for r in range(4)]
    for r in range(4):
        kv = r // 2
        assert torch.equal(tp4[r], torch.cat([full[4 * r: 4 * r + 4], full[16 + 2 * kv: 18 + 2 * kv],
                                              full[20 + 2 * kv: 22 + 2 * kv]]))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_norm_ranges_count_every_element_once(tp):
    # Count how often each full element is counted over the TP ranks: exactly once, replicated or not.
    for meta, shape in CASES[:3] + [(GQA, (24, 3)), (param_meta.REPLICATED, (5, 3))]:
        if meta.blocks is None and meta.partitioned and shape[meta.dim] % (meta.stride * tp):
            continue
        full = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
        counts = torch.zeros(full.numel())
        for rank in range(tp):
            piece = param_meta.shard(full, meta, tp, rank).reshape(-1)
            for lo, hi in param_meta.norm_ranges(meta, param_meta.shard(full, meta, tp, rank).shape, tp, rank):
                counts[piece[lo:hi].long()] += 1
        assert torch.equal(counts, torch.ones_like(counts)), (meta, tp)


def test_units_and_tp_must_divide_one_another():
    assert param_meta.split_units(2, 4) == 2 and param_meta.split_units(8, 4) == 4
    with pytest.raises(ValueError, match="num_query_groups=3 and the tensor-parallel size tp=2 must divide one "
                                         "another"):
        param_meta.split_units(3, 2, "num_query_groups")
    assert GQA == TPMeta.from_json(GQA.to_json()) and "blocks" not in TPMeta(dim=0, stride=3).to_json()
