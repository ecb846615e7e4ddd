"""The CUDA side of a trial as pure functions: what counts as out of memory, what the process
really holds on the card, the allocator's limit, the allocator config a trial ran with.

They take plain numbers and strings so the CPU test suite checks them; ``CudaMemoryMonitor``
(``trials/memory.py``) and the job call them with what ``torch.cuda`` and NVML report.
"""

from __future__ import annotations

import os

#: Out-of-memory errors raised outside the caching allocator (so not ``torch.OutOfMemoryError``):
#: cuBLAS/cuBLASLt workspaces, cuDNN workspaces, NCCL buffers, raw ``cudaMalloc`` in extensions.
#: Matched case-insensitively against the exception's text.
OOM_MARKERS: tuple[str, ...] = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "cudnn error: cudnn_status_internal_error",  # cuDNN's usual symptom of a failed workspace
    "failed to cuda calloc",  # NCCL
    "failed to cuda malloc",
    "nccl warn cuda failure 'out of memory'",
    "ncclsystemerror: system call (e.g. socket, malloc) or external library call failed",
    "hip out of memory",
    "hiperroroutofmemory",
    "cpu tracker: out of memory",  # the CPU backend's own budget (trials/memory.py)
)


def is_oom_message(text: str) -> bool:
    """Whether an error's text says the device ran out of memory."""
    low = text.lower()
    return any(marker in low for marker in OOM_MARKERS)


def is_oom_error(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` or any error whose text is a device allocation failure."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or is_oom_message(f"{type(exc).__name__}: {exc}")


def allocator_fraction(budget_bytes: int, total_bytes: int, outside_bytes: int) -> float:
    """The caching allocator's share of the card so that allocator + what the process holds
    outside it (CUDA context, cuBLAS/NCCL workspaces: ``outside_bytes``) stays within the
    budget. Never below a sliver (an impossible budget then fails at the first allocation)."""
    usable = max(budget_bytes - max(outside_bytes, 0), 1)
    return max(min(1.0, usable / total_bytes), 1e-6)


def card_bytes(total: int, free: int, others: int) -> int:
    """What this process holds on the card: used (``total - free``, all of the card's users)
    less what other processes held when the trial started (``others``)."""
    return max(0, total - free - max(others, 0))


def over_card_budget(card: int, budget: int | None) -> str | None:
    """The OOM text when the card-level count passes the budget, else None."""
    if budget is None or card <= budget:
        return None
    return (
        f"CUDA out of memory (card): the process holds {card} bytes on the card, "
        f"budget {budget} bytes"
    )


def nvml_process_bytes(device_index: int, pid: int | None = None) -> int | None:
    """This process's bytes on the card as NVML reports them (context included), or None
    where NVML (``pynvml``/``nvidia-ml-py``) is missing or does not report per process."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # NVML errors (no permission in containers, driver mismatch)
        return None
    me = os.getpid() if pid is None else pid
    used = [p.usedGpuMemory for p in procs if p.pid == me and p.usedGpuMemory is not None]
    return int(sum(used)) if used else None


#: the allocator settings variable; a trial's value is recorded with its result
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def alloc_conf_with(base: str, expandable_segments: bool | None) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` for a trial: the caller's settings with
    ``expandable_segments`` set as the trial config asks (None: left as it is)."""
    items = [i.strip() for i in base.split(",") if i.strip()]
    items = [i for i in items if not i.startswith("expandable_segments:")]
    if expandable_segments is not None:
        items.append(f"expandable_segments:{'True' if expandable_segments else 'False'}")
    return ",".join(items)


def capped(budget_bytes: int | None, status: str, backend: str) -> bool:
    """A trial run without a budget (the reference, a ladder step) that ran out of memory hit
    the physical card: its peak is the card's size, not the configuration's true peak."""
    return budget_bytes is None and status == "oom" and backend == "cuda"


def measured_tokens(tokens_per_step: int, steps: int, skipped: int) -> int:
    """Tokens that trained: fp16 steps the loss scaler skipped (inf/NaN gradients, no update)
    did not train the model, so they do not count in tokens/s."""
    return tokens_per_step * max(0, steps - skipped)


def scaler_skipped(scale_before: float, scale_after: float) -> bool:
    """torch's ``GradScaler`` lowers its scale exactly when it skipped the optimizer step."""
    return scale_after < scale_before
