"""Peak memory and the out-of-memory limit, behind one small interface per backend.

* ``cuda``: the caching allocator's own numbers (``max_memory_reserved``) and its own limit
  (``set_per_process_memory_fraction``); a real ``torch.OutOfMemoryError`` is the OOM.
* ``cpu``: a ``TorchDispatchMode`` that counts the bytes of every live tensor storage created
  while it is active (model, optimizer states, activations, gradients, temporaries) and raises
  ``torch.OutOfMemoryError`` the moment the live total passes the budget, as a GPU would.

PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` counts the same bytes but
refuses modules that run twice in one iteration, which is exactly what activation
checkpointing does, so the CPU tracker here keeps only the storage accounting idea.
"""

from __future__ import annotations

import os
import weakref
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten

from trials.roles import StorageLedger

#: the active trackers' ways to count new storages as host memory, innermost last: where the
#: CPU plays the device (this module's tracker, the traced estimator's), a copy "to the host" is
#: a copy on the same CPU that only the tracker can tell apart
_host_scopes: list[Callable[[], AbstractContextManager[Any]]] = []


@contextmanager
def host_scope(scope: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """While active, ``host_memory()`` enters ``scope()`` (a tracker registers itself)."""
    _host_scopes.append(scope)
    try:
        yield
    finally:
        _host_scopes.remove(scope)


def host_memory() -> AbstractContextManager[Any]:
    """A context in which new CPU storages are host memory to the active tracker (what a
    technique that moves tensors to the host allocates them under); nothing when no tracker
    plays the device on the CPU (on a GPU, host tensors are not on the device anyway)."""
    return _host_scopes[-1]() if _host_scopes else nullcontext()


class MemoryMonitor(ABC):
    """Context manager that enforces a byte budget and reports the peak."""

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes

    @abstractmethod
    def __enter__(self) -> MemoryMonitor: ...

    @abstractmethod
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    @property
    @abstractmethod
    def peak_bytes(self) -> int: ...

    @property
    @abstractmethod
    def live_bytes(self) -> int: ...

    def pause(self) -> Any:
        """A context in which allocations are not tracked (used for timing runs)."""
        import contextlib

        return contextlib.nullcontext()

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """These tensors live in host memory (offloaded), not on the device: don't count them.

        On CUDA they are CPU tensors the allocator never sees, so there is nothing to do.
        """
        return None

    def mark_device(self, *tensors: torch.Tensor) -> None:
        """These tensors, made inside ``host_allocations``, are device memory after all: count
        them on the device from their creation on. On CUDA the allocator saw them already."""
        return None

    @property
    def host_offloaded_bytes(self) -> int:
        """Offloaded bytes in host memory at most (0 where the monitor does not see them)."""
        return 0

    def host_allocations(self) -> Any:
        """A context whose new tensors are host memory from birth (ZeRO-3's offloaded parameter
        partitions made by ``deepspeed.zero.Init``). On CUDA they are CPU tensors anyway."""
        import contextlib

        return contextlib.nullcontext()

    def allocator_counted(self) -> Any:
        """A context whose memory only the allocator can count (what ``torch.compile`` runs).
        On CUDA the caching allocator counts everything anyway."""
        import contextlib

        return contextlib.nullcontext()

    def deferred_budget(self) -> Any:
        """A context in which the budget is checked once, at its end, on the peak as corrected
        by ``mark_host`` (DeepSpeed makes its offloaded buffers before they can be marked)."""
        import contextlib

        return contextlib.nullcontext()

    # --- construction and training, measured apart ----------------------------------------------

    @abstractmethod
    def end_construction(self) -> None:
        """The model is built and wrapped; what follows is training. Call once."""

    @property
    @abstractmethod
    def construction_peak_bytes(self) -> int:
        """The peak from entering the monitor to ``end_construction`` (the peak so far before)."""

    @property
    @abstractmethod
    def training_peak_bytes(self) -> int:
        """The peak after ``end_construction`` (0 before)."""

    def sample(self) -> None:
        """Take a reading between steps (the CUDA card count); the CPU tracker sees every op."""
        return None

    def extra(self) -> dict[str, Any]:
        """Backend-specific measurements recorded with the result (e.g. the card's own count)."""
        return {}

    # --- what the bytes at the peak are ---------------------------------------------------------

    def tag(self, role: str, *tensors: torch.Tensor | None) -> None:
        """These tensors' storages hold ``role`` (``trials.roles.ROLES``), for their whole life."""
        return None

    def breakdown(self, construction: bool = False) -> dict[str, int]:
        """Bytes by role at the peak (of construction with ``construction``); ``{}`` where the
        monitor does not attribute storages."""
        return {}


class _LiveStorageCounter(TorchDispatchMode):
    """Counts each distinct storage once, from the op that created it until it is freed.

    An op on a wrapper subclass (a DTensor, torchao's low-bit optimizer states) is handed back
    (``NotImplemented``) for the subclass to run with this mode still on: the ops it runs on
    its inner tensors, and the temporaries they make, are counted here one by one, as
    ``torch.distributed._tools.mem_tracker`` does for DTensor. Counted at the wrapper's level
    instead, those temporaries were invisible (torchao's eager 8-bit AdamW step on
    tiny-llama: 50,331,656 B seen of the 111,181,832 B the CPU allocator reports)."""

    def __init__(self, owner: CpuMemoryMonitor) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self.owner._track(t)
        self.owner._check_budget(func)
        return out


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor's data: itself, or, for a wrapper subclass (a
    DTensor: FSDP2's shards, their gradients and states; torchao's 8-/4-bit optimizer states),
    the inner tensors it flattens to (``__tensor_flatten__``), recursively. A wrapper's own
    storage is a placeholder of its logical size and dtype: it is counted by its inner
    tensors."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inners = (getattr(t, name) for name in names)  # a DTensor's mesh too: not a tensor
    return [p for inner in inners if isinstance(inner, torch.Tensor) for p in plain_tensors(inner)]


def _storages(
    tensors: tuple[torch.Tensor, ...],
) -> Iterator[tuple[int, torch.UntypedStorage]]:
    """(tracking key, storage) of each tensor that has a storage (not a fake or sparse one)."""
    for t in (inner for outer in tensors for inner in plain_tensors(outer)):
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            continue
        yield id(storage), storage


class CpuMemoryMonitor(MemoryMonitor):
    """Live tensor bytes on the CPU, counted per storage, with a hard budget.

    On this backend the CPU plays the device, so DeepSpeed's "offload to CPU" has to be told
    apart: tensors passed to ``mark_host`` (the offloaded fp32 master partitions, their gradients
    and optimizer states; stage 3's offloaded parameter partitions) are host memory. They leave
    the device count from their creation on: every allocation appends the device's live bytes
    to a timeline, and marking subtracts the tensor's bytes over the span it was already alive,
    so ``peak_bytes`` is the device peak as if they had been on the host from the start.
    ``host_offloaded_bytes`` is the most host bytes seen live after marking. The online budget check
    uses the device bytes known at that moment (a tensor not yet marked still counts).
    ``mark_device`` is the reverse, for storages made inside ``host_allocations`` that are device
    memory after all (DeepSpeed's reduce bucket, made with its offloaded partitions).
    """

    def __init__(self, budget_bytes: int | None) -> None:
        super().__init__(budget_bytes)
        self._live = 0  # device bytes (tracked, not marked host)
        self._peak = 0
        self._seen: set[int] = set()
        self._host: dict[int, int] = {}  # storage key -> bytes, marked as host memory
        self._host_live = 0
        self._host_peak = 0
        self._host_log = array("q")  # host live bytes after each change (for mark_device)
        self._host_born: dict[int, int] = {}  # host-born storage key -> its index in _host_log
        self._host_corrections: list[tuple[int, int, int]] = []  # (from, to, bytes) in _host_log
        self._timeline = array("q")  # device live bytes after each allocation
        self._born: dict[int, int] = {}  # storage key -> its index in the timeline
        self._corrections: list[tuple[int, int, int]] = []  # (from, to, bytes) to subtract
        self._mode: _LiveStorageCounter | None = None
        self._paused = False
        self._host_births = False  # inside host_allocations(): new storages are host memory
        self._construction_end: int | None = None  # timeline index where training starts
        self._deferred = False  # inside deferred_budget(): no online check
        self._ledger = StorageLedger()  # each storage's life on the timeline and its role
        self._saved_hooks: Any = None  # autograd's saved-tensor hooks: what backward keeps
        self._scope: Any = None  # host_memory() answers with host_allocations() meanwhile
        #: storage key -> its bytes now, where a resize changed them since its birth
        self._resized_to: dict[int, int] = {}
        self._resize: Any = None  # torch.UntypedStorage.resize_ while the monitor is entered
        self._eager: Any = None  # torch.compiler's force_eager stance, entered with the monitor
        self._opaque = False  # some steps counted by the allocator (``allocator_counted``)

    def _track(self, t: torch.Tensor) -> None:
        if self._paused or t.device.type != "cpu" or t.is_meta:
            return
        if is_traceable_wrapper_subclass(t):
            for inner in plain_tensors(t):
                self._track(inner)
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return  # sparse or other storage-less tensors
        if storage.device.type == "meta":
            return  # a FakeTensor (DTensor's sharding propagation makes some): no bytes
        key = id(storage)
        if key in self._seen:
            # ``Tensor.resize_`` grows or shrinks a known storage in place (an op the mode sees,
            # unlike ``UntypedStorage.resize_``, patched in ``__enter__``)
            self._resized(storage, storage.nbytes())
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        if self._host_births:
            self._host[key] = nbytes
            self._host_live += nbytes
            self._host_peak = max(self._host_peak, self._host_live)
            # where it starts on both timelines, should it turn out to be device memory
            self._born[key] = len(self._timeline)
            self._host_born[key] = len(self._host_log)
            self._host_log.append(self._host_live)
            weakref.finalize(storage, self._release, key, nbytes)
            return
        self._live += nbytes
        self._peak = max(self._peak, self._live)
        self._born[key] = len(self._timeline)
        self._ledger.born(key, len(self._timeline), nbytes)
        self._timeline.append(self._live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A tracked device storage resized in place (FSDP2 frees the all-gathered parameters
        with ``resize_(0)`` and allocates them again with ``resize_(n)``: no op the dispatch
        mode sees): to 0 it dies on the timeline, from 0 it is born again."""
        key = id(storage)
        if self._paused or key not in self._seen or key in self._host:
            return
        old = self._counted(key)
        if old is None or nbytes == old:
            return
        index = len(self._timeline)
        if old:
            self._ledger.died(key, index)
        if nbytes:
            self._ledger.born(key, index, nbytes)
        self._resized_to[key] = nbytes
        self._live += nbytes - old
        self._peak = max(self._peak, self._live)
        self._timeline.append(self._live)

    def _counted(self, key: int) -> int | None:
        """The bytes a tracked device storage is counted at now: its size at birth or at its
        last resize seen (0 once resized away; a resize while paused is not seen, so this is
        not always the storage's size). None: the ledger has no record of it."""
        return self._resized_to.get(key, self._ledger.nbytes(key))

    def _release(self, key: int, nbytes: int) -> None:
        nbytes = self._resized_to.pop(key, nbytes)
        self._seen.discard(key)
        self._ledger.died(key, len(self._timeline))
        self._born.pop(key, None)
        self._host_born.pop(key, None)
        host = self._host.pop(key, None)
        if host is not None:
            self._host_live -= host  # what it was counted at when it became host memory
            self._host_log.append(self._host_live)
        else:
            self._live -= nbytes

    def mark_host(self, *tensors: torch.Tensor) -> None:
        """Count these tensors' storages as host memory, from their creation on."""
        for key, storage in _storages(tensors):
            if key not in self._seen or key in self._host:
                continue  # not tracked (made while paused or before) or already host
            # the bytes it is counted at on the device move (a resize while paused changed the
            # storage, not the count)
            counted = self._counted(key)
            nbytes = storage.nbytes() if counted is None else counted
            self._host[key] = nbytes
            self._ledger.host(key)
            self._live -= nbytes
            self._host_live += nbytes
            self._host_peak = max(self._host_peak, self._host_live)
            self._host_log.append(self._host_live)
            self._corrections.append((self._born[key], len(self._timeline), nbytes))

    def mark_device(self, *tensors: torch.Tensor) -> None:
        """Count these host-born storages on the device, from their creation on: the reverse of
        ``mark_host`` (a correction that adds their bytes over the span they were alive)."""
        for key, _ in _storages(tensors):
            if key not in self._host_born:
                continue  # not host-born: tracked on the device already, or not tracked
            nbytes = self._host.pop(key)
            born, now = self._born[key], len(self._timeline)
            self._live += nbytes
            self._peak = max(self._peak, self._live)
            self._ledger.born(key, born, nbytes)
            self._corrections.append((born, now, -nbytes))
            host_born = self._host_born.pop(key)
            self._host_corrections.append((host_born, len(self._host_log), nbytes))
            self._host_live -= nbytes
            self._host_log.append(self._host_live)
            # the device holds them now: the timeline says so before its next allocation (a
            # deferred budget that ends here checks this peak)
            self._timeline.append(self._live)

    @property
    def host_offloaded_bytes(self) -> int:
        if not self._host_corrections:
            return self._host_peak
        # the host log with the storages handed back to the device taken out while they lived
        n = len(self._host_log)
        delta = [0] * (n + 1)
        for start, end, nbytes in self._host_corrections:
            delta[start] += nbytes
            delta[end] -= nbytes
        best, running = 0, 0
        for i in range(n):
            running += delta[i]
            best = max(best, self._host_log[i] - running)
        return best

    def host_allocations(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def _host() -> Any:
            previous, self._host_births = self._host_births, True
            try:
                yield
            finally:
                self._host_births = previous

        return _host()

    def track_existing(self, *tensors: torch.Tensor) -> None:
        """Count tensors made before the monitor started (e.g. the model on the GPU path)."""
        for t in tensors:
            self._track(t)

    def deferred_budget(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def _deferred() -> Any:
            previous, self._deferred = self._deferred, True
            try:
                yield
            finally:
                self._deferred = previous
            peak, budget = self.peak_bytes, self.budget_bytes
            if budget is not None and peak > budget:
                raise torch.OutOfMemoryError(
                    f"CPU tracker: out of memory: device peak {peak} bytes, budget {budget} bytes"
                )

        return _deferred()

    def _check_budget(self, func: Any) -> None:
        if self._deferred:
            return
        if self.budget_bytes is not None and self._live > self.budget_bytes:
            live, budget = self._live, self.budget_bytes
            raise torch.OutOfMemoryError(
                f"CPU tracker: out of memory in {func}: {live} bytes live, budget {budget} bytes"
            )

    def _pack_saved(self, t: torch.Tensor) -> torch.Tensor:
        """Autograd saves ``t`` for backward: its storage is an activation (unless it is
        already a parameter, say). The tensor itself is what autograd keeps."""
        if not self._paused:
            self.tag("activations", t)
        return t

    def __enter__(self) -> CpuMemoryMonitor:
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, _unpack)
        self._saved_hooks.__enter__()
        self._mode = _LiveStorageCounter(self)
        self._mode.__enter__()
        self._scope = host_scope(self.host_allocations)
        self._scope.__enter__()
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            self._resized(storage, int(size))
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        # torch.compile can't trace under a dispatch mode: what the trial compiles (torchao's
        # low-bit optimizer step) runs eagerly here, counted op by op
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        assert self._mode is not None
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        self._eager.__exit__(exc_type, exc, tb)
        self._scope.__exit__(exc_type, exc, tb)
        self._mode.__exit__(exc_type, exc, tb)
        self._mode = None
        self._saved_hooks.__exit__(exc_type, exc, tb)
        self._saved_hooks = None

    def pause(self) -> Any:
        import contextlib

        from torch.utils._python_dispatch import _disable_current_modes

        @contextlib.contextmanager
        def _paused() -> Any:
            self._paused = True
            try:
                with _disable_current_modes():
                    yield
            finally:
                self._paused = False

        return _paused()

    def allocator_counted(self) -> Any:
        """A context whose memory the CPU allocator counts, not the dispatch mode: what
        ``torch.compile`` runs (dynamo does not trace under a dispatch mode, and inductor's
        kernels allocate their buffers below the dispatcher; what compiles here must also leave
        the monitor's ``force_eager`` stance itself, as the compiled blocks do).
        ``torch.profiler`` reports every allocation and free of the CPU allocator
        (``profile_memory``); the live bytes at entry plus the most those events add up to is
        the peak inside, and the budget is checked on it at the end (the step runs to its end
        first). Storages made inside are counted by
        bytes, not by name: no role is attributed to them (``breakdown`` falls back to the
        engine's, as on CUDA), and one made inside and freed outside such a context stays
        counted, so a trial that uses it runs all its tracked steps inside."""
        import contextlib

        from torch.profiler import ProfilerActivity, profile

        @contextlib.contextmanager
        def _by_allocator() -> Any:
            start = self._live
            with (
                self.pause(),
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
            ):
                yield
            running = top = 0
            for nbytes in allocator_events(prof):
                running += nbytes
                top = max(top, running)
            # the profiler reports no free of a block allocated before it started: tracked
            # storages freed inside left the count by the tracker's own release, and the
            # allocator's events add what changed besides (the peak inside is counted as if
            # those storages lived to the end: high, never low)
            self._timeline.append(start + top)
            self._live += running
            self._timeline.append(self._live)
            self._peak = max(self._peak, start + top)
            self._opaque = True
            budget = self.budget_bytes
            if budget is not None and start + top > budget:
                raise torch.OutOfMemoryError(
                    f"CPU allocator: out of memory: peak {start + top} bytes, budget {budget} bytes"
                )

        return _by_allocator()

    def tag(self, role: str, *tensors: torch.Tensor | None) -> None:
        held = (inner for outer in tensors if outer is not None for inner in plain_tensors(outer))
        for t in held:
            if t.device.type != "cpu" or t.is_meta:
                continue
            try:
                self._ledger.tag(id(t.untyped_storage()), role)
            except (NotImplementedError, RuntimeError):
                continue  # storage-less tensors

    def end_construction(self) -> None:
        self._construction_end = len(self._timeline)

    def _peak_index(self, first: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(timeline index, device bytes) of the peak over entries ``first`` to ``stop - 1``,
        with the bytes later marked as host taken out of the span they were alive."""
        n = len(self._timeline)
        stop = n if stop is None else min(stop, n)
        delta = [0] * (n + 1)
        for start, end, nbytes in self._corrections:
            delta[start] += nbytes
            delta[end] -= nbytes
        best, where, running = 0, -1, 0
        for i in range(stop):
            running += delta[i]
            if i >= first and self._timeline[i] - running > best:
                best, where = self._timeline[i] - running, i
        return where, best

    @property
    def construction_peak_bytes(self) -> int:
        return self._peak_index(0, self._construction_end)[1]

    @property
    def training_peak_bytes(self) -> int:
        if self._construction_end is None:
            return 0
        return self._peak_index(self._construction_end)[1]

    def breakdown(self, construction: bool = False) -> dict[str, int]:
        if self._opaque and not construction:
            return {}  # the allocator counted bytes, not storages
        stop = self._construction_end if construction else None
        where, _ = self._peak_index(0, stop)
        return self._ledger.roles_at(where) if where >= 0 else {}

    @property
    def peak_bytes(self) -> int:
        if not self._corrections:
            return self._peak
        return self._peak_index()[1]

    @property
    def live_bytes(self) -> int:
        return self._live


def allocator_events(prof: Any) -> Iterator[int]:
    """The CPU allocator's allocations (positive bytes) and frees (negative) a
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order."""
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    return (int(e.nbytes()) for e in events)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class CudaMemoryMonitor(MemoryMonitor):
    """The caching allocator's reserved bytes and what the process holds on the card.

    ``max_memory_reserved`` misses what lives outside the allocator (the CUDA context, cuBLAS
    and NCCL workspaces: hundreds of MiB), so the card is read too (NVML per process where it
    reports, else ``mem_get_info`` less what other processes held at the start), after
    construction and after each warm-up step. The allocator's limit is the budget less what the
    process already held outside it; the card count is checked against the budget as well.
    """

    def __init__(self, budget_bytes: int | None, device: int = 0) -> None:
        super().__init__(budget_bytes)
        self.device = device
        self._others = 0  # bytes other processes held on the card when the trial started
        self._card_peak = 0
        self._construction_reserved: int | None = None
        self._construction_card = 0
        self.fraction: float | None = None

    def card_bytes(self) -> int:
        from trials.cuda import card_bytes, nvml_process_bytes

        mine = nvml_process_bytes(self.device)
        if mine is not None:
            return mine
        free, total = torch.cuda.mem_get_info(self.device)
        return card_bytes(total, free, self._others)

    def sample(self) -> None:
        """Read the card; past the budget it is an OOM, as the allocator's own would be."""
        from trials.cuda import over_card_budget

        torch.cuda.synchronize(self.device)
        card = self.card_bytes()
        self._card_peak = max(self._card_peak, card)
        message = over_card_budget(card, self.budget_bytes)
        if message:
            raise torch.OutOfMemoryError(message)

    def __enter__(self) -> CudaMemoryMonitor:
        from trials.cuda import allocator_fraction, nvml_process_bytes

        free, total = torch.cuda.mem_get_info(self.device)  # creates the context
        torch.cuda.set_device(self.device)
        mine = nvml_process_bytes(self.device)
        reserved = int(torch.cuda.memory_reserved(self.device))
        # With NVML the count is this process's own, context included. Without it, what the
        # card held at the start (others and this context) is the baseline, and what the
        # process adds beyond it (allocator, workspaces, NCCL buffers) is counted.
        self._others = 0 if mine is not None else max(0, total - free - reserved)
        outside = (mine - reserved) if mine is not None else 0
        if self.budget_bytes is not None:
            self.fraction = allocator_fraction(self.budget_bytes, total, outside)
            torch.cuda.set_per_process_memory_fraction(self.fraction, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize(self.device)

    def end_construction(self) -> None:
        self.sample()
        self._construction_reserved = int(torch.cuda.max_memory_reserved(self.device))
        self._construction_card = self._card_peak
        # training's peaks start here, the card's as the allocator's
        self._card_peak = 0
        torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def construction_peak_bytes(self) -> int:
        if self._construction_reserved is None:
            return max(int(torch.cuda.max_memory_reserved(self.device)), self._card_peak)
        return max(self._construction_reserved, self._construction_card)

    @property
    def training_peak_bytes(self) -> int:
        if self._construction_reserved is None:
            return 0
        return max(int(torch.cuda.max_memory_reserved(self.device)), self._card_peak)

    @property
    def peak_bytes(self) -> int:
        return max(self.construction_peak_bytes, self.training_peak_bytes)

    @property
    def live_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def extra(self) -> dict[str, Any]:
        from trials.cuda import ALLOC_CONF_ENV

        return {
            "max_memory_reserved": int(torch.cuda.max_memory_reserved(self.device)),
            "card_peak_bytes": self._card_peak,
            "allocator_fraction": self.fraction,
            "alloc_conf": os.environ.get(ALLOC_CONF_ENV, ""),
        }


MONITORS: dict[str, type[MemoryMonitor]] = {
    "cpu": CpuMemoryMonitor,
    "cuda": CudaMemoryMonitor,
}


def make_monitor(backend: str, budget_bytes: int | None, rank: int = 0) -> MemoryMonitor:
    if backend == "cuda":
        return CudaMemoryMonitor(budget_bytes, device=rank % max(1, torch.cuda.device_count()))
    return MONITORS[backend](budget_bytes)
