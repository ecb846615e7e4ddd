"""Storage faults and a controller that falters, mid-trial: nothing left RUNNING, no finished
measurement lost, never a traceback.

Real things throughout: the real ``autotune`` CLI as a subprocess running real tiny trial jobs, a
real PostgreSQL server stopped and started again under it, a real SQLite file on a real tmpfs
that fills, or deleted under the controller, real SIGSTOP/SIGCONT/SIGTERM. The oracle for "the
measurement was kept" is the job's own ``result.json`` in its trial folder, written by the trial
process, not by the code that stores it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from autotune.pending import PENDING_DIR
from autotune.space import SearchSpace
from autotune.storage import GRACE_FACTOR, HEARTBEAT_ENV, STORAGE_RETRY_ENV
from autotune.study import RECOVERED_FROM_ATTR, ensure_reference, settings_of
from tests import pgserver
from tests.conftest import NO_PROBES, SMALL_ARGS
from tests.studies import make_study

TINY_SPACE = Path(__file__).parent / "data" / "tiny_space.yaml"
BASE_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", HEARTBEAT_ENV: "2"}


def _env(**extra: str) -> dict[str, str]:
    return {**BASE_ENV, **extra}


def _autotune(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_args(storage: str | None, name: str, *extra: str, space: Path = TINY_SPACE) -> list[str]:
    """One trial of tiny-llama; ``storage`` None: from AUTOTUNE_STORAGE (or the caller's)."""
    where = ["--storage", storage] if storage is not None else []
    return [
        "run", "--model", "tiny-llama", "--budget", "300MB", "--space", str(space), *SMALL_ARGS,
        "--trials", "1", *where, "--study-name", name, *extra,
    ]  # fmt: skip


def _wait_for(what: str, cond: Callable[[], bool], proc: subprocess.Popen[str] | None) -> None:
    deadline = time.monotonic() + 300
    while not cond():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"autotune exited ({proc.returncode}) before {what}: {out}{err}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _trial_file(cwd: Path, folder: str, name: str) -> Path | None:
    found = sorted(cwd.glob(f"autotune_runs/*/{folder}/{name}"))
    return found[0] if found and found[0].stat().st_size else None


def _job_result(cwd: Path, number: int) -> dict[str, object]:
    """What trial ``number``'s job itself wrote (its measurement)."""
    path = _trial_file(cwd, f"trial-{number}", "result.json")
    assert path is not None, f"trial {number}'s job wrote no result"
    return dict(json.loads(path.read_text()))


def _trials(storage: str, name: str) -> list[FrozenTrial]:
    rdb = optuna.storages.RDBStorage(storage)
    try:
        return optuna.load_study(study_name=name, storage=rdb).get_trials()
    finally:
        rdb.engine.dispose()


def _pending(cwd: Path) -> list[Path]:
    return sorted(cwd.glob(f"autotune_runs/*/{PENDING_DIR}/trial-*.json"))


#: what the storage says while it waits for a database server (not an error)
WAITING = "the study's database server is"


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(WAITING)]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    return lines[0]


def _the_measurement(trials: list[FrozenTrial], number: int) -> FrozenTrial:
    """The COMPLETE trial holding trial ``number``'s measurement: itself, or the trial that
    recorded it for it."""
    (kept,) = [
        t
        for t in trials
        if t.state == TrialState.COMPLETE
        and (t.number == number or t.user_attrs.get(RECOVERED_FROM_ATTR) == number)
    ]
    return kept


@pytest.fixture(scope="module")
def pg() -> Iterator[pgserver.Cluster]:
    """A PostgreSQL server of these tests' own: they stop it and start it again."""
    try:
        cluster = pgserver.start()
    except pgserver.Unavailable as exc:
        pytest.fail(f"PostgreSQL could not start for the storage-fault tests: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


def _name(what: str) -> str:
    return f"{what}-{os.getpid()}-{time.time_ns()}"


# --- a database server that restarts, or stays down ---------------------------------------------


def test_a_postgresql_restart_mid_trial_is_waited_for_and_the_trial_stored(
    pg: pgserver.Cluster, tmp_path: Path
) -> None:
    name = _name("pg-restart")
    err_file = tmp_path / "stderr"
    with open(err_file, "w") as err_out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.cli", *_run_args(pg.url, name, *NO_PROBES)],
            cwd=tmp_path, env=_env(**{STORAGE_RETRY_ENV: "300"}), stdout=subprocess.PIPE,
            stderr=err_out, text=True,
        )  # fmt: skip
    try:
        _wait_for("trial 0's job", lambda: _trial_file(tmp_path, "trial-0", "job.pid"), proc)
        pg.halt()  # while the job trains: the controller meets it down when it stores the result
        _wait_for("the controller to meet the stopped server",
                  lambda: "unreachable" in err_file.read_text(), proc)  # fmt: skip
        assert _trial_file(tmp_path, "trial-0", "result.json"), "met before the job's end"
        pg.restart()
        out, _ = proc.communicate(timeout=600)
        err = err_file.read_text()
    finally:
        if pg.server.poll() is not None:
            pg.restart()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert "Traceback" not in err, err
    assert "the study's database server is back" in err, err
    assert pgserver.PASSWORD not in out + err
    (trial,) = _trials(pg.url, name)
    assert trial.state == TrialState.COMPLETE
    measured = _job_result(tmp_path, 0)
    assert trial.user_attrs["peak_bytes"] == measured["peak_bytes"] > 0
    assert trial.user_attrs["tokens_per_s"] == measured["tokens_per_s"]
    assert not _pending(tmp_path)


def test_a_postgresql_server_that_stays_down_ends_in_one_line_and_the_next_run_stores_it(
    pg: pgserver.Cluster, tmp_path: Path
) -> None:
    name = _name("pg-down")
    env = _env(**{STORAGE_RETRY_ENV: "2", "AUTOTUNE_STORAGE": pg.url})
    # the URL from AUTOTUNE_STORAGE, as a password should be given
    proc = _autotune(*_run_args(None, name, *NO_PROBES), cwd=tmp_path, env=env)
    try:
        _wait_for("trial 0's job", lambda: _trial_file(tmp_path, "trial-0", "job.pid"), proc)
        pg.halt()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        pg.restart()
    assert proc.returncode == 1, out + err
    line = _one_error_line(err)
    assert "could not store trial 0's result" in line, line
    assert "kept in" in line and "autotune resume" in line, line
    assert pgserver.PASSWORD not in out + err
    (kept,) = _pending(tmp_path)
    measured = _job_result(tmp_path, 0)
    assert json.loads(kept.read_text())["user_attrs"]["peak_bytes"] == measured["peak_bytes"]

    resumed = _autotune("resume", "--study", name, "--trials", "0", cwd=tmp_path, env=env)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out + err
    trials = _trials(pg.url, name)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    stored = _the_measurement(trials, 0)
    assert stored.user_attrs["peak_bytes"] == measured["peak_bytes"]
    assert stored.user_attrs["tokens_per_s"] == measured["tokens_per_s"]
    assert stored.user_attrs["config"] == measured_config(tmp_path, 0)
    assert not _pending(tmp_path)


def measured_config(cwd: Path, number: int) -> dict[str, object]:
    spec = _trial_file(cwd, f"trial-{number}", "spec.json")
    assert spec is not None
    return dict(json.loads(spec.read_text())["config"])


# --- SQLite: a disk that fills, a file deleted --------------------------------------------------

FILL = """
set -u
mount -t tmpfs -o size=2m tmpfs "$MNT" || exit 77
"$PY" -m autotune.cli "$@" --storage "sqlite:///$MNT/study.db" >"$OUT/out" 2>"$OUT/err" &
pid=$!
while [ ! -e "$OUT/fill-now" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
dd if=/dev/zero of="$MNT/filler" bs=64k 2>/dev/null
wait $pid
echo $? >"$OUT/rc"
rm -f "$MNT/filler"
cp "$MNT"/study.db* "$OUT/"
"""


def test_the_sqlite_disk_filling_mid_trial_ends_in_one_line_and_the_next_run_stores_it(
    tmp_path: Path,
) -> None:
    """The database on a real 2 MB tmpfs (in a mount namespace of its own) that fills while
    the trial's job trains."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small filesystem")
    mnt, out_dir = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out_dir.mkdir()
    name = _name("sqlite-full")
    env = _env(MNT=str(mnt), OUT=str(out_dir), PY=sys.executable)
    wrapper = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", FILL, "fill",
         *_run_args(None, name, *NO_PROBES)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for("trial 0's job", lambda: _trial_file(tmp_path, "trial-0", "job.pid"), wrapper)
        (out_dir / "fill-now").touch()
        wrapper.communicate(timeout=600)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.communicate()
    rc = (out_dir / "rc").read_text().strip() if (out_dir / "rc").exists() else ""
    if wrapper.returncode == 77 or not rc:
        pytest.skip("a tmpfs cannot be mounted here (no user namespaces)")
    err = (out_dir / "err").read_text()
    assert rc == "1", (out_dir / "out").read_text() + err
    line = _one_error_line(err)
    assert "could not store trial 0's result" in line and "full" in line, line
    assert "kept in" in line, line
    measured = _job_result(tmp_path, 0)

    storage = f"sqlite:///{out_dir / 'study.db'}"  # the filled database, copied out
    resumed = _autotune(
        "resume", "--study", name, "--trials", "0", "--storage", storage, cwd=tmp_path, env=env
    )
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out + err
    trials = _trials(storage, name)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert _the_measurement(trials, 0).user_attrs["peak_bytes"] == measured["peak_bytes"]
    assert not _pending(tmp_path)


def test_the_sqlite_file_deleted_mid_trial_ends_in_one_line_and_keeps_the_measurement(
    tmp_path: Path,
) -> None:
    db = tmp_path / "study.db"
    name = _name("sqlite-deleted")
    proc = _autotune(*_run_args(f"sqlite:///{db}", name, *NO_PROBES), cwd=tmp_path, env=_env())
    try:
        _wait_for("trial 0's job", lambda: _trial_file(tmp_path, "trial-0", "job.pid"), proc)
        db.unlink()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out + err
    line = _one_error_line(err)
    assert f"the database file {db} was deleted" in line, line
    assert not db.exists()  # no empty database made in its place
    (kept,) = _pending(tmp_path)
    measured = _job_result(tmp_path, 0)
    record = json.loads(kept.read_text())
    assert record["user_attrs"]["peak_bytes"] == measured["peak_bytes"]
    assert record["user_attrs"]["config"] == measured_config(tmp_path, 0)


# --- a paused controller, taken over --------------------------------------------------------------


def test_a_paused_controller_taken_over_keeps_its_measurement_and_goes_on(
    pg: pgserver.Cluster, tmp_path: Path
) -> None:
    """Worker A is stopped (SIGSTOP: Ctrl-Z, a suspended machine) mid-trial past its
    heartbeat's grace; worker B fails A's trial and runs it again. A continues (SIGCONT): its
    measurement is stored as a new trial pointing to the taken-over one, and A runs its next."""
    name = _name("pg-paused")
    study = make_study(pg.url, name, TINY_SPACE)
    ensure_reference(study, SearchSpace.from_dict(settings_of(study).space, "study"))
    study._storage.remove_session()
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    env = _env(AUTOTUNE_STORAGE=pg.url)
    worker = ["worker", "--study", name, "--trials", "2"]
    b_worker = ["worker", "--study", name, "--trials", "1"]
    a = _autotune(*worker, cwd=a_dir, env=env)
    b: subprocess.Popen[str] | None = None
    rdb = optuna.storages.RDBStorage(pg.url)
    watched = optuna.load_study(study_name=name, storage=rdb)
    try:
        _wait_for("A's first job", lambda: _trial_file(a_dir, "trial-0", "job.pid"), a)
        a.send_signal(signal.SIGSTOP)
        # B starts once A's heartbeat is past its grace, as a worker arriving later would: its
        # first trial's sweep then finds trial 0 stale whatever configuration B draws
        time.sleep(GRACE_FACTOR * int(BASE_ENV[HEARTBEAT_ENV]) + 1)
        b = _autotune(*b_worker, cwd=b_dir, env=env)
        _wait_for("B taking trial 0 over", lambda: watched.trials[0].state == TrialState.FAIL, b)
        # A's job is in its own session: it trained on and wrote its result meanwhile
        _wait_for("A's job's result", lambda: _trial_file(a_dir, "trial-0", "result.json"), None)
        a.send_signal(signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=600)
        b_out, b_err = b.communicate(timeout=600)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.communicate()
        rdb.engine.dispose()
    assert a.returncode == 0, a_out + a_err
    assert b.returncode == 0, b_out + b_err
    assert "Traceback" not in a_err + b_err, a_err + b_err
    assert "trial 0 was taken over by another worker" in " ".join(a_out.split())
    trials = _trials(pg.url, name)
    assert trials[0].state == TrialState.FAIL
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    (kept,) = [t for t in trials if t.user_attrs.get(RECOVERED_FROM_ATTR) == 0]
    assert kept.state == TrialState.COMPLETE
    assert kept.params == trials[0].params
    measured = _job_result(a_dir, 0)
    assert kept.user_attrs["peak_bytes"] == measured["peak_bytes"]
    assert kept.user_attrs["tokens_per_s"] == measured["tokens_per_s"]
    shown = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "show", "--study", name],
        cwd=tmp_path, env={**env, "COLUMNS": "300"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"its measurement is kept as #{kept.number}" in shown.stdout, shown.stdout
    assert "(measured for #0)" in shown.stdout, shown.stdout
    # A went on with its next trial: one more job of its own, stored COMPLETE
    (next_dir,) = [p.parent for p in a_dir.glob("autotune_runs/*/trial-*/result.json")
                   if p.parent.name != "trial-0"]  # fmt: skip
    number = int(next_dir.name.split("-")[1])
    assert trials[number].state == TrialState.COMPLETE
    assert trials[number].user_attrs["peak_bytes"] == _job_result(a_dir, number)["peak_bytes"]
    assert not _pending(a_dir)


# --- SIGTERM while the loss probe runs -----------------------------------------------------------

LOSSY_SPACE = """
dimensions:
  gradient_checkpointing:
    choices: [full]
  precision:
    choices: [bf16]
  micro_batch_size:
    choices: [8]
"""


def test_sigterm_while_the_loss_probe_runs_keeps_the_measurement_with_a_reason(
    tmp_path: Path,
) -> None:
    space = tmp_path / "lossy.yaml"
    space.write_text(LOSSY_SPACE)  # lossy only: the trial's verdict needs a probe
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    name = _name("probe-sigterm")
    args = _run_args(storage, name, "--probe-steps", "40", "--confirm-rounds", "0", space=space)
    # an empty probe cache of its own: the probe really runs
    proc = _autotune(*args, cwd=tmp_path, env=_env(AUTOTUNE_CACHE=str(tmp_path / "cache")))
    # a local CPU study trains its probes in the controller's own process: the phase is known by
    # the line the controller prints as the probe starts
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        _wait_for("the loss probe", lambda: any("loss probe:" in line for line in lines), proc)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=10)
        out, err = "".join(lines), proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert "interrupted (SIGTERM) while a loss probe ran" in " ".join(err.split()), err
    (trial,) = _trials(storage, name)
    assert trial.state == TrialState.COMPLETE
    measured = _job_result(tmp_path, 0)
    assert trial.user_attrs["status"] == measured["status"] == "ok"
    assert trial.user_attrs["peak_bytes"] == measured["peak_bytes"]
    assert trial.user_attrs["losses"] == measured["losses"]
    verdict = trial.user_attrs["loss_verdict"]
    assert verdict["ok"] is None and "interrupted (SIGTERM)" in verdict["note"], verdict
    assert not _pending(tmp_path)
