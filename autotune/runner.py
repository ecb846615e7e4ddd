"""Trial runners: how a ``TrialSpec`` becomes a ``TrialResult``.

``SubprocessRunner`` launches ``python -m trials.job`` in its own process group with a time
limit, so a crash, a hang or a real OOM of the job never takes the study down: each becomes a
result (``failed`` with its reason and the tail of stderr, or ``oom``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from trials.lifeline import CONTROLLER_ENV
from trials.spec import TrialResult, TrialSpec, rank_result_path

STDERR_TAIL_LINES = 20
#: the CLI's storage URL variable
STORAGE_ENV = "AUTOTUNE_STORAGE"


class TrialRunner(ABC):
    """Turns a spec into a measured (or predicted) result."""

    @abstractmethod
    def run(self, spec: TrialSpec, name: str) -> TrialResult: ...

    def attrs_for(self, result: TrialResult) -> dict[str, Any]:
        """Extra user attrs for the trial (e.g. ``predicted`` for estimator-backed runners)."""
        return {}


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the job and everything it started (its own session/process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class SubprocessRunner(TrialRunner):
    def __init__(
        self, workdir: Path, timeout_s: float = 600.0, python: str = sys.executable
    ) -> None:
        self.workdir = Path(workdir)
        self.timeout_s = timeout_s
        self.python = python

    def command(self, spec_path: Path, result_path: Path) -> list[str]:
        return [self.python, "-m", "trials.job", str(spec_path), str(result_path)]

    def launch_command(self, spec: TrialSpec, spec_path: Path, result_path: Path) -> list[str]:
        """``command``, through torchrun when the trial has several ranks (one machine, no
        ssh/pdsh: ``--standalone`` picks a free rendezvous port)."""
        cmd = self.command(spec_path, result_path)
        if spec.nproc <= 1:
            return cmd
        return [
            cmd[0],
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={spec.nproc}",
            *cmd[1:],
        ]

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        trial_dir = self.workdir / name
        trial_dir.mkdir(parents=True, exist_ok=True)
        spec_path, result_path = trial_dir / "spec.json", trial_dir / "result.json"
        stderr_path = trial_dir / "stderr.log"
        rank_paths = [rank_result_path(result_path, r, spec.nproc) for r in range(spec.nproc)]
        for path in rank_paths:
            path.unlink(missing_ok=True)
        spec_path.write_text(spec.to_json())
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            CONTROLLER_ENV: str(os.getpid()),  # the job ends itself if this process dies
        }
        env.pop(STORAGE_ENV, None)  # a job never needs the storage URL (it may hold a password)
        start = time.perf_counter()
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                self.launch_command(spec, spec_path, result_path),
                stdout=err,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            (trial_dir / "job.pid").write_text(str(proc.pid))
            try:
                code = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                return TrialResult(
                    status="failed",
                    error=f"timed out after {self.timeout_s:g}s",
                    stderr_tail=_tail(stderr_path),
                    wall_s=time.perf_counter() - start,
                )
            except BaseException:  # Ctrl-C or the controller dying: never leave the job behind
                kill_group(proc)
                raise
        if all(p.is_file() for p in rank_paths):
            # Every rank wrote its result: the measurement is complete. A crash after that (seen:
            # a gloo/torchrun teardown abort) does not undo it; it is kept as a warning.
            result = merge_ranks([TrialResult.load(p) for p in rank_paths])
            if result.status == "failed" or code != 0:
                result.stderr_tail = _tail(stderr_path)
            if code != 0:
                result.stderr_tail = (
                    f"warning: the job exited with {_describe_exit(code)} after writing every "
                    f"rank's result\n{result.stderr_tail}"
                )
            return result
        return TrialResult(
            status="failed",
            error=f"trial job crashed: {_describe_exit(code)}",
            stderr_tail=_tail(stderr_path),
            wall_s=time.perf_counter() - start,
        )


def merge_ranks(results: list[TrialResult]) -> TrialResult:
    """One result from every rank's: the worst rank's peak (the budget is per rank), the sum of
    tokens/s, the mean loss per step (each rank trained on its share of the batch)."""
    if len(results) == 1:
        return results[0]
    worst = max(results, key=lambda r: r.peak_bytes)
    for status in ("failed", "oom"):
        bad = [r for r in results if r.status == status]
        if bad:
            return TrialResult(
                status=status,
                peak_bytes=worst.peak_bytes,
                error=bad[0].error,
                wall_s=max(r.wall_s for r in results),
                rank_peaks=[r.peak_bytes for r in results],
                host_peak_bytes=sum(r.host_peak_bytes for r in results),
                # what filled the worst rank's memory when it ran out
                memory_breakdown=worst.memory_breakdown,
                construction_peak_bytes=worst.construction_peak_bytes,
                training_peak_bytes=worst.training_peak_bytes,
                construction_breakdown=worst.construction_breakdown,
            )
    steps = min(len(r.losses) for r in results)
    return TrialResult(
        status="ok",
        peak_bytes=worst.peak_bytes,
        tokens_per_s=sum(r.tokens_per_s for r in results),
        losses=[sum(r.losses[i] for r in results) / len(results) for i in range(steps)],
        wall_s=max(r.wall_s for r in results),
        memory_breakdown=worst.memory_breakdown,
        rank_peaks=[r.peak_bytes for r in results],
        construction_peak_bytes=worst.construction_peak_bytes,
        training_peak_bytes=worst.training_peak_bytes,
        construction_breakdown=worst.construction_breakdown,
        host_peak_bytes=sum(r.host_peak_bytes for r in results),  # the ranks share one host
    )
