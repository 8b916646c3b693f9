"""torch_mp._memory.PeakMemory: the storages counted at the dispatcher (on the CPU here)."""

from __future__ import annotations

import torch

from torch_mp._memory import PeakMemory

MB = 1 << 20


def test_new_storages_count_while_they_live_and_views_and_in_place_results_do_not():
    before = torch.zeros(MB, dtype=torch.uint8)  # made before: never counted
    with PeakMemory() as memory:
        a = torch.ones(MB, dtype=torch.uint8)
        b = a.view(2, -1)[0]  # a view of a: the same storage
        a.add_(1)
        before.add_(1)
        assert memory.current == MB
        c = a + 1
        assert memory.current == 2 * MB
        del c
        d = torch.empty(0)  # (an operator, after c died)
        assert memory.current == MB
        assert memory.peak == 2 * MB
    assert b.numel() == MB // 2 and d.numel() == 0 and memory.operators > 0


def test_a_storage_counts_at_its_size_of_the_moment():
    with PeakMemory() as memory:
        full = torch.ones(4 * MB, dtype=torch.uint8)
        full.untyped_storage().resize_(0)  # as ZeRO-3 frees a gathered parameter
        assert memory.current == 0
        small = torch.ones(MB, dtype=torch.uint8)
        assert memory.peak == 4 * MB and memory.current == MB
        full.untyped_storage().resize_(2 * MB)
        assert memory.current == 3 * MB
    assert small.numel() == MB


def test_a_dead_storages_address_reused_counts_the_new_one():
    with PeakMemory() as memory:
        for _ in range(50):  # (the allocator hands the same address back)
            x = torch.ones(MB, dtype=torch.uint8)
            del x
        y = torch.ones(MB, dtype=torch.uint8)
        assert memory.current == MB and memory.peak == MB
    assert y.numel() == MB
