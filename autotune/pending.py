"""Measurements on their way into the study's storage, kept on local disk until they are in.

A trial's measurement is written here (``<trial folders>/pending/trial-N.json``) the moment the
job has finished, before anything is written to the storage, and removed once the trial is
stored. When the storage fails in between (a database server that stays down, a full disk, a
deleted file) the file stays; the next ``autotune run``, ``resume`` or ``worker`` of the study on
this machine stores it (``autotune.study.Objective.replay_pending``). A controller holds a lock
on each of its own files while it works on them, so a paused controller's measurement is never
stored twice by another process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

PENDING_DIR = "pending"


@dataclass
class Held:
    """One trial's file, locked by this process until ``done`` (or the process ends)."""

    path: Path
    lock: IO[bytes]

    def save(self, record: dict[str, Any]) -> None:
        """Write ``record`` in full or not at all (a temporary file, then a rename)."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record, allow_nan=True))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def load(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def done(self) -> None:
        """The trial is in the storage: forget its file."""
        for path in (self.path, self.path.with_suffix(".lock")):
            with contextlib.suppress(OSError):
                path.unlink()
        self.release()

    def release(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.lock.close()  # closing the descriptor drops the lock


class PendingResults:
    """The folder of a study's measurements not yet stored."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def hold(self, number: int) -> Held:
        """Trial ``number``'s file, locked for this process."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = open(self.folder / f"trial-{number}.lock", "ab")  # noqa: SIM115 (held open)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return Held(self.folder / f"trial-{number}.json", lock)

    def waiting(self) -> Iterator[Held]:
        """The files no live process holds, each locked while the caller stores it."""
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.glob("trial-*.json")):
            try:
                lock = open(path.with_suffix(".lock"), "ab")  # noqa: SIM115 (held open)
            except OSError:
                continue
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its controller is alive (running, or paused): its own to store
                lock.close()
                continue
            if path.exists():
                yield Held(path, lock)
            else:
                lock.close()
