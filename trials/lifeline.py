"""A trial job ends itself, and everything it started, when its controller dies.

The runner starts each job in its own session so that a crash or a timeout can kill the job's
whole process group. The other side of that isolation: a controller killed with ``kill -9``
cannot clean up, and its job would train on, orphaned. The runner passes its pid in
``AUTOTUNE_CONTROLLER_PID``; a daemon thread of the job watches that process (by pid and start
time, so a reused pid does not count as alive) and kills the job's process group when it is
gone. A thread, not ``PR_SET_PDEATHSIG``: the signal would kill the job but not its children.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

CONTROLLER_ENV = "AUTOTUNE_CONTROLLER_PID"
POLL_S = 0.5


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):  # exited, not yet reaped by its own parent
        return None
    return fields[19]


def started_at(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if it is gone: with the
    pid, an identity that a reused pid does not match."""
    return _start_time(pid)


def _alive(pid: int, started: str | None) -> bool:
    if os.path.isdir("/proc"):
        return _start_time(pid) == started
    try:  # no /proc: existence only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_own_group() -> None:
    # Only a group that leads its own session is the runner's job group: never kill the group
    # of a shell or a test runner that happened to start this process another way.
    if os.getsid(0) == os.getpgrp():
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(137)


def start_lifeline(poll_s: float = POLL_S) -> threading.Thread | None:
    """Watch the controller named in the environment; None when no controller is named."""
    raw = os.environ.get(CONTROLLER_ENV, "")
    if not raw.isdigit():
        return None
    pid = int(raw)
    started = _start_time(pid) if os.path.isdir("/proc") else None
    if os.path.isdir("/proc") and started is None:
        _kill_own_group()  # the controller died before the job got here

    def watch() -> None:
        while _alive(pid, started):
            time.sleep(poll_s)
        _kill_own_group()

    thread = threading.Thread(target=watch, name="autotune-lifeline", daemon=True)
    thread.start()
    return thread
