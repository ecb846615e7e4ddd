import pytest
import torch

from trials.memory import CpuMemoryMonitor


def test_counts_live_bytes_and_frees() -> None:
    with CpuMemoryMonitor(None) as mon:
        a = torch.empty(1000, dtype=torch.float32)
        assert mon.live_bytes == 4000
        b = a.view(10, 100)  # a view shares the storage: counted once
        c = torch.zeros(500, dtype=torch.float16)
        assert mon.live_bytes == 5000
        del a, b
        assert mon.live_bytes == 1000
        del c
        assert mon.live_bytes == 0
    assert mon.peak_bytes == 5000


def test_over_budget_raises_the_gpu_oom() -> None:
    with (
        pytest.raises(torch.OutOfMemoryError, match="budget 10000 bytes"),
        CpuMemoryMonitor(10_000),
    ):
        keep = [torch.empty(1000) for _ in range(5)]
        assert len(keep) == 5


def test_pause_stops_counting() -> None:
    with CpuMemoryMonitor(None) as mon:
        with mon.pause():
            big = torch.empty(10**6)
        assert mon.live_bytes == 0
        small = torch.empty(10)
        assert mon.live_bytes == 40
    del big, small
