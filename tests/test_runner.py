"""The runner isolates each trial in its own process: crashes and hangs become results."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from autotune.runner import SubprocessRunner
from tests.conftest import tiny_spec


class ScriptRunner(SubprocessRunner):
    """Runs a given Python snippet in place of the trial job (a real process that misbehaves)."""

    def __init__(self, workdir: Path, code: str, timeout_s: float = 60) -> None:
        super().__init__(workdir, timeout_s)
        self.code = code

    def command(self, spec_path: Path, result_path: Path) -> list[str]:
        return [sys.executable, "-c", self.code, str(spec_path), str(result_path)]


def test_real_job_round_trip(tmp_path: Path) -> None:
    result = SubprocessRunner(tmp_path).run(tiny_spec({"micro_batch_size": 4}, seq_len=32), "t0")
    assert result.status == "ok", result.error + result.stderr_tail
    assert result.peak_bytes > 0 and result.tokens_per_s > 0 and len(result.losses) == 4
    assert (tmp_path / "t0" / "spec.json").is_file()


def test_real_job_oom_is_a_result(tmp_path: Path) -> None:
    result = SubprocessRunner(tmp_path).run(tiny_spec({}, budget=50_000_000), "t0")
    assert result.status == "oom"


def test_job_exception_is_failed_with_reason(tmp_path: Path) -> None:
    spec = tiny_spec({"optimizer": "adamw"})
    spec.config["micro_batch_size"] = 3  # does not divide the global batch of 8
    result = SubprocessRunner(tmp_path).run(spec, "t0")
    assert result.status == "failed"
    assert "does not divide" in result.error
    assert "Traceback" in result.stderr_tail


def test_crash_is_failed_with_stderr_tail(tmp_path: Path) -> None:
    code = "import os, sys; print('about to die', file=sys.stderr, flush=True); os._exit(3)"
    result = ScriptRunner(tmp_path, code).run(tiny_spec({}), "t0")
    assert result.status == "failed"
    assert result.error == "trial job crashed: exit code 3"
    assert "about to die" in result.stderr_tail


def test_abort_after_a_complete_result_keeps_the_result(tmp_path: Path) -> None:
    """A teardown crash (torchrun/gloo aborts seen here) after the job wrote its result."""
    code = (
        "import os, sys; from trials.spec import TrialResult; "
        "open(sys.argv[2], 'w').write(TrialResult('ok', 123, 4.5, [1.0]).to_json()); "
        "print('terminate called without an active exception', file=sys.stderr, flush=True); "
        "os.abort()"
    )
    result = ScriptRunner(tmp_path, code).run(tiny_spec({}), "t0")
    assert result.status == "ok" and result.peak_bytes == 123 and result.losses == [1.0]
    assert "after writing every rank's result" in result.stderr_tail
    assert "SIGABRT" in result.stderr_tail


def test_segfault_is_failed(tmp_path: Path) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    result = ScriptRunner(tmp_path, code).run(tiny_spec({}), "t0")
    assert result.status == "failed"
    assert "SIGSEGV" in result.error


def test_hang_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    result = ScriptRunner(tmp_path, code, timeout_s=3).run(tiny_spec({}), "t0")
    assert result.status == "failed"
    assert result.error == "timed out after 3s"
    assert _gone(int(pid_file.read_text()))


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """True once ``pid`` has exited (absent, or a zombie awaiting its reaper)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
