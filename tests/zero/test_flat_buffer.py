"""Flat buffers, segments, partitions and the parameter index (single process, no communication)."""

import pytest
import torch
from torch import nn

from hybrid.param_meta import set_tp_meta
from hybrid.zero.flat_buffer import (ALIGN_BYTES, ZeroConfigError, build_flat_groups, param_chunk_sets,
                                     param_parts, plan_segments)
from tests.zero.common import TiedMLP, no_decay


def test_segments_are_padded_aligned_and_hold_whole_params():
    numels = [10, 300, 11, 1000, 5]
    segs = plan_segments(numels, parts=4, bucket_numel=320, align=32)
    # 10+300 fits in 320; 11 more would overflow -> new segment; 1000 alone (bigger than a bucket); 5 alone.
    assert [s.records for s in segs] == [(0, 1), (2,), (3,), (4,)]
    assert [s.used for s in segs] == [310, 11, 1000, 5]
    starts = 0
    for s in segs:
        assert s.start == starts
        assert s.size % (4 * 32) == 0 and s.used <= s.size < s.used + 4 * 32
        starts += s.size


def test_segments_end_where_the_keys_change_and_only_there():
    numels = [10, 20, 30, 40, 50]
    chunk_sets = [frozenset({0}), frozenset({0}), frozenset({1}), frozenset({1}), frozenset({0, 1})]
    unkeyed = plan_segments(numels, parts=2, bucket_numel=1000, align=4)
    keyed = plan_segments(numels, parts=2, bucket_numel=1000, align=4, keys=chunk_sets)
    assert [s.records for s in unkeyed] == [(0, 1, 2, 3, 4)]
    assert [s.records for s in keyed] == [(0, 1), (2, 3), (4,)]
    # the bucket size still cuts inside a run of one key; equal keys never force a cut
    assert [s.records for s in plan_segments(numels, 2, 45, 4, keys=chunk_sets)] == [(0, 1), (2,), (3,), (4,)]
    assert plan_segments(numels, 2, 1000, 4, keys=[None] * 5) == unkeyed
    with pytest.raises(ZeroConfigError, match="4 segment keys for 5 parameters"):
        plan_segments(numels, 2, 1000, 4, keys=chunk_sets[:4])


def test_chunk_sets_name_the_chunks_reaching_each_parameter():
    a, b, c, d = (nn.Parameter(torch.zeros(2)) for _ in range(4))
    # d is in no chunk's list: every pass reaches it; b is in both (a tied head, say)
    assert param_chunk_sets([a, b, c, d], [[a, b], [b, c]]) == [frozenset({0}), frozenset({0, 1}),
                                                                 frozenset({1}), frozenset({0, 1})]
    assert param_chunk_sets(["x", "y"], [["x"], ["y"]]) == [frozenset({0}), frozenset({1})]  # names work too
    assert param_chunk_sets([a], [[a]]) is None and param_chunk_sets([a], None, chunks=2) is None


def test_param_parts_cover_a_straddling_parameter_exactly():
    seg = plan_segments([100, 200], parts=4, bucket_numel=10_000, align=8)[0]
    assert seg.size == 320  # 300 rounded up to a multiple of 4 * 8; chunks of 80
    parts = param_parts(offset=100, numel=200, segment=seg, parts=4)
    # The second parameter [100, 300) spans chunk 1 [80,160), chunk 2 [160,240), chunk 3 [240,320).
    assert [(p.part, p.param_start, p.param_end, p.partition_offset) for p in parts] == [
        (1, 0, 60, 20), (2, 60, 140, 0), (3, 140, 200, 0)]


def test_groups_rebind_params_as_views_and_skip_tied_and_frozen():
    torch.manual_seed(0)
    model = TiedMLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = build_flat_groups(model, parts=4, pad_parts=4, bucket_numel=500, use_weight_decay=True,
                               no_weight_decay=no_decay)
    names = [r.name for g in groups for r in g.records]
    assert "head.weight" not in names and "frozen.weight" not in names and "frozen.bias" not in names
    assert sorted(names) == sorted(["embed.weight", "fc1.weight", "fc1.bias", "norm.weight", "norm.bias",
                                    "fc2.weight", "fc2.bias"])
    assert [(g.dtype, g.weight_decay) for g in groups] == [(torch.float32, True), (torch.float32, False)]
    assert [r.name for r in groups[0].records] == ["embed.weight", "fc1.weight", "fc2.weight"]
    for g in groups:
        assert g.numel % (4 * ALIGN_BYTES // 4) == 0
        for rec, p in zip(g.records, g.params):
            assert p.data_ptr() == g.buffer[rec.offset:].data_ptr()
            assert torch.equal(p.detach(), before[rec.name])
            assert sum(pt.param_end - pt.param_start for pt in rec.parts) == rec.numel
            # every piece sits in the matching chunk of the part's flat partition
            for pt in rec.parts:
                seg = g.segments[rec.segment]
                lo, _ = seg.chunk_range(pt.part, 4)
                assert pt.partition_offset == seg.start // 4 + rec.offset + pt.param_start - lo
    # the tied head still shares the embedding's (now flat) storage
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    # a segment boundary was crossed: several segments in the big group
    assert len(groups[0].segments) > 1


def test_mixed_dtypes_get_separate_buffers_and_tp_meta_is_recorded():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    model[0].to(torch.bfloat16)
    set_tp_meta(model[0].weight, dim=0)
    groups = build_flat_groups(model, parts=2, pad_parts=2, bucket_numel=10_000, use_weight_decay=False,
                               no_weight_decay=None)
    assert [g.dtype for g in groups] == [torch.bfloat16, torch.float32]
    rec = groups[0].records[0]
    assert rec.tp_meta.partitioned and rec.tp_meta.dim == 0
    assert rec.to_json()["dtype"] == "bfloat16"
    assert groups[0].segments[0].size % (2 * ALIGN_BYTES // 2) == 0


def test_bad_models_get_clear_errors():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ZeroConfigError, match="no trainable parameters"):
        build_flat_groups(frozen, 1, 1, 100, False, None)
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(ZeroConfigError, match="meta device"):
        build_flat_groups(meta, 1, 1, 100, False, None)
    with pytest.raises(ZeroConfigError, match="bucket_numel"):
        plan_segments([1], 1, 0, 1)


def test_a_pass_through_one_chunk_launches_its_segments_as_they_fill():
    # The launch queue of the gradient reducers, as a backward pass through one model chunk of an interleaved
    # pipeline stage sees it: segment 1 holds two records of which the pass reaches one, segments 0 and 2
    # belong to the other chunk. Segment 1 launches as soon as its reached record arrives, without waiting for
    # segment 0 ahead of it; segments 0 and 2 never launch.
    from hybrid.zero.buckets import _LaunchQueue

    launched = []
    queue = _LaunchQueue([(0, s) for s in range(4)], [1, 2, 1, 1], launched.append)
    queue.reset({1: 1, 3: 1})
    queue.mark(1)
    assert launched == [1]
    queue.mark(3)
    queue.flush()
    assert launched == [1, 3]
    # a pass through the whole model waits for every record in order
    launched.clear()
    queue.reset()
    queue.mark(1)
    assert launched == []
    queue.flush()
    assert launched == [0, 1, 2, 3]
