"""Many workers on one study: concurrent `autotune worker` processes on SQLite and PostgreSQL.

Each worker is the real CLI in its own process, running real trial jobs; the study is made as
`autotune run` makes it, with the reference queued, so one of the workers runs it. Afterwards:
as many trials as the workers were asked for, each number once, none left running, the
reference run once, and `autotune show` names the winner the selector computes. A cheaper
test hammers one SQLite file from 3 processes with the storage as autotune opens it.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.selector import select
from autotune.space import SearchSpace
from autotune.storage import HEARTBEAT_ENV, open_storage
from autotune.study import ensure_reference, load_existing, settings_of
from tests import pgserver
from tests.studies import make_study

TINY_SPACE = Path(__file__).parent / "data" / "tiny_space.yaml"
ENV = {**os.environ, HEARTBEAT_ENV: "2", "PYTHONUNBUFFERED": "1"}


def _new_study(storage: str, name: str) -> None:
    """A study as `autotune run` leaves it before its first trial: settings and the reference."""
    study = make_study(storage, name, TINY_SPACE)
    ensure_reference(study, SearchSpace.from_dict(settings_of(study).space, "study"))


def _workers(storage: str, name: str, trials: list[int], cwd: Path) -> list[str]:
    """Start one worker per entry of ``trials`` at once; wait for all; their outputs."""
    command = [sys.executable, "-m", "autotune.cli", "worker", "--study", name]
    procs = [
        subprocess.Popen(
            [*command, "--storage", storage, "--trials", str(n)],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in trials
    ]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
        outputs.append(out)
    return outputs


def _check_study(storage: str, name: str, expected: int, cwd: Path) -> optuna.Study:
    study = load_existing(open_storage(storage), name)
    trials = study.get_trials()
    assert len(trials) == expected
    assert sorted(t.number for t in trials) == list(range(expected))  # each number once
    assert [t.state for t in trials] == [TrialState.COMPLETE] * expected, [
        (t.number, t.state.name, t.user_attrs.get("error")) for t in trials
    ]
    assert sum(t.user_attrs.get("role") == "reference" for t in trials) == 1
    assert study.user_attrs.get("reference_losses")

    winner = select(study).winner
    assert winner is not None
    shown = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "show", "--study", name, "--storage", storage],
        cwd=cwd, env=ENV, capture_output=True, text=True, check=True,
    )  # fmt: skip
    match = re.search(r"^winner: trial (\d+):", shown.stdout, re.MULTILINE)
    assert match and int(match.group(1)) == winner.number, shown.stdout
    return study


WRITER = """
import sys, optuna
from autotune.storage import open_storage
optuna.logging.set_verbosity(optuna.logging.ERROR)
study = optuna.load_study(study_name="stress", storage=open_storage(sys.argv[1]))

def objective(trial):
    x = trial.suggest_float("x", 0.0, 1.0)
    for i in range(3):
        trial.set_user_attr(f"attr{i}", i)
    return x

study.optimize(objective, n_trials=int(sys.argv[2]))
"""


def test_concurrent_writers_on_one_sqlite_file_lose_nothing(tmp_path: Path) -> None:
    """The storage as autotune opens it (heartbeats on), hammered by 3 processes at once."""
    db = tmp_path / "stress.db"
    storage = f"sqlite:///{db}"
    optuna.create_study(study_name="stress", storage=open_storage(storage))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, storage, "15"],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        assert "locked" not in out
    trials = optuna.load_study(study_name="stress", storage=storage).get_trials()
    assert sorted(t.number for t in trials) == list(range(45))
    assert all(t.state == TrialState.COMPLETE and len(t.user_attrs) == 3 for t in trials)
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.slow
def test_two_workers_on_one_sqlite_file(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    _new_study(storage, "sqlite-workers")
    start = time.monotonic()
    _workers(storage, "sqlite-workers", [2, 2], tmp_path)
    print(f"2 SQLite workers x 2 trials: {time.monotonic() - start:.1f}s")
    _check_study(storage, "sqlite-workers", 4, tmp_path)
    with sqlite3.connect(tmp_path / "shared.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL: the URL in AUTOTUNE_TEST_PG_URL, or a throwaway cluster started here."""
    given = os.environ.get(pgserver.PG_URL_ENV)
    if given:
        yield given
        return
    try:
        cluster = pgserver.start()
    except pgserver.Unavailable as exc:
        # a real server is part of the test set-up (scripts/install_postgres.sh): never skip
        pytest.fail(f"PostgreSQL could not start for the many-workers tests: {exc}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


def test_three_workers_on_postgresql(postgres_url: str, tmp_path: Path) -> None:
    name = f"pg-workers-{os.getpid()}-{time.time_ns()}"
    _new_study(postgres_url, name)
    start = time.monotonic()
    outputs = _workers(postgres_url, name, [2, 2, 2], tmp_path)
    print(f"3 PostgreSQL workers x 2 trials: {time.monotonic() - start:.1f}s")
    _check_study(postgres_url, name, 6, tmp_path)
    password = re.search(r"://[^:/@]+:([^@]*)@", postgres_url)
    if password and password.group(1):
        for out in outputs:
            assert password.group(1) not in out
            assert "***@" in out  # the report names the storage, masked


def test_a_worker_killed_mid_trial_is_failed_and_retried_by_another(
    postgres_url: str, tmp_path: Path
) -> None:
    """What the README promises for a cluster: worker A dies (kill -9) mid-trial; worker B, still
    running, fails A's trial once its heartbeat is stale and runs the same configuration again
    as its next trial. Nothing is left RUNNING."""
    name = f"pg-dead-worker-{os.getpid()}-{time.time_ns()}"
    _new_study(postgres_url, name)
    command = [sys.executable, "-m", "autotune.cli", "worker", "--study", name,
               "--storage", postgres_url]  # fmt: skip

    def start(n: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*command, "--trials", str(n)],
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    # one storage (one connection pool) for the polling below: a study loaded from the URL on
    # each poll opens a new pool each time, and a slow start exhausted the server's connections
    study = optuna.load_study(study_name=name, storage=optuna.storages.RDBStorage(postgres_url))

    def trials() -> list[optuna.trial.FrozenTrial]:
        return study.get_trials()

    a = start(2)
    deadline = time.monotonic() + 300

    # a trial is RUNNING from its first suggested parameter: wait until its whole configuration
    # is stored (the ``config`` attribute, written once sampling is done and the job starts), so
    # that A dies mid-trial, not mid-sampling
    def running() -> list[optuna.trial.FrozenTrial]:
        return [t for t in trials() if t.state == TrialState.RUNNING and "config" in t.user_attrs]

    while not running():
        assert time.monotonic() < deadline and a.poll() is None, "worker A never started a trial"
        time.sleep(0.2)
    (killed,) = running()
    b = start(2)
    time.sleep(1)
    a.kill()
    a.communicate()
    out, _ = b.communicate(timeout=600)
    assert b.returncode == 0, out
    after = {t.number: t for t in trials()}
    assert after[killed.number].state == TrialState.FAIL
    retries = [t for t in after.values() if t.system_attrs.get("retry_history")]
    assert len(retries) == 1
    assert retries[0].state == TrialState.COMPLETE
    assert retries[0].params == killed.params
    assert not [t for t in after.values() if t.state == TrialState.RUNNING]
