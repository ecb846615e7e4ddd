"""The CUDA monitor (``trials/memory.py``'s ``CudaMemoryMonitor``) on the CPU, against a small
stateful stand-in for the CUDA runtime (this machine has no GPU, so the real one cannot run).

The stand-in keeps, per card, its total and free bytes, the caching allocator's reserved bytes
and their peak since the last reset, the allocator's fraction, and what NVML reports for this
process (None: NVML does not report). Like torch, a device of ``None`` is the current device
and ``set_device(None)`` is refused; like ``trials.cuda.nvml_process_bytes``, an NVML error (an
index that is not a card's) answers None. Every call is recorded with the card it reached.

The monitor watches card 1; card 0 holds other numbers, and the trial's code makes card 0
current after entering, so a read of the wrong card shows. Expected values by hand, from the
class docstring's rules:

* with NVML the card count is the process's own bytes; without it, ``total - free`` less what
  the other processes held at the start (``total - free - reserved`` then, never below 0);
* the allocator's fraction is ``(budget - outside) / total`` where ``outside`` is NVML's bytes
  less the allocator's reserved bytes at the start (0 without NVML);
* ``sample()`` past the budget (one byte over; at it is fine) is a ``torch.OutOfMemoryError``;
* construction's peak is the allocator's and the card's up to ``end_construction``, training's
  what follows (0 before), the peak the larger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import trials.cuda
from trials.cuda import ALLOC_CONF_ENV
from trials.memory import CudaMemoryMonitor

MON = 1  # the monitor's card; 0 is another one, current by default


@dataclass
class Card:
    total: int
    free: int
    reserved: int = 0
    peak: int = 0
    nvml: int | None = None  # this process's bytes as NVML reports them
    fraction: float | None = None


@dataclass
class FakeCuda:
    cards: dict[int, Card]
    current: int = 0
    calls: list[tuple[str, int | None]] = field(default_factory=list)

    def _card(self, name: str, device: int | None) -> Card:
        index = self.current if device is None else device
        self.calls.append((name, index))
        return self.cards[index]

    def reserve(self, device: int, nbytes: int) -> None:
        """The allocator now holds ``nbytes`` on the card (its peak follows)."""
        card = self.cards[device]
        card.reserved = nbytes
        card.peak = max(card.peak, nbytes)

    # --- torch.cuda ---------------------------------------------------------------------------

    def mem_get_info(self, device: int | None = None) -> tuple[int, int]:
        card = self._card("mem_get_info", device)
        return card.free, card.total

    def set_device(self, device: int) -> None:
        if not isinstance(device, int):  # torch's _get_device_index(None) refuses it
            raise ValueError(f"Expected a device index, but got: {device}")
        self.calls.append(("set_device", device))
        self.current = device

    def memory_reserved(self, device: int | None = None) -> int:
        return self._card("memory_reserved", device).reserved

    def max_memory_reserved(self, device: int | None = None) -> int:
        return self._card("max_memory_reserved", device).peak

    def reset_peak_memory_stats(self, device: int | None = None) -> None:
        card = self._card("reset_peak_memory_stats", device)
        card.peak = card.reserved

    def set_per_process_memory_fraction(self, fraction: float, device: int | None = None) -> None:
        if not isinstance(fraction, float):  # as torch checks
            raise TypeError("Invalid type for fraction argument, must be `float`")
        self._card("set_per_process_memory_fraction", device).fraction = fraction

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", None))

    def synchronize(self, device: int | None = None) -> None:
        self._card("synchronize", device)

    def device_count(self) -> int:
        return len(self.cards)

    # --- trials.cuda --------------------------------------------------------------------------

    def nvml_process_bytes(self, device_index: int, pid: int | None = None) -> int | None:
        if not isinstance(device_index, int):  # NVML's error: nvml_process_bytes answers None
            return None
        self.calls.append(("nvml_process_bytes", device_index))
        return self.cards[device_index].nvml

    def devices(self, name: str) -> list[int | None]:
        return [device for call, device in self.calls if call == name]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda(
        cards={
            0: Card(total=50_000, free=1_000, reserved=30_000, peak=40_000, nvml=33_333),
            MON: Card(total=16_000, free=12_000, reserved=1_000, peak=2_000),
        }
    )
    for name in (
        "mem_get_info",
        "set_device",
        "memory_reserved",
        "max_memory_reserved",
        "reset_peak_memory_stats",
        "set_per_process_memory_fraction",
        "empty_cache",
        "synchronize",
        "device_count",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(trials.cuda, "nvml_process_bytes", fake.nvml_process_bytes)
    return fake


def _oom(card: int, budget: int) -> str:
    return (
        f"CUDA out of memory (card): the process holds {card} bytes on the card, "
        f"budget {budget} bytes"
    )


def test_without_nvml_the_card_is_counted_past_what_others_held(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Card 1 at the start: 4,000 of 16,000 bytes used, 1,000 of them the allocator's, so the
    others held 3,000; the budget 10,000 with nothing counted outside: fraction 10/16."""
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:True")
    card = cuda.cards[MON]
    mon = CudaMemoryMonitor(10_000, device=MON)
    with pytest.raises(torch.OutOfMemoryError) as oom, mon as entered:
        assert entered is mon
        assert cuda.current == MON  # the trial's tensors go to its card
        assert mon.fraction == 0.625
        assert card.fraction == 0.625
        assert cuda.cards[0].fraction is None
        assert ("empty_cache", None) in cuda.calls
        assert card.peak == 1_000  # reset to what is reserved now
        assert cuda.devices("mem_get_info") == [MON]
        assert cuda.devices("nvml_process_bytes") == [MON]
        cuda.current = 0  # the trial's code makes card 0 current

        # construction: the allocator reaches 5,000; the card holds 3,000 + 5,500
        cuda.reserve(MON, 5_000)
        card.free = 16_000 - 3_000 - 5_500
        assert mon.construction_peak_bytes == 5_000  # no card reading yet
        assert mon.training_peak_bytes == 0
        mon.end_construction()
        assert card.peak == 5_000  # reset on card 1 after its reading
        assert mon.construction_peak_bytes == 5_500
        assert mon.extra()["card_peak_bytes"] == 0  # training's card readings: none yet

        # training: the allocator peaks at 7,000 and keeps 6,000; the card holds 3,000 + 6,500
        cuda.reserve(MON, 7_000)
        cuda.reserve(MON, 6_000)
        card.free = 16_000 - 3_000 - 6_500
        mon.sample()
        assert mon.construction_peak_bytes == 5_500
        assert mon.training_peak_bytes == 7_000
        assert mon.peak_bytes == 7_000
        assert mon.live_bytes == 6_000
        assert mon.extra() == {
            "max_memory_reserved": 7_000,
            "card_peak_bytes": 6_500,
            "allocator_fraction": 0.625,
            "alloc_conf": "expandable_segments:True",
        }

        # the card count above the allocator's, exactly at the budget: not an OOM
        card.free = 16_000 - 3_000 - 10_000
        mon.sample()
        assert mon.training_peak_bytes == 10_000
        assert mon.peak_bytes == 10_000
        assert mon.construction_peak_bytes == 5_500

        # one byte over the budget: the allocator's own kind of OOM
        card.free = 16_000 - 3_000 - 10_001
        mon.sample()
    assert cuda.calls[-1] == ("synchronize", MON)  # __exit__
    assert str(oom.value) == _oom(10_001, 10_000)
    assert mon.extra()["card_peak_bytes"] == 10_001
    assert mon.peak_bytes == 10_001
    assert cuda.devices("synchronize") == [MON] * 5  # 4 samples, then __exit__
    assert {device for _, device in cuda.calls} <= {MON, None}
    assert cuda.cards[0].peak == 40_000  # card 0 untouched


def test_with_nvml_the_count_is_the_process_own(cuda: FakeCuda) -> None:
    """NVML says 3,000 at the start, 500 of them the allocator's: 2,500 outside it, so the
    allocator gets (10,000 - 2,500) / 16,000 of the card. Later counts are NVML's, whatever
    the card's free bytes say."""
    card = cuda.cards[MON]
    card.reserved = 500
    card.nvml = 3_000
    mon = CudaMemoryMonitor(10_000, device=MON)
    with mon:
        assert mon.fraction == 7_500 / 16_000
        assert card.fraction == 0.46875
        cuda.current = 0
        cuda.reserve(MON, 4_000)
        card.nvml = 6_000
        card.free = 1_000  # used 15,000: not the process's count
        mon.end_construction()
        assert mon.card_bytes() == 6_000
        assert mon.construction_peak_bytes == 6_000
        assert mon.extra()["card_peak_bytes"] == 0  # training's card readings: none yet

        # NVML stops answering: the card's used bytes, with no baseline taken at the start
        card.nvml = None
        card.free = 9_000
        assert mon.card_bytes() == 7_000

        card.nvml = 10_001
        with pytest.raises(torch.OutOfMemoryError, match=r"holds 10001 bytes"):
            mon.sample()
        assert mon.training_peak_bytes == 10_001
        assert mon.extra()["allocator_fraction"] == 0.46875
    assert cuda.devices("nvml_process_bytes") == [MON] * 5
    assert cuda.devices("mem_get_info") == [MON, MON]  # at the start; once without NVML


def test_no_budget_sets_no_fraction_and_never_runs_out(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    card = cuda.cards[MON]
    card.reserved = 0
    card.free = 12_000
    mon = CudaMemoryMonitor(None, device=MON)
    with mon:
        assert mon.budget_bytes is None
        assert mon.construction_peak_bytes == 0  # nothing reserved, no card reading yet
        assert mon.extra() == {
            "max_memory_reserved": 0,
            "card_peak_bytes": 0,
            "allocator_fraction": None,
            "alloc_conf": "",
        }
        card.free = 0  # the whole card: 16,000 - 4,000 held by the others
        mon.sample()
        assert mon.peak_bytes == 12_000
    assert mon.fraction is None
    assert card.fraction is None
    assert cuda.devices("set_per_process_memory_fraction") == []


def test_others_never_below_zero(cuda: FakeCuda) -> None:
    """The allocator reserved all the card used at the start (1,000): the others held 0."""
    card = cuda.cards[MON]
    card.free = 15_000
    mon = CudaMemoryMonitor(None, device=MON)
    with mon:
        card.free = 14_000
        assert mon.card_bytes() == 2_000


def test_before_entering(cuda: FakeCuda) -> None:
    """Made, not entered: card 0 by default, the budget kept, no baseline yet (the card's
    used bytes), no peaks."""
    mon = CudaMemoryMonitor(123)
    assert mon.device == 0
    assert mon.budget_bytes == 123
    assert mon.fraction is None
    on_one = CudaMemoryMonitor(None, device=MON)
    assert on_one.card_bytes() == 4_000
    assert on_one.training_peak_bytes == 0
    assert on_one.construction_peak_bytes == 2_000


def test_training_peak_starts_after_construction(cuda: FakeCuda) -> None:
    """Construction held 5,500 B on the card (read at ``end_construction``); training then holds
    at most 5,200 (the allocator 5,000): the training peak is 5,200, construction's stays
    5,500, and the trial's peak is the larger. The card's peak restarts with training as the
    allocator's does (``reset_peak_memory_stats``); before, training inherited construction's
    card reading."""
    card = cuda.cards[MON]
    mon = CudaMemoryMonitor(None, device=MON)
    with mon:
        cuda.reserve(MON, 5_000)
        card.free = card.total - 5_500 - 3_000  # the others' 3,000 held from the start
        mon.end_construction()
        card.free = card.total - 5_200 - 3_000
        mon.sample()
        assert mon.construction_peak_bytes == 5_500
        assert mon.training_peak_bytes == 5_200
        assert mon.peak_bytes == 5_500
        assert mon.extra()["card_peak_bytes"] == 5_200
