"""The Slurm launcher against a real Slurm: slurmctld + slurmd + munge on this machine, started
by ``scripts/install_slurm.sh`` (CI runs it before the tests). No mock: real sbatch jobs run
real trials; Slurm's own ``scontrol`` is the oracle for what happened to each job.

Where Slurm is not running these tests fail (they do not skip): run the script as root first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.launchers import POLL_ENV, SLURM_JOB_ATTR
from autotune.storage import HEARTBEAT_ENV
from tests.conftest import NO_PROBES, SMALL_ARGS

TINY_SPACE = Path(__file__).parent / "data" / "tiny_space.yaml"
STUDY = "tiny-llama-150MB-cpu"
ENV = {**os.environ, HEARTBEAT_ENV: "1", POLL_ENV: "0.5", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module", autouse=True)
def slurm_up() -> None:
    ping = (
        subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        if shutil.which("scontrol")
        else None
    )
    if ping is None or "UP" not in ping.stdout:
        pytest.fail("no Slurm answers here: run scripts/install_slurm.sh as root (CI does)")


def _autotune(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_args(n: int, storage: str, *extra: str) -> list[str]:
    return [
        "run", "--model", "tiny-llama", "--budget", "150MB", "--space", str(TINY_SPACE),
        *SMALL_ARGS, *NO_PROBES, "--trials", str(n), "--storage", storage, "--launcher", "slurm",
        *extra,
    ]  # fmt: skip


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=STUDY, storage=storage).get_trials()


def _job_ids(storage: str) -> list[str]:
    try:
        return [str(t.user_attrs[SLURM_JOB_ATTR]) for t in _trials(storage)
                if SLURM_JOB_ATTR in t.user_attrs]  # fmt: skip
    except KeyError:  # the study is not created yet
        return []


def _slurm_state(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True
    ).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else ""


def _wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _finish(proc: subprocess.Popen[str], timeout_s: float = 400) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out + err
    return out


def test_trials_run_as_slurm_jobs_several_in_flight(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 's.db'}"
    seen: set[frozenset[str]] = set()
    stop = threading.Event()

    def watch_queue() -> None:  # which of our jobs Slurm runs at the same time
        while not stop.is_set():
            out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True,
                                 text=True).stdout  # fmt: skip
            mine = set(out.split()) & set(_job_ids(storage))
            if mine:
                seen.add(frozenset(mine))
            time.sleep(0.3)

    watcher = threading.Thread(target=watch_queue, daemon=True)
    watcher.start()
    try:
        _finish(_autotune(*_run_args(3, storage, "--in-flight", "2"), cwd=tmp_path))
    finally:
        stop.set()
        watcher.join()
    trials = _trials(storage)
    assert len(trials) == 3 and all(t.state == TrialState.COMPLETE for t in trials)
    # a proposal identical to a trial already run (or running: the enqueued reference reserves
    # nothing) reuses its result instead of submitting a job; seen when the machine is loaded
    ran = [t for t in trials if "duplicate_of" not in t.user_attrs]
    for t in trials:
        if "duplicate_of" in t.user_attrs:
            assert t.user_attrs["duplicate_of"] in [r.number for r in ran]
    ids = [str(t.user_attrs[SLURM_JOB_ATTR]) for t in ran]
    assert len(ran) >= 2 and len(set(ids)) == len(ran)
    for t, job_id in zip(ran, ids, strict=True):
        assert _slurm_state(job_id) == "COMPLETED"  # Slurm's own account of the job
        assert t.user_attrs["status"] in ("ok", "oom") and t.user_attrs["peak_bytes"] > 0
        # the study's folder is <name>-<id> (autotune.study.workdir_for)
        (log,) = (tmp_path / "autotune_runs").glob(f"{STUDY}-*/trial-{t.number}/slurm-{job_id}.log")
        assert log.is_file()
    assert max(len(s) for s in seen) == 2, seen  # two jobs ran at once


def test_queued_and_running_jobs_survive_a_controller_restart(tmp_path: Path) -> None:
    """Both jobs are submitted held (queued); the controller is killed (-9); one job is released
    and runs, the other stays queued; a new controller collects both into their trials."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    first = _autotune(
        *_run_args(2, storage, "--in-flight", "2", "--sbatch-option=--hold"), cwd=tmp_path
    )
    _wait_for("two jobs submitted", lambda: len(_job_ids(storage)) == 2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    running, queued = sorted(_job_ids(storage), key=int)
    assert _slurm_state(running) == _slurm_state(queued) == "PENDING"
    subprocess.run(["scontrol", "release", running], check=True)
    _wait_for("the released job to run", lambda: _slurm_state(running) != "PENDING")

    second = _autotune("resume", "--study", STUDY, "--storage", storage, "--trials", "0",
                       cwd=tmp_path)  # fmt: skip
    time.sleep(3)
    assert _slurm_state(queued) == "PENDING"
    subprocess.run(["scontrol", "release", queued], check=True)
    out = _finish(second)
    assert "collecting trial" in out
    trials = _trials(storage)
    assert len(trials) == 2, "collected into the same trials, none retried"
    assert all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]
    assert sorted(str(t.user_attrs[SLURM_JOB_ATTR]) for t in trials) == [running, queued]
    assert all(t.user_attrs["peak_bytes"] > 0 for t in trials)
    assert _slurm_state(running) == _slurm_state(queued) == "COMPLETED"


def test_a_cancelled_job_is_a_failed_trial_with_its_reason(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 's.db'}"
    proc = _autotune(*_run_args(1, storage), cwd=tmp_path)
    _wait_for("the job", lambda: len(_job_ids(storage)) == 1)
    (job_id,) = _job_ids(storage)
    subprocess.run(["scancel", job_id], check=True)
    _finish(proc)
    (trial,) = _trials(storage)
    assert trial.state == TrialState.FAIL
    assert _slurm_state(job_id) == "CANCELLED"
    assert f"Slurm job {job_id} CANCELLED" in trial.user_attrs["error"]


def test_jobs_of_no_trial_get_folders_of_their_own(tmp_path: Path) -> None:
    """Loss probes and re-measurements are not trials: two of the same name (two controllers
    probing the same numerics) get two folders, and a job sbatch refuses (a partition that does
    not exist) is a transient failure, not the configuration's."""
    from autotune.launchers import SlurmOptions, SlurmRunner
    from tests.conftest import tiny_spec

    runner = SlurmRunner(tmp_path, SlurmOptions(partition="no-such-partition"))
    first = runner.run(tiny_spec({}), "probe-abc")
    second = runner.run(tiny_spec({}), "probe-abc")
    assert first.status == second.status == "failed"
    assert "sbatch refused" in first.error and first.transient
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 2 and all(f.startswith("probe-abc") for f in folders), folders
    assert all((tmp_path / f / "job.sbatch").is_file() for f in folders)


# --- what reaches a job script: stored options checked again, every word quoted, no link -------


def test_stored_slurm_options_are_checked_again_when_a_worker_loads_them(tmp_path: Path) -> None:
    """Another tool (anyone who can write to the shared storage) stores a partition that would
    end its #SBATCH line: ``worker`` and ``resume`` refuse it in one line and submit nothing."""
    from click.testing import CliRunner

    from autotune.cli import main
    from tests.studies import make_study

    storage = f"sqlite:///{tmp_path / 'autotune.db'}"
    study = make_study(storage, STUDY, TINY_SPACE)
    hostile = [{"partition": "debug\ntouch pwned"}, {"extra": ["--qos=x\ntouch pwned"]},
               {"account": "a b"}, {"extra": "--qos=high"}, {"in_flight": "many"},
               {"poll_s": -1}, {"time_limit": "1\ntouch pwned"}]  # fmt: skip
    for bad in hostile:
        settings = dict(study.user_attrs["settings"])
        settings["launcher"] = {"name": "slurm", "in_flight": 1, **bad}
        study.set_user_attr("settings", settings)
        for command in ("worker", "resume"):
            result = CliRunner().invoke(
                main, [command, "--study", STUDY, "--trials", "1", "--storage", storage],
                catch_exceptions=False,
            )  # fmt: skip
            err = result.stderr
            assert result.exit_code == 2, result.output
            assert len(err.strip().splitlines()) == 1 and "Slurm option" in err, err
    assert not list(tmp_path.rglob("pwned")) and not list(tmp_path.rglob("*.sbatch"))
    assert _trials(storage) == []


def test_every_word_of_the_exec_line_reaches_srun_as_it_was(tmp_path: Path) -> None:
    """bash itself is the oracle: the job script runs with an ``srun`` and a ``scontrol`` that
    only record their argv; a working folder named ``w$(touch pwned)`` and a python path with
    quotes arrive as they were, and only the rendezvous endpoint and id are expanded."""
    from autotune.launchers import SlurmOptions, batch_script
    from tests.conftest import tiny_spec

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("srun", "open(sys.argv[0] + '.argv.json', 'w').write(json.dumps("
                        "sys.argv[1:]))"), ("scontrol", "print('node-a')")):  # fmt: skip
        (bin_dir / tool).write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    folder = tmp_path / "w$(touch pwned) `touch pwned2` 'q\" ;x"
    python = str(tmp_path / "py $(touch pwned3)")
    for nodes in (1, 2):
        spec = tiny_spec({}, nproc=2 * nodes, nodes=nodes)
        job = [python, "-m", "trials.job", str(folder / "spec.json"), str(folder / "r.json")]
        script = batch_script(spec, SlurmOptions(partition="debug"), 60, job,
                              folder / "slurm-%j.log", "autotune-x")  # fmt: skip
        run = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                 "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-[a-b]"},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        argv = json.loads((bin_dir / "srun.argv.json").read_text())
        assert argv[0] == "--kill-on-bad-exit=1" and python in argv
        assert argv[-3:] == job[-3:]  # trials.job SPEC RESULT, each one word as it was
        if nodes == 2:
            assert "--rdzv-endpoint=node-a:24242" in argv and "--rdzv-id=4242" in argv
    assert not list(tmp_path.rglob("pwned*"))


def test_a_link_planted_at_a_trial_folder_is_not_followed(tmp_path: Path) -> None:
    """``trial-0`` planted as a link to another folder: the job's spec, script and log go to a
    folder made fresh, recorded on the trial; the link's target stays empty."""
    from autotune.launchers import FOLDER_ATTR, SlurmOptions, SlurmRunner
    from tests.conftest import tiny_spec

    class Attrs:
        def __init__(self) -> None:
            self.user_attrs: dict[str, object] = {}

        def set_user_attr(self, key: str, value: object) -> None:
            self.user_attrs[key] = value

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "runs"
    work.mkdir()
    (work / "trial-0").symlink_to(elsewhere)
    runner = SlurmRunner(work, SlurmOptions(partition="no-such-partition"))
    trial = Attrs()
    result = runner.run_for(trial, tiny_spec({}), "trial-0")
    assert "sbatch refused" in result.error  # submitted (and refused) from the fresh folder
    folder = trial.user_attrs[FOLDER_ATTR]
    assert isinstance(folder, str) and folder.startswith("trial-0-")
    assert (work / folder / "job.sbatch").is_file() and not (work / folder).is_symlink()
    assert list(elsewhere.iterdir()) == []
