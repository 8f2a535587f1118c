import mmap

import torch

from hybrid.monitor.memory import MemoryStats, process_rss, read_memory_stats


def test_cpu_stats_track_a_large_allocation():
    before = read_memory_stats(torch.device("cpu"))
    assert before.kind == "rss" and before.reserved_bytes is None
    assert 0 < before.allocated_bytes <= before.peak_bytes
    # A fresh anonymous mapping, touched page by page from this thread: a malloc'd block could reuse pages
    # that earlier tests in this process freed but the allocator kept resident, and move RSS by nothing.
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = read_memory_stats()
    assert after.allocated_bytes >= before.allocated_bytes + 48 * 2**20
    assert after.peak_bytes >= after.allocated_bytes
    del block
    # The high-water mark keeps the freed block (the kernel's RSS counters lag by a few pages).
    assert read_memory_stats().peak_bytes >= before.allocated_bytes + 48 * 2**20


def test_process_rss_matches_proc_status():
    rss, peak = process_rss()
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    hwm = int(fields["VmHWM"].split()[0]) * 1024
    assert 0 < rss <= peak
    assert abs(peak - hwm) <= 8 * 2**20


def test_describe():
    assert MemoryStats("rss", 2**30, 2 * 2**30).describe() == "mem rss 1.00 GiB | peak rss 2.00 GiB"
    assert MemoryStats("cuda", 2**30, 3 * 2**30, 2 * 2**30).describe() == \
        "mem alloc 1.00 GiB | reserved 2.00 GiB | peak 3.00 GiB"
