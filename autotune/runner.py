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
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autotune.backends import backend_named
from trials.lifeline import CONTROLLER_ENV
from trials.spec import TrialResult, TrialSpec, rank_result_path
from trials.techniques import TECHNIQUES

STDERR_TAIL_LINES = 20
#: the CLI's storage URL variable
STORAGE_ENV = "AUTOTUNE_STORAGE"
#: Variables that make a process think it is a rank of some distributed job: set in the caller's
#: shell (an interactive node of a Slurm/MPI/torchrun job) they would make a trial join a job
#: that does not exist and hang. A trial's world is its own: torchrun or the job sets them.
DISTRIBUTED_ENV = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "LOCAL_SIZE",
    "DEEPSPEED_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
DISTRIBUTED_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
#: seconds the other ranks get to finish after one rank reported an OOM or a failure
RANK_GRACE_S = 3.0
POLL_S = 0.2

#: how the error of a trial killed at its timeout begins (the strategy does not plan it again)
TIMEOUT_ERROR = "timed out after"


def trial_env(base: dict[str, str], spec: TrialSpec | None) -> dict[str, str]:
    """A trial job's environment: the caller's, without any distributed-job identity or the
    storage URL, with the allocator settings the trial config asks for (CUDA)."""
    env = {
        k: v
        for k, v in base.items()
        if k not in DISTRIBUTED_ENV and not k.startswith(DISTRIBUTED_PREFIXES) and k != STORAGE_ENV
    }
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            CONTROLLER_ENV: str(os.getpid()),  # the job ends itself if this process dies
        }
    )
    if spec is not None and backend_named(spec.backend).cuda:
        env.update(TECHNIQUES.environment(spec.config, base))
    return env


def rank_reports(rank_paths: list[Path]) -> list[TrialResult | None]:
    """Each rank's result where it wrote one (None: not yet, or not readable yet)."""
    out: list[TrialResult | None] = []
    for path in rank_paths:
        try:
            out.append(TrialResult.load(path))
        except (OSError, ValueError):
            out.append(None)
    return out


def new_trial_dir(workdir: Path, name: str) -> Path:
    """A folder this trial creates, never one left by another run: ``name`` when it is free,
    else ``name-<random>`` (a study recreated under the same name, a reused folder)."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        (workdir / name).mkdir()
        return workdir / name
    except FileExistsError:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))


@dataclass
class Adoption:
    """Threads collecting adopted jobs into their trials (``TrialRunner.adopt``)."""

    threads: list[threading.Thread] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    #: why each trial is collected, for the line the controller prints
    why: str = ""

    def join(self) -> None:
        for thread in self.threads:
            thread.join()


class TrialRunner(ABC):
    """Turns a spec into a measured (or predicted) result."""

    #: set on Ctrl-C/SIGTERM, for a runner whose trials wait in other threads (each then
    #: cancels its job); None: the signal's ``KeyboardInterrupt`` is enough
    stopping: threading.Event | None = None

    @abstractmethod
    def run(self, spec: TrialSpec, name: str) -> TrialResult: ...

    def attrs_for(self, result: TrialResult) -> dict[str, Any]:
        """Extra user attrs for the trial (e.g. ``predicted`` for estimator-backed runners)."""
        return {}

    def run_for(self, trial: TrialAttrs, spec: TrialSpec, name: str) -> TrialResult:
        """``run`` for a trial of a study; a runner that keeps state on the trial (a Slurm job
        id, so that a restarted controller collects the job) overrides this."""
        return self.run(spec, name)

    def adopt(
        self,
        study: Any,
        storage: Callable[[], Any],
        objective: Callable[[], Callable[[Any], Any]],
        crashed: type[Exception],
    ) -> Adoption:
        """Collect into their trials of ``study`` (an ``optuna.Study``) the jobs that a stopped
        controller left running, each in a thread of its own, recorded as ``objective()`` (the
        study's objective; ``crashed``: its exception for a failed trial) records any;
        ``storage()``: the study's storage. A runner whose jobs outlive their controller (a
        Slurm job) overrides this; the others have none."""
        return Adoption()


class TrialAttrs(Protocol):
    """The user attrs of a running trial (an ``optuna.Trial``)."""

    @property
    def user_attrs(self) -> dict[str, Any]: ...

    def set_user_attr(self, key: str, value: Any) -> None: ...


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
        if spec.nodes > 1:  # N torchrun agents meeting through c10d (autotune.agents)
            per_node = spec.nproc // spec.nodes
            return [cmd[0], "-m", "autotune.agents", f"--nodes={spec.nodes}",
                    f"--nproc-per-node={per_node}", "--", *cmd[2:]]  # fmt: skip
        if spec.nproc <= 1:
            return cmd
        return [
            cmd[0],
            "-m",
            "torch.distributed.run",
            "--standalone",  # its own rendezvous on a free port, per trial
            f"--nproc-per-node={spec.nproc}",
            "--monitor-interval=0.1",  # torchrun's default: a failed rank ends the others at once
            *cmd[1:],
        ]

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        trial_dir = new_trial_dir(self.workdir, name)
        spec_path, result_path = trial_dir / "spec.json", trial_dir / "result.json"
        stderr_path = trial_dir / "stderr.log"
        rank_paths = [rank_result_path(result_path, r, spec.nproc) for r in range(spec.nproc)]
        spec_path.write_text(spec.to_json())
        env = trial_env(dict(os.environ), spec)
        limit = spec.timeout_s or self.timeout_s
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
                code = self._wait(proc, rank_paths, limit)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                return TrialResult(
                    status="failed",
                    error=f"{TIMEOUT_ERROR} {limit:g}s",
                    stderr_tail=_tail(stderr_path),
                    transient=True,
                    wall_s=time.perf_counter() - start,
                )
            except BaseException:  # Ctrl-C or the controller dying: never leave the job behind
                kill_group(proc)
                raise
        reports = rank_reports(rank_paths)
        if all(r is not None for r in reports):
            # Every rank wrote its result: the measurement is complete. A crash after that (seen:
            # a gloo/torchrun teardown abort) does not undo it; it is kept as a warning.
            result = merge_ranks([r for r in reports if r is not None], nodes=spec.nodes)
            if result.status == "failed" or code != 0:
                result.stderr_tail = _tail(stderr_path)
            if code != 0 and result.status == "ok":
                result.stderr_tail = (
                    f"warning: the job exited with {_describe_exit(code)} after writing every "
                    f"rank's result\n{result.stderr_tail}"
                )
            return result
        if any(r is not None and r.status != "ok" for r in reports):
            # one rank ran out of memory (or failed) and the others were stopped mid-collective
            result = merge_ranks(
                [r for r in reports if r is not None], n_ranks=spec.nproc, nodes=spec.nodes
            )
            if result.status == "failed":
                result.stderr_tail = _tail(stderr_path)
            return result
        return TrialResult(
            status="failed",
            error=f"trial job crashed: {_describe_exit(code)}",
            stderr_tail=_tail(stderr_path),
            wall_s=time.perf_counter() - start,
        )

    def _wait(self, proc: subprocess.Popen[bytes], rank_paths: list[Path], limit: float) -> int:
        """The job's exit code. In a multi-process trial, once a rank has reported an OOM or a
        failure the others get ``RANK_GRACE_S`` to end (torchrun stops them) and are then
        killed: they would otherwise wait in a collective until the trial timeout."""
        deadline = time.monotonic() + limit
        bad_since: float | None = None
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now >= deadline:
                raise subprocess.TimeoutExpired(proc.args, limit)
            if (
                len(rank_paths) > 1
                and bad_since is None
                and any(r is not None and r.status != "ok" for r in rank_reports(rank_paths))
            ):
                bad_since = now
            if bad_since is not None and now - bad_since >= RANK_GRACE_S:
                kill_group(proc)
                return proc.returncode


def merge_ranks(
    results: list[TrialResult], n_ranks: int | None = None, nodes: int = 1
) -> TrialResult:
    """One result from every rank's: the worst rank's peak (the budget is per rank), the sum of
    tokens/s, the mean loss per step (each rank trained on its share of the batch).

    ``n_ranks`` larger than the results given: the other ranks were stopped after one reported
    an OOM or a failure; the result is that rank's (``oom_rank`` names it). ``nodes``: the hosts
    the ranks span, ``n_ranks / nodes`` consecutive ranks on each (as torchrun numbers them); the
    host peak is the fullest host's (its ranks' sum)."""
    n = n_ranks or len(results)
    if len(results) == 1 and n == 1:
        return results[0]
    worst = max(results, key=lambda r: r.peak_bytes)
    per_host = max(1, n // max(1, nodes))
    host_peak = max(
        sum(r.host_peak_bytes for r in results[i : i + per_host])
        for i in range(0, len(results), per_host)
    )
    for status in ("oom", "failed"):  # an OOM makes the other ranks fail: it is the cause
        bad = [r for r in results if r.status == status]
        if bad:
            first = min(bad, key=lambda r: r.wall_s)  # the rank that hit it first
            return TrialResult(
                status=status,
                peak_bytes=worst.peak_bytes,
                error=(
                    f"rank {first.oom_rank}: {first.error}"
                    if status == "oom" and first.oom_rank is not None and n > 1
                    else first.error
                ),
                wall_s=max(r.wall_s for r in results),
                rank_peaks=[r.peak_bytes for r in results],
                construction_peak_bytes=max(r.construction_peak_bytes for r in results),
                training_peak_bytes=max(r.training_peak_bytes for r in results),
                oom_rank=first.oom_rank,
                capped=first.capped,
                alloc_conf=first.alloc_conf,
                host_peak_bytes=host_peak,
                # what filled the worst rank's memory when it ran out
                memory_breakdown=worst.memory_breakdown,
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
        construction_peak_bytes=max(r.construction_peak_bytes for r in results),
        training_peak_bytes=max(r.training_peak_bytes for r in results),
        construction_breakdown=worst.construction_breakdown,
        skipped_steps=max(r.skipped_steps for r in results),
        alloc_conf=worst.alloc_conf,
        device_memory=worst.device_memory,
        host_peak_bytes=host_peak,  # the ranks of one host share its memory
        step_time_s=max(r.step_time_s for r in results),  # ranks wait for the slowest
        step_spread=max(r.step_spread for r in results),
        load_per_core=max(r.load_per_core for r in results),
    )


class InProcessRunner(TrialRunner):
    """Runs a job in this process, one at a time: for the loss probes of a local CPU study,
    whose proxy trains in seconds while a job process spends most of its time importing torch
    and transformers. The curve is the job's own (``trials.job.run_trial``, the same seed, data
    and steps); a job that raises is a failed result, as a job process's would be."""

    _lock = threading.Lock()  # the CPU tracker patches torch while it runs: one job at a time

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        from trials.job import run_trial  # torch and transformers: only when a probe runs

        with self._lock:
            try:
                return run_trial(spec)
            except Exception as exc:  # a failed probe is retried later, never a crashed study
                return TrialResult(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
