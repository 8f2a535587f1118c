"""The instruments the truth tests rely on measure what they claim."""

from __future__ import annotations

import torch

from hybrid.plan.measure import LiveTensorTracker, SavedActivations, live_tensor_bytes, storage_keys


def test_tracker_follows_allocations_frees_and_in_place_ops():
    keep = torch.zeros(1000)  # exists before: counted at entry, recognised when an op returns it
    with LiveTensorTracker() as tracker:
        start = tracker.start_bytes
        a = torch.ones(25_000)  # 100 kB
        b = a * 2  # 200 kB live
        del a  # 100 kB
        keep.add_(1)  # in place: nothing new
        c = torch.empty(50_000)  # 300 kB
        assert tracker.current_bytes - start == 300_000
        del b, c
        view = keep[10:]  # a view shares its base's storage
        assert tracker.current_bytes == start
    assert tracker.peak_bytes - start == 300_000
    assert view.untyped_storage().nbytes() == 4000


def test_saved_activations_count_storages_once_and_skip_parameters():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    with SavedActivations(storage_keys([w])) as saved:
        h = x @ w  # saves x (and w, excluded)
        y = (h * h).sum()  # saves h twice: one storage
    assert saved.bytes == x.numel() * 4 + h.numel() * 4
    y.backward()


def test_live_tensor_bytes_sees_new_tensors():
    before = live_tensor_bytes()
    t = torch.empty(1 << 18)  # 1 MiB
    assert live_tensor_bytes() - before >= t.numel() * 4


def test_tensors_a_compiler_keeps_are_not_counted():
    """torch.compile leaves fake tensors in its caches (no memory, no data pointer): the tracker skips them."""
    f = torch.compile(lambda x: (x * 2).sin(), backend="aot_eager")
    f(torch.randn(8))
    with LiveTensorTracker() as tracker:
        torch.ones(256)
    assert tracker.peak_bytes >= tracker.start_bytes + 256 * 4
