"""Stale build locks of PyTorch's JIT extensions (DeepSpeed's ``cpu_adam``, ``deepspeed_shm_comm``).

DeepSpeed builds its ops on first use with ``torch.utils.cpp_extension.load``, which guards each
build directory with a ``lock`` file (``torch.utils.file_baton.FileBaton``): created when a build
starts, removed when it ends, and waited on, with no timeout, by every other process that loads
the op, even when the op is already built. A process killed mid-build (a trial past its time
limit, Ctrl-C, a machine snapshot) leaves the file behind, and from then on every DeepSpeed trial
hangs at "Loading extension module" until the runner's time limit: a well-known DeepSpeed
complaint. The lock records no owner, so a lock is taken as stale by age: nothing in its build
directory written for ``STALE_AFTER_S`` (a cold build of ``cpu_adam`` takes 1-3 minutes on two
cores and ninja writes each object file as it finishes it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: a build directory idle this long while its lock exists is taken as abandoned
STALE_AFTER_S = 600.0


def build_root() -> Path:
    """Where ``torch.utils.cpp_extension`` builds: ``TORCH_EXTENSIONS_DIR`` (the op directories
    right under it) or its default (under a ``py311_cpu``-like tag)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _last_write(directory: Path) -> float:
    """The newest modification time of the directory's entries (the directory itself included)."""
    newest = directory.stat().st_mtime
    for entry in directory.iterdir():
        try:
            newest = max(newest, entry.stat().st_mtime)
        except FileNotFoundError:  # removed by a build finishing meanwhile
            continue
    return newest


def clear_stale_locks(
    root: Path | None = None, *, stale_after_s: float = STALE_AFTER_S, now: float | None = None
) -> list[Path]:
    """Remove the build locks under ``root`` whose build directory has been idle for
    ``stale_after_s`` seconds; returns the removed ones. Build directories are
    ``root/<python and device tag>/<op name>/``, or ``root/<op name>/`` under
    ``TORCH_EXTENSIONS_DIR``."""
    root = build_root() if root is None else root
    now = time.time() if now is None else now
    removed: list[Path] = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            if now - _last_write(lock.parent) < stale_after_s:
                continue
            os.remove(lock)
        except FileNotFoundError:  # released by its owner between the look and the removal
            continue
        removed.append(lock)
    return removed
