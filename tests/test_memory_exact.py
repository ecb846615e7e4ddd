"""The CPU tracker (``trials/memory.py``'s ``CpuMemoryMonitor``) byte for byte, against counts
made by hand from real torch tensors: a 1,000-element fp32 tensor is 4,000 bytes of storage, a
500-element one 2,000, a 100-element one 400, a 10-element one 40; a view or an in-place op
allocates nothing; ``UntypedStorage.resize_`` changes a storage's bytes in place. What the
tracker must do with them: the live device bytes and their peak, host memory (``mark_host``,
``host_allocations``, ``host_memory``) kept out of the device count, ``mark_device`` putting
host-born bytes back on it from their birth, the budget (one byte over is the GPU's OOM,
exactly at it is not), ``pause``, construction and training peaks apart, and the roles at the
peak (tagged by hand; autograd's saved input of a Linear layer as activations)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import trials.memory as memory
from trials.memory import CpuMemoryMonitor, CudaMemoryMonitor, host_memory, host_scope, make_monitor
from trials.roles import ROLES

F1000 = 4_000  # torch.empty(1000): 1,000 fp32 elements
F500 = 2_000
F2000 = 8_000
F100 = 400
F10 = 40


def _roles(**bytes_by_role: int) -> dict[str, int]:
    return {role: bytes_by_role.get(role, 0) for role in ROLES}


def _sparse() -> torch.Tensor:
    """A tensor without a storage of its own (``untyped_storage()`` refuses it)."""
    return torch.sparse_coo_tensor(
        torch.tensor([[0]]), torch.tensor([1.0]), (3,), check_invariants=True
    )


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Errors raised where nobody can catch them (the tracker's storage finalizers)."""
    errors: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", errors.append)
    yield errors


# --- live bytes and the peak -------------------------------------------------------------------


def test_a_monitor_that_sees_nothing_reports_nothing() -> None:
    before = torch.empty(1000)  # made before the monitor: not seen
    fresh = CpuMemoryMonitor(None)
    with fresh:
        pass
    assert fresh.peak_bytes == 0
    assert fresh.live_bytes == 0
    assert fresh.host_offloaded_bytes == 0
    assert fresh.construction_peak_bytes == 0
    assert fresh.training_peak_bytes == 0
    assert fresh.breakdown() == {}
    assert fresh.breakdown(construction=True) == {}
    del before


def test_alloc_free_views_and_in_place_ops() -> None:
    with CpuMemoryMonitor(None) as mon:
        a = torch.ones(1000)
        assert mon.live_bytes == F1000 == a.untyped_storage().nbytes()
        a.mul_(2).add_(1)  # in place: no new storage
        v = a[10:20].view(2, 5)
        assert mon.live_bytes == F1000
        del a, v
        assert mon.live_bytes == 0
    assert mon.peak_bytes == F1000


def test_track_existing_counts_cpu_tensors_only_and_not_while_paused() -> None:
    before = torch.empty(1000)
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.empty(1000, device="cuda")  # no card needed: a fake tensor
    assert on_gpu.device.type == "cuda"
    with CpuMemoryMonitor(None) as mon:
        mon.track_existing(on_gpu, torch.empty(10, device="meta"))
        assert mon.live_bytes == 0
        with mon.pause():
            mon.track_existing(before)
        assert mon.live_bytes == 0
        mon.track_existing(before)
        assert mon.live_bytes == F1000


# --- the budget ---------------------------------------------------------------------------------


def test_exactly_at_the_budget_is_no_oom() -> None:
    with CpuMemoryMonitor(F1000) as mon:
        a = torch.empty(1000)
    assert mon.peak_bytes == F1000
    del a


def test_one_byte_over_is_the_gpu_oom_naming_the_op() -> None:
    with (
        pytest.raises(
            torch.OutOfMemoryError, match=r"out of memory in aten\.empty.*4000 bytes live"
        ),
        CpuMemoryMonitor(F1000 - 1),
    ):
        torch.empty(1000)


def test_deferred_budget_checks_the_corrected_peak_at_its_end() -> None:
    with CpuMemoryMonitor(F1000) as mon:
        with mon.deferred_budget():
            a = torch.empty(1000)
            b = torch.empty(500)  # 6,000 live: over, but not checked yet
            mon.mark_host(b)  # host memory from birth: the device peak is 4,000
        assert mon.peak_bytes == F1000
        with (
            pytest.raises(torch.OutOfMemoryError, match="device peak 6000 bytes"),
            mon.deferred_budget(),
        ):
            c = torch.empty(500)
    del a, b, c


# --- resize_ in place -----------------------------------------------------------------------------


def test_storage_resize_shrinks_and_grows_the_count() -> None:
    with CpuMemoryMonitor(None) as mon:
        t = torch.empty(1000)
        s = t.untyped_storage()
        s.resize_(0)
        assert mon.live_bytes == 0
        assert s.resize_(F500) is s  # what torch's own resize_ returns: the storage
        assert mon.live_bytes == F500
        s.resize_(F2000)
        assert mon.live_bytes == F2000
        s.resize_(0)
        del t, s  # freed at its size now: 0
        assert mon.live_bytes == 0
    assert mon.peak_bytes == F2000


def test_a_tensor_resized_in_place_is_counted_at_its_new_size() -> None:
    """``Tensor.resize_`` (an aten op, not the storage's own resize) grows a tensor's storage
    in place: 10 fp32 elements (40 B) grown to 1,000 are 4,000 B live, shrunk back they stay
    4,000 (torch keeps the larger storage); freed, nothing. Found by a surviving mutant: the
    count stayed at 40 B and a later host mark could drive it below zero."""
    with CpuMemoryMonitor(None) as mon:
        t = torch.empty(10)
        assert mon.live_bytes == 40
        t.resize_(1000)
        assert mon.live_bytes == 4_000 == t.untyped_storage().nbytes()
        t.resize_(10)
        assert mon.live_bytes == 4_000 == t.untyped_storage().nbytes()
        del t
        assert mon.live_bytes == 0
        assert mon.peak_bytes == 4_000


def test_resizes_while_paused_or_of_host_storages_are_not_counted() -> None:
    with CpuMemoryMonitor(None) as mon:
        t = torch.empty(1000)
        with mon.pause():
            t.untyped_storage().resize_(0)
        assert mon.live_bytes == F1000
        h = torch.empty(500)
        mon.mark_host(h)
        h.untyped_storage().resize_(0)
        assert mon.live_bytes == F1000
    assert mon.peak_bytes == F1000
    del t, h


def test_mark_host_moves_what_was_counted_whatever_a_paused_resize_did() -> None:
    """A storage resized while paused is still counted at its size when last seen (4,000 B):
    marked host, those bytes leave the device count and come off the host's when it is freed
    (they had moved 8,000 B, leaving the device at -4,000, or 0 B, leaving 4,000 behind)."""
    for size in (2000, 0):
        with CpuMemoryMonitor(None) as mon:
            t = torch.empty(1000)
            with mon.pause():
                t.untyped_storage().resize_(4 * size)
            mon.mark_host(t)
            assert mon.live_bytes == 0
            assert mon.host_offloaded_bytes == F1000
            del t
            assert mon.live_bytes == 0
            with mon.host_allocations():
                h = torch.empty(1000)  # the host count back at 0 before it: not below
            assert mon.host_offloaded_bytes == F1000
            h2 = torch.empty(10)
            assert mon.live_bytes == F10
            del h, h2


def test_a_resize_to_the_same_size_keeps_the_role() -> None:
    with CpuMemoryMonitor(None) as mon:
        w = torch.empty(1000)
        mon.tag("parameters", w)
        w.untyped_storage().resize_(F1000)
        x = torch.empty(10)
        assert mon.peak_bytes == F1000 + F10
        assert mon.breakdown() == _roles(parameters=F1000, other=F10)
    del w, x


def test_a_storage_resized_away_leaves_the_roles_and_comes_back_untagged() -> None:
    with CpuMemoryMonitor(None) as mon:
        w = torch.empty(1000)
        mon.tag("parameters", w)
        w.untyped_storage().resize_(0)
        big = torch.empty(2000)
        assert mon.breakdown() == _roles(other=F2000)  # w is gone at this peak
        w.untyped_storage().resize_(F1000)  # born again: a new storage, untagged
        mon.tag("gradients", w)
        assert mon.peak_bytes == F2000 + F1000
        assert mon.breakdown() == _roles(gradients=F1000, other=F2000)
    del w, big


# --- host memory --------------------------------------------------------------------------------


def test_mark_host_leaves_the_device_count_from_birth(unraisable: list[Any]) -> None:
    sparse = _sparse()  # made outside: its indices and values are storages of their own
    with CpuMemoryMonitor(None) as mon:
        a = torch.empty(1000)
        mon.tag("optimizer_states", a)
        b = torch.empty(500)
        mon.mark_host(sparse, a, b)  # a storage-less tensor first: skipped
        assert mon.live_bytes == 0
        assert mon.host_offloaded_bytes == F1000 + F500
        assert mon.peak_bytes == 0  # as if they had lived on the host all along
        assert mon.breakdown() == {}
        c = torch.empty(2000)
        assert mon.peak_bytes == F2000
        assert mon.breakdown() == _roles(other=F2000)  # a is not on the device
        del a, b
        assert mon.live_bytes == F2000
    assert unraisable == []
    del c


def test_host_births_add_up_and_their_frees_come_off(unraisable: list[Any]) -> None:
    with CpuMemoryMonitor(None) as mon:
        with mon.host_allocations():
            a = torch.empty(1000)
            b = torch.empty(500)
        assert mon.live_bytes == 0
        assert mon.host_offloaded_bytes == F1000 + F500
        del b
        with mon.host_allocations():
            c = torch.empty(1000)  # 8,000 host bytes live: the new most
        assert mon.host_offloaded_bytes == F1000 + F1000
        del a, c
        assert mon.live_bytes == 0
    assert mon.peak_bytes == 0
    assert unraisable == []


def test_host_memory_is_the_active_monitors_host_allocations() -> None:
    with host_memory():  # no tracker: nothing special
        pass
    with CpuMemoryMonitor(None) as mon:
        with host_memory():
            h = torch.empty(1000)
        d = torch.empty(10)
        assert mon.live_bytes == F10
        assert mon.host_offloaded_bytes == F1000
    entered: list[str] = []

    class _Scope:
        def __enter__(self) -> None:
            entered.append("in")

        def __exit__(self, *args: object) -> None:
            entered.append("out")

    with host_scope(_Scope), host_memory():
        assert entered == ["in"]
    assert entered == ["in", "out"]
    del h, d


def test_mark_device_counts_host_births_on_the_device_from_birth() -> None:
    with CpuMemoryMonitor(None) as mon:
        d = torch.empty(100)
        with mon.host_allocations():
            h1 = torch.empty(1000)
            h2 = torch.empty(500)
        assert mon.live_bytes == F100
        mon.mark_device(d, h1)  # d is device memory already: nothing for it
        assert mon.live_bytes == F100 + F1000
        mon.tag("gradients", h1)
        x = torch.empty(10)
        assert mon.peak_bytes == F100 + F1000 + F10
        assert mon.breakdown() == _roles(gradients=F1000, other=F100 + F10)
        with mon.host_allocations():
            h3 = torch.empty(1000)
        # h1 was device memory all along: the host held h2, then h2 and h3
        assert mon.host_offloaded_bytes == F500 + F1000
    del d, h1, h2, h3, x


def test_the_peak_holds_host_births_moved_to_the_device_at_once() -> None:
    """Read right after ``mark_device``, before any other allocation: the peak already holds
    them (a deferred budget ending there checks it: one byte under is the OOM)."""
    with CpuMemoryMonitor(None) as mon:
        d = torch.empty(100)
        with mon.host_allocations():
            h = torch.empty(1000)
        mon.mark_device(h)
        assert mon.live_bytes == mon.peak_bytes == F100 + F1000
    with (
        pytest.raises(torch.OutOfMemoryError),
        CpuMemoryMonitor(F100 + F1000 - 1) as mon,
        mon.deferred_budget(),
    ):
        d = torch.empty(100)  # before the host birth: no earlier entry the correction lifts
        with mon.host_allocations():
            h = torch.empty(1000)
        mon.mark_device(h)
    del d, h


def test_the_peak_is_where_the_device_held_most_once_host_bytes_are_taken_out() -> None:
    """By hand: 4,000 B, then 2,000 more (later marked host), then 40 more: the device held
    4,000, 4,000 and 4,040 B, so the peak is 4,040 B, at the third allocation."""
    with CpuMemoryMonitor(None) as mon:
        a = torch.empty(1000)
        h = torch.empty(500)
        b = torch.empty(10)
        mon.mark_host(h)
    assert mon.peak_bytes == F1000 + F10
    del a, h, b


def test_the_peak_can_be_the_first_allocation() -> None:
    """4,000 B allocated and freed, then 40 B marked host: the peak is the first entry."""
    with CpuMemoryMonitor(None) as mon:
        a = torch.empty(1000)
        del a
        b = torch.empty(10)
        mon.mark_host(b)
    assert mon.peak_bytes == F1000
    del b


def test_mark_device_adds_its_bytes_over_the_span_they_lived() -> None:
    """By hand: 400 B on the device, 4,000 B born as host memory, 2,000 B on the device and
    freed, then the 4,000 B handed to the device: they were there from birth, so the device
    held 400 + 4,000 + 2,000 = 6,400 B at the 2,000 B allocation."""
    with CpuMemoryMonitor(None) as mon:
        d = torch.empty(100)
        with mon.host_allocations():
            h = torch.empty(1000)
        e = torch.empty(500)
        del e
        mon.mark_device(h)
        assert mon.live_bytes == F100 + F1000
    assert mon.peak_bytes == F100 + F1000 + F500
    del d, h


def test_mark_host_skips_untracked_and_already_host_storages_and_goes_on() -> None:
    """A tensor made while paused is not tracked: marking it host changes nothing, and the
    tensors after it in the same call are still marked; marking one twice moves it once."""
    with CpuMemoryMonitor(None) as mon:
        with mon.pause():
            untracked = torch.empty(1000)
        t = torch.empty(500)
        mon.mark_host(untracked, t)
        assert mon.live_bytes == 0
        mon.mark_host(t)
        assert mon.live_bytes == 0
        assert mon.host_offloaded_bytes == F500
    del untracked, t


def test_two_host_births_moved_to_the_device_together() -> None:
    with CpuMemoryMonitor(None) as mon:
        d = torch.empty(100)
        with mon.host_allocations():
            h1 = torch.empty(1000)  # both born at the same point of the device's timeline
            h2 = torch.empty(500)
        a = torch.empty(10)
        mon.mark_device(h1, h2)
        del h1, h2
        b = torch.empty(10)
        assert mon.live_bytes == F100 + F10 + F10
    assert mon.peak_bytes == F100 + F1000 + F500 + F10
    del d, a, b


def test_mark_device_on_device_storages_is_a_no_op() -> None:
    """Over and over: a device storage often takes the address a freed host-born one had."""
    with CpuMemoryMonitor(None) as mon:
        for _ in range(200):
            with mon.host_allocations():
                h = torch.empty(10)
            del h
            d = torch.empty(10)
            mon.mark_device(d)
            assert mon.live_bytes == F10
            del d
        assert mon.live_bytes == 0
        assert mon.host_offloaded_bytes == F10


def test_mark_host_then_free_leaves_no_device_bytes_behind() -> None:
    with CpuMemoryMonitor(None) as mon:
        t = torch.empty(1000)
        mon.mark_host(t)
        del t
        assert mon.live_bytes == 0
        u = torch.empty(10)
        assert mon.live_bytes == F10
    assert mon.peak_bytes == F10
    del u


# --- pause, construction and training -----------------------------------------------------------


def test_pause_counts_nothing_and_tags_nothing() -> None:
    with CpuMemoryMonitor(None) as mon:
        lin = torch.nn.Linear(10, 10)
        with mon.pause():
            y = lin(torch.randn(1000, 10))
        assert mon.live_bytes == 440
    assert mon.peak_bytes == 440
    del y


def test_construction_and_training_peaks_and_their_breakdowns() -> None:
    with CpuMemoryMonitor(None) as mon:
        w = torch.empty(1000)
        mon.tag("parameters", w)
        assert mon.training_peak_bytes == 0  # before end_construction
        mon.end_construction()
        act = torch.empty(2000)
        mon.tag("activations", act)
        del act
        tmp = torch.empty(100)
    assert mon.construction_peak_bytes == F1000
    assert mon.training_peak_bytes == F1000 + F2000
    assert mon.peak_bytes == F1000 + F2000
    assert mon.breakdown(construction=True) == _roles(parameters=F1000)
    assert mon.breakdown() == _roles(parameters=F1000, activations=F2000)
    del w, tmp


def test_a_freed_storage_is_not_in_a_later_peaks_breakdown() -> None:
    with CpuMemoryMonitor(None) as mon:
        a = torch.empty(1000)
        mon.tag("activations", a)
        del a
        b = torch.empty(2000)
    assert mon.peak_bytes == F2000
    assert mon.breakdown() == _roles(other=F2000)
    del b


def test_a_peak_reached_twice_is_broken_down_where_first_reached() -> None:
    with CpuMemoryMonitor(None) as mon:
        a = torch.empty(1000)
        mon.tag("parameters", a)
        del a
        b = torch.empty(1000)
        mon.tag("gradients", b)
    assert mon.peak_bytes == F1000
    assert mon.breakdown() == _roles(parameters=F1000)
    del b


# --- roles --------------------------------------------------------------------------------------


def test_tag_skips_none_meta_and_storage_less_tensors() -> None:
    sparse = _sparse()
    with CpuMemoryMonitor(None) as mon:
        p = torch.empty(1000)
        g = torch.empty(500)
        mon.tag("parameters", None, torch.empty(4, device="meta"), p)
        mon.tag("gradients", sparse, g)
        assert mon.breakdown() == _roles(parameters=F1000, gradients=F500)
    del p, g


def test_a_linear_layers_saved_input_is_activations() -> None:
    with CpuMemoryMonitor(None) as mon:
        lin = torch.nn.Linear(10, 10)  # 100 + 10 fp32: 440 bytes
        mon.tag("parameters", *lin.parameters())
        x = torch.randn(1000, 10)  # saved by addmm for the weight's gradient
        y = lin(x)  # the output: untagged
        assert mon.peak_bytes == 440 + 40_000 + 40_000
        assert mon.breakdown() == _roles(parameters=440, activations=40_000, other=40_000)
    del x, y


# --- entering and leaving -----------------------------------------------------------------------


class _Refused(Exception):
    """An error that cannot be made without its argument."""

    def __init__(self, code: int) -> None:
        super().__init__(f"refused {code}")
        self.code = code


def _refuse() -> None:
    raise _Refused(7)


def test_an_error_inside_comes_out_unchanged_with_its_traceback() -> None:
    mon = CpuMemoryMonitor(None)
    try:
        with pytest.raises(_Refused) as info, mon:
            torch.empty(10)
            _refuse()
        assert info.value.code == 7
        assert any(entry.name == "_refuse" for entry in info.traceback)
        assert mon._mode is None
    finally:  # a broken exit must not leave the tracker installed for the tests after this one
        if isinstance(mon._mode, TorchDispatchMode):
            mon._mode.__exit__(None, None, None)
            mon._saved_hooks.__exit__()
            memory._host_scopes.clear()
    assert memory._host_scopes == []
    with host_memory():
        h = torch.empty(10)
    del h


def test_leaving_twice_or_unentered_is_refused_and_leaves_torch_alone() -> None:
    resize = torch.UntypedStorage.resize_
    try:
        with pytest.raises(AssertionError):
            CpuMemoryMonitor(None).__exit__(None, None, None)
        assert torch.UntypedStorage.resize_ is resize
        mon = CpuMemoryMonitor(None)
        with mon:
            pass
        with pytest.raises(AssertionError):
            mon.__exit__(None, None, None)
        assert torch.UntypedStorage.resize_ is resize
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


# --- picking the monitor ------------------------------------------------------------------------


def test_make_monitor_cpu() -> None:
    mon = make_monitor("cpu", 123)
    assert type(mon) is CpuMemoryMonitor
    assert mon.budget_bytes == 123


def test_make_monitor_cuda_picks_the_ranks_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only made, never entered: no card is touched."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    mon = make_monitor("cuda", 123, rank=5)
    assert type(mon) is CudaMemoryMonitor
    assert mon.budget_bytes == 123
    assert mon.device == 1  # 5 mod 4
    default = make_monitor("cuda", None)
    assert isinstance(default, CudaMemoryMonitor)
    assert default.device == 0
    assert default.budget_bytes is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one = make_monitor("cuda", None, rank=3)
    assert isinstance(one, CudaMemoryMonitor)
    assert one.device == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    none = make_monitor("cuda", None, rank=3)
    assert isinstance(none, CudaMemoryMonitor)
    assert none.device == 0


# --- tensor subclasses and fake tensors ---------------------------------------------------------


class _Wrapped(torch.Tensor):
    """A wrapper subclass (as a DTensor or torchao's low-bit state is) around one plain tensor,
    whose ops make a float64 temporary of its inner tensor first (as a dequantize would)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inners: dict, meta: Any, size: Any, stride: Any) -> _Wrapped:
        return _Wrapped(inners["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.utils._pytree import tree_map_only

        plain = tree_map_only(_Wrapped, lambda w: w.inner, args)
        temporary = plain[0].double()
        out = func(*plain, **(kwargs or {}))
        del temporary
        return tree_map_only(torch.Tensor, _Wrapped, out)


def test_a_subclass_op_is_counted_inside_its_own_dispatch() -> None:
    """``w + 1`` on a wrapper of 1,000 fp32 values, by hand: its inner tensor (4,000 B), the
    float64 temporary (8,000 B) and the result's inner tensor (4,000 B) at once; then the
    temporary freed. (Counted at the wrapper's level the temporary was invisible: 8,000 B.)"""
    with CpuMemoryMonitor(None) as mon:
        w = _Wrapped(torch.empty(1000))
        assert mon.live_bytes == F1000
        r = w + 1
        assert isinstance(r, _Wrapped)
        assert mon.live_bytes == 2 * F1000
    assert mon.peak_bytes == F1000 + F2000 + F1000
    del w, r


def test_fake_tensors_made_under_the_tracker_count_nothing() -> None:
    """DTensor's sharding propagation makes fake tensors inside its dispatch, where the tracker
    now looks: they have no bytes."""
    with CpuMemoryMonitor(None) as mon:
        with FakeTensorMode():
            fake = torch.empty(1000)
        assert mon.live_bytes == 0
        real = torch.empty(10)
    assert mon.peak_bytes == F10
    del fake, real


def _allocator_peak(step: Any) -> int:
    """The most the CPU allocator's live bytes rose during ``step()``, from torch.profiler's
    own memory events (the oracle: the allocator, not the tracker)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    running = top = 0
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    for event in events:
        if event.name() == "[memory]":
            running += event.nbytes()
            top = max(top, running)
    return top


def test_torchaos_eager_step_is_counted_as_the_allocator_counts_it() -> None:
    """torchao's 8-bit AdamW on a 1,048,576-value tensor (its states made by a first step):
    the eager second step's rise over the live bytes, counted by the tracker, is the CPU
    allocator's to the byte (55,590,920 B here; at the states' level the tracker saw less than
    half of it)."""
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit

    def setup() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1_048_576))
        optimizer = AdamW8bit([p], lr=1e-3)
        p.grad = torch.randn_like(p)
        with torch.compiler.set_stance("force_eager"):
            optimizer.step()
        p.grad = torch.randn_like(p)
        return p, optimizer

    p, optimizer = setup()
    with torch.compiler.set_stance("force_eager"):
        oracle = _allocator_peak(optimizer.step)
    p, optimizer = setup()
    with CpuMemoryMonitor(None) as mon:
        # what the step may free or replace is known to the tracker before it
        mon.track_existing(p, p.grad, *optimizer.state[p].values())
        before = mon.live_bytes
        optimizer.step()
    assert mon.peak_bytes - before == oracle > 13 * 4 * p.numel()


def test_the_allocator_count_by_hand() -> None:
    """``allocator_counted`` (a compiled trial's steps): the live bytes at its start (400 B,
    tracked) plus the most the allocator's events add up to inside, in their order: 4,000 and
    2,000 B allocated, the 4,000 freed, 40 allocated: peak 6,400 B, 2,440 B live after."""
    with CpuMemoryMonitor(None) as mon:
        keep = torch.empty(100)
        with mon.allocator_counted():
            a = torch.empty(1000)
            b = torch.empty(500)
            del a
            c = torch.empty(10)
        assert mon.live_bytes == F100 + F500 + F10
    assert mon.peak_bytes == F100 + F1000 + F500
    # bytes, not storages: no roles for the training peak; construction's are the tracker's
    assert mon.breakdown() == {}
    assert mon.breakdown(construction=True) == _roles(other=F100)
    del keep, b, c


def test_a_tracked_storage_freed_under_the_allocators_count_leaves_it() -> None:
    """The profiler reports no free of a block allocated before it started: a tracked 4,000 B
    storage freed inside ``allocator_counted`` leaves the live count by the tracker's release
    (it stayed at 4,000 B)."""
    with CpuMemoryMonitor(None) as mon:
        x = torch.empty(1000)
        with mon.allocator_counted():
            del x
            y = torch.empty(10)
        assert mon.live_bytes == F10
        del y
