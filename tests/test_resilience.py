"""A study survives its controller: kill -9 and resume, Ctrl-C, crashing and hanging trials.

Real processes throughout: the real ``autotune`` CLI as a subprocess on a real SQLite file, real
trial jobs, real signals. The heartbeat is shortened (``AUTOTUNE_HEARTBEAT_S=1``, grace 3 s) so
a killed controller's trial goes stale in seconds instead of half a minute.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.runner import SubprocessRunner
from autotune.selector import STALE
from autotune.space import SearchSpace
from autotune.storage import GRACE_FACTOR, HEARTBEAT_ENV
from autotune.study import Objective, TrialCrashed, settings_of
from tests.conftest import NO_PROBES, SMALL_ARGS, cli
from tests.studies import make_study
from tests.test_runner import _gone

TINY_SPACE = Path(__file__).parent / "data" / "tiny_space.yaml"
HEARTBEAT = 1
ENV = {**os.environ, HEARTBEAT_ENV: str(HEARTBEAT), "PYTHONUNBUFFERED": "1"}
STUDY = "tiny-llama-150MB-cpu"


def _autotune(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_args(n: int, storage: str) -> list[str]:
    return [
        "run", "--model", "tiny-llama", "--budget", "150MB", "--space", str(TINY_SPACE),
        *SMALL_ARGS, *NO_PROBES, "--trials", str(n), "--storage", storage,
    ]  # fmt: skip


def _trials(storage: str, name: str = STUDY) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def _alive(pid: int) -> bool:
    return not _gone(pid, within_s=0)


def _wait_for(what: str, cond: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"autotune exited ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")  # fmt: skip
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _running_job(tmp: Path, number: int) -> int | None:
    # the study's folder is <name>-<id> (one per database and study)
    found = list((tmp / "autotune_runs").glob(f"{STUDY}-*/trial-{number}/job.pid"))
    pid_file = found[0] if found else tmp / "missing"
    if not pid_file.is_file() or not pid_file.read_text():
        return None
    pid = int(pid_file.read_text())
    return pid if _alive(pid) else None


def test_lifeline_ends_the_job_group_when_its_controller_is_killed(tmp_path: Path) -> None:
    """A job in its own session outlives a SIGKILLed controller unless it watches it."""
    pids = tmp_path / "pids"
    job = (
        "import os, subprocess, sys, time\n"
        "from trials.lifeline import start_lifeline\n"
        "start_lifeline(0.1)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(600)\n"
    )
    controller = (
        "import os, subprocess, sys, time\n"
        "env = {**os.environ, 'AUTOTUNE_CONTROLLER_PID': str(os.getpid())}\n"
        f"subprocess.Popen([sys.executable, '-c', {job!r}], env=env, start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", controller], text=True)
    _wait_for("the job's pids", lambda: pids.is_file() and " " in pids.read_text(), proc)
    job_pid, child_pid = map(int, pids.read_text().split())
    time.sleep(0.5)
    assert _alive(job_pid) and _alive(child_pid)  # the lifeline leaves a live controller's job
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone(job_pid, within_s=5) and _gone(child_pid, within_s=5)


def test_kill_9_mid_trial_then_resume_retries_once_and_loses_nothing(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    proc = _autotune(*_run_args(2, storage), cwd=tmp_path)
    try:
        _wait_for("trial 1's job", lambda: _running_job(tmp_path, 1) is not None, proc)
        job = _running_job(tmp_path, 1)
        assert job is not None
        time.sleep(1.0)  # mid-trial: the job is importing torch or training
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    killed_at = time.monotonic()
    assert _gone(job, within_s=5), "the trial job outlived its SIGKILLed controller"

    before = _trials(storage)
    assert [t.state for t in before] == [TrialState.COMPLETE, TrialState.RUNNING]
    killed_config = before[1].user_attrs["config"]
    # the stale trial is failed once its heartbeat is older than the grace period
    time.sleep(max(0.0, GRACE_FACTOR * HEARTBEAT + 0.5 - (time.monotonic() - killed_at)))
    resumed = _autotune("resume", "--study", STUDY, "--trials", "1", "--storage", storage,
                        cwd=tmp_path)  # fmt: skip
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out + err

    after = _trials(storage)
    assert [t.number for t in after] == [0, 1, 2]
    assert [t.state for t in after] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert after[0].user_attrs == before[0].user_attrs  # the finished trial: not lost, not redone
    assert after[0].values == before[0].values
    retry = after[2]
    assert retry.system_attrs["failed_trial"] == 1
    assert retry.user_attrs["config"] == killed_config
    assert retry.user_attrs["status"] in ("ok", "oom")
    assert sum(t.system_attrs.get("failed_trial") == 1 for t in after) == 1  # retried once
    assert sum(t.user_attrs.get("role") == "reference" for t in after) == 1

    shown = cli("show", "--storage", storage)
    assert shown.exit_code == 0, shown.output
    assert f"#1 failed: {STALE}; run again as #2" in shown.output
    # the table's status cell says "(retry of #1)"; with the class, build and host columns it
    # may wrap at this width, so the record it is drawn from is checked
    as_json = cli("show", "--json", "--storage", storage)
    rows = {r["number"]: r for r in json.loads(as_json.output)["trials"]}
    assert rows[2]["retry_of"] == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_the_job_marks_the_trial_and_says_how_to_resume(
    sig: signal.Signals, tmp_path: Path
) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    proc = _autotune(*_run_args(2, storage), cwd=tmp_path)
    try:
        _wait_for("trial 0's job", lambda: _running_job(tmp_path, 0) is not None, proc)
        job = _running_job(tmp_path, 0)
        assert job is not None
        time.sleep(1.0)
        proc.send_signal(sig)  # SIGINT: what a terminal's Ctrl-C sends to the controller
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert f"Resume with: autotune resume --study {STUDY}" in " ".join(err.split())
    assert "Traceback" not in err
    assert _gone(job, within_s=5)
    (trial,) = _trials(storage)
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["error"].startswith("interrupted")


#: trial -> a job that really crashes, segfaults, hangs
SCRIPTS = {
    "trial-0": "import os, sys; print('about to die', file=sys.stderr, flush=True); os._exit(3)",
    "trial-1": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
    "trial-2": "import sys, time; print('stuck', file=sys.stderr, flush=True); time.sleep(600)",
}


class Misbehaving(SubprocessRunner):
    """The real runner; trials 0-2 run a job from SCRIPTS instead of the trial job."""

    def command(self, spec_path: Path, result_path: Path) -> list[str]:
        script = SCRIPTS.get(spec_path.parent.name)
        if script is None:
            return super().command(spec_path, result_path)
        return [sys.executable, "-c", script]

    def run(self, spec, name):  # type: ignore[no-untyped-def]
        self.timeout_s = 3 if name == "trial-2" else 600
        return super().run(spec, name)


def test_crashing_and_hanging_trials_are_failures_with_reasons_and_the_study_goes_on(
    tmp_path: Path,
) -> None:
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = make_study(storage, STUDY, TINY_SPACE)
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    objective = Objective(study, space, Misbehaving(tmp_path / "runs"))
    # four different configurations: a failed one is never run again, so a repeat
    # would reuse the crash instead of hanging
    for ckpt, precision in (("off", "fp32"), ("off", "bf16"), ("full", "fp32"), ("full", "bf16")):
        study.enqueue_trial(
            space.params_for(
                {"gradient_checkpointing": ckpt, "precision": precision, "micro_batch_size": 8}
            )
        )
    study.optimize(objective, n_trials=4, catch=(TrialCrashed,))

    trials = _trials(storage)
    # a crash is deterministic: a completed trial with the ``failed`` constraint the sampler
    # learns from; a time limit may be the machine's fault: a FAIL, retried
    assert [t.state for t in trials] == [
        TrialState.COMPLETE,
        TrialState.COMPLETE,
        TrialState.FAIL,
        TrialState.COMPLETE,
    ]
    assert [t.user_attrs["constraints"]["failed"] for t in (trials[0], trials[1])] == [1.0, 1.0]
    crash, segv, hang, real = (t.user_attrs for t in trials)
    assert crash["error"] == "trial job crashed: exit code 3"
    assert "about to die" in crash["stderr_tail"]
    assert segv["error"] == "trial job crashed: killed by signal SIGSEGV"
    assert hang["error"] == "timed out after 3s" and "stuck" in hang["stderr_tail"]
    assert real["status"] in ("ok", "oom") and real["peak_bytes"] > 0

    shown = cli("show", "--storage", storage)
    assert shown.exit_code == 0, shown.output
    for line in (
        "#0 failed: trial job crashed: exit code 3",
        "stderr: about to die",
        "#1 failed: trial job crashed: killed by signal SIGSEGV",
        "#2 failed: timed out after 3s",
        "stderr: stuck",
    ):
        assert line in shown.output, shown.output
