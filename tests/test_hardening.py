"""Hostile and careless input beyond the bad-input table: a pasted command line that must run
nothing, races on a new database, read-only commands that must write nothing, strict JSON,
rich markup in names, the terminal's width, the resume hint."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import main, resume_hint
from autotune.errors import UserError
from autotune.export import export
from autotune.lossguard import against_reference
from autotune.masking import mask_text, mask_url, remember
from autotune.space import SearchSpace
from autotune.study import StudySettings, create_or_load, settings_of
from autotune.yaml_limits import parse_yaml
from tests import pgserver
from tests.conftest import SMALL_SPACE, TINY
from tests.studies import make_study

ROOT = Path(__file__).resolve().parents[1]
#: what a hostile name tries: command substitution, a second command, a comment, a newline
HOSTILE = "evil $(touch pwned-1) `touch pwned-2`; touch pwned-3 # ' \" \n touch pwned-4 \\"


def _add_trial(
    study: optuna.Study, config: dict[str, Any], peak_mib: float, tps: float, **attrs: Any
) -> None:
    """A finished trial as the objective records one (config, status, peak, speed, losses)."""
    params: dict[str, Any] = {}
    dists: dict[str, optuna.distributions.BaseDistribution] = {}

    def fixed(name: str, choices: list[Any]) -> Any:
        params[name] = config[name]
        dists[name] = optuna.distributions.CategoricalDistribution(choices)
        return config[name]

    SearchSpace.from_dict(settings_of(study).space, "study").sample(fixed)
    user_attrs = {"config": config, "status": "ok", "peak_bytes": int(peak_mib * 2**20),
                  "tokens_per_s": tps, "losses": [9.0, 8.9, 8.8, 8.7], **attrs}  # fmt: skip
    study.add_trial(
        optuna.trial.create_trial(
            params=params, distributions=dists, values=[tps, peak_mib], user_attrs=user_attrs
        )
    )


def _fitted(url: str, name: str = "fitted") -> optuna.Study:
    study = make_study(url, name, SMALL_SPACE, "1GB")
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    ref = space.reference_config()
    study.set_user_attr("reference_losses", [9.0, 8.9, 8.8, 8.7])
    _add_trial(study, ref, 140, 1000.0, role="reference")
    fast = {**ref, "gradient_checkpointing": "off", "micro_batch_size": 8}
    _add_trial(study, fast, 180, 3000.0)
    broken = {**ref, "precision": "bf16"}  # a lossy trial whose loss went to nan
    losses = [9.0, math.nan, math.nan, math.nan]
    verdict = against_reference(losses, [9.0, 8.9, 8.8, 8.7])  # as the objective stores it
    _add_trial(
        study,
        broken,
        150,
        2000.0,
        losses=losses,
        loss_verdict=verdict.to_attrs(),
        loss_regression=verdict.regression,
        loss_tolerance=verdict.tolerance,
    )
    return study


# --- command injection ------------------------------------------------------------------------


def _fake_launchers(folder: Path) -> Path:
    """``accelerate`` and ``deepspeed`` that only record the argv they were given."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name in ("accelerate", "deepspeed"):
        tool = bin_dir / name
        tool.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            "open(sys.argv[0] + '.argv.json', 'w').write(json.dumps(sys.argv[1:]))\n"
        )
        tool.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("zero", [None, 2], ids=["accelerate", "deepspeed"])
def test_the_exported_command_runs_nothing_else_when_pasted(
    zero: int | None, tmp_path: Path
) -> None:
    from autotune.export import launch_command

    folder = tmp_path / f"out {HOSTILE.replace('/', '_').replace(chr(10), '_')}"
    folder.mkdir()
    settings = StudySettings(
        model=HOSTILE, model_config=TINY, budget_bytes=10**9, budget_label="1GB",
        backend="cpu", seq_len=64, global_batch_size=8, space={},
    )  # fmt: skip
    config = {"gradient_checkpointing": "off", "precision": "fp32", "attention": "sdpa",
              "optimizer": "adamw", "micro_batch_size": 8}  # fmt: skip
    if zero is not None:  # any ZeRO stage, 0 too, ran on DeepSpeed's engine: its launcher
        config["zero_stage"] = zero
    out = export("command", config, settings, folder / "launch.sh")
    bin_dir = _fake_launchers(tmp_path)
    script = out.read_text()
    # paste every line into bash, as a user would
    run = subprocess.run(
        ["bash", "-c", script, "bash"], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert not list(tmp_path.rglob("pwned*")), "a hostile name ran a command"
    tool = "deepspeed" if zero else "accelerate"
    got = json.loads((bin_dir / f"{tool}.argv.json").read_text())
    assert got == launch_command(config, settings, folder / "launch.sh")[1:]


# --- races ------------------------------------------------------------------------------------

RACER = """
import sys, time
from tests.studies import make_study
from tests.conftest import SMALL_SPACE
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
study = make_study(sys.argv[1], "race", SMALL_SPACE, "1GB")
print("joined", study.study_name, sorted(study.user_attrs["settings"])[0])
"""


def _race(url: str, n: int, cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """``n`` processes open the same new database and create the same study at one instant."""
    start = time.time() + 8  # after every interpreter has imported optuna and torch
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", RACER, url, str(start)]
    procs = [
        subprocess.Popen(
            command, cwd=cwd, text=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(n)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_first_runs_racing_on_a_new_sqlite_database_all_work(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    for result in _race(url, 4, tmp_path):
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith("joined race")
    storage = optuna.storages.RDBStorage(url)
    assert [s.study_name for s in storage.get_all_studies()] == ["race"]


@pytest.fixture()
def new_pg_database() -> Iterator[str]:
    """An empty database on a real PostgreSQL server (a throwaway cluster, or the CI one)."""
    import psycopg

    given = os.environ.get(pgserver.PG_URL_ENV)
    cluster = None
    if not given:
        try:
            cluster = pgserver.start()
        except pgserver.Unavailable as exc:
            pytest.skip(f"POSTGRESQL TESTS SKIPPED: {exc}")
    base = given or cluster.url  # type: ignore[union-attr]
    name = f"hardening_{os.getpid()}_{time.time_ns()}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield base.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
        if cluster is not None:
            cluster.stop()


def _pg_tables(url: str) -> list[str]:
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return sorted(r[0] for r in rows)


def test_postgresql_read_only_commands_create_nothing_and_first_runs_race(
    new_pg_database: str, tmp_path: Path
) -> None:
    for args in (["show"], ["export", "--format", "hf", "--out", str(tmp_path / "x.json")]):
        result = CliRunner().invoke(main, [*args, "--storage", new_pg_database])
        assert result.exit_code == 2, result.output
        assert "holds no Optuna study" in result.stderr
    assert _pg_tables(new_pg_database) == []  # no schema created by a read-only command
    for result in _race(new_pg_database, 3, tmp_path):
        assert result.returncode == 0, result.stderr[-2000:]
    assert "studies" in _pg_tables(new_pg_database)


# --- read-only commands, strict JSON, names ---------------------------------------------------


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_show_export_report_leave_the_database_file_as_it_was(
    in_tmp: Path,
) -> None:
    db = in_tmp / "autotune.db"
    _fitted(f"sqlite:///{db}")
    before = _sha(db)
    for args in (["show"], ["show", "--json"], ["report", "--out", "r"],
                 ["export", "--format", "deepspeed", "--out", "ds.json"]):  # fmt: skip
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert _sha(db) == before, args
    assert sorted(p.name for p in in_tmp.iterdir() if p.suffix == ".db") == ["autotune.db"]


def test_show_json_is_strict_json_with_null_for_what_is_not_finite(in_tmp: Path) -> None:
    _fitted(f"sqlite:///{in_tmp / 'autotune.db'}")
    result = CliRunner().invoke(main, ["show", "--json"])
    assert result.exit_code == 0, result.output

    def refuse(token: str) -> None:
        raise AssertionError(f"not JSON: {token}")

    data = json.loads(result.stdout, parse_constant=refuse)
    nan_trial = next(t for t in data["trials"] if t["config"]["precision"] == "bf16")
    assert nan_trial["loss_regression"] is None  # inf in Python, null in JSON
    assert nan_trial["feasible"] is False
    assert data["winner"] == 1


@pytest.mark.parametrize("name", ["x[/bold]", "[red]y", ":x: [link=http://e]z", "é" * 190])
def test_names_with_markup_print_as_typed(name: str, in_tmp: Path) -> None:
    _fitted(f"sqlite:///{in_tmp / 'autotune.db'}", name)
    result = CliRunner().invoke(main, ["show", "--study", name], terminal_width=400)
    assert result.exit_code == 0, result.output
    compact = "".join(result.stdout.split())  # a long name wraps; its text is all there
    assert f"study{name}".replace(" ", "") in compact
    assert f"asstudy'{name}'".replace(" ", "") in compact


# --- the terminal -----------------------------------------------------------------------------


def _in_terminal(args: list[str], columns: int, cwd: Path) -> str:
    """Run the CLI on a real pseudo-terminal ``columns`` wide; what the terminal received."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args], cwd=cwd, stdin=follower,
        stdout=follower, stderr=follower, env={**env, "TERM": "xterm", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", text).replace("\r", "")


def test_the_table_follows_the_terminal_width(in_tmp: Path) -> None:
    name = "a-study-with-a-long-name-" * 4  # "stored in ... as study '...'" is 140 wide
    _fitted(f"sqlite:///{in_tmp / 'autotune.db'}", name)
    narrow = _in_terminal(["show", "--study", name], 60, in_tmp)
    wide = _in_terminal(["show", "--study", name], 180, in_tmp)
    assert "winner" in narrow and "winner" in wide, narrow
    assert max(map(len, narrow.splitlines())) <= 60
    assert 100 < max(map(len, wide.splitlines())) <= 180  # not cut at a fixed 100


# --- the resume hint --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "url", "storage_args"),
    [
        ("plain", "sqlite:///autotune.db", []),
        (
            HOSTILE.replace("\n", " ") + "x" * 150,
            "sqlite:///my dir/$(touch pwned).db",
            ["--storage", "sqlite:///my dir/$(touch pwned).db"],
        ),
        ("pg", "postgresql://bob:s3cret-pw@db/x", []),  # a password is never printed
        # a name another tool stored: terminal sequences, a newline, a C1 control, a quote
        ("e\x1b]52;c;eA==\x07'\n\x9b2J\\\U0001f600 $(touch pwned)", "sqlite:///autotune.db", []),
    ],
)
def test_the_resume_hint_is_one_command_bash_reads_back(
    name: str, url: str, storage_args: list[str], tmp_path: Path
) -> None:
    hint = resume_hint(name, url)
    assert "\n" not in hint and "s3cret" not in hint and hint.isprintable()
    command = hint.split(": ", 1)[1]
    argv = subprocess.run(
        ["bash", "-c", f'autotune() {{ printf "%s\\0" "$@"; }}; {command}'],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.split("\0")[:-1]  # fmt: skip
    assert argv == ["resume", "--study", name, *storage_args]
    assert not list(tmp_path.glob("pwned*"))
    if storage_args == [] and "://" in url and "sqlite" not in url:
        assert "AUTOTUNE_STORAGE" in hint


# --- secrets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://:pw-secret@host/db", "postgresql://:***@host/db"),
        ("postgresql://u:p@ss-secret@host:5/db", "postgresql://u:***@host:5/db"),
        ("postgresql://u@host/db?password=q-secret&sslmode=require",
         "postgresql://u@host/db?password=***&sslmode=require"),
        ("postgresql://u@host/db?sslpassword=q-secret", "postgresql://u@host/db?sslpassword=***"),
        ("postgresql+psycopg://u:p%40ss-secret@h/db", "postgresql+psycopg://u:***@h/db"),
        ("not a url: x://u:w-secret@h", "not a url: x://u:***@h"),
    ],
)  # fmt: skip
def test_every_url_form_is_masked(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "secret" not in mask_url(url)


def test_a_remembered_secret_is_masked_in_any_message() -> None:
    remember("postgresql://u:p%40ss-word-9@h/db?token=tok-9876")
    text = mask_text("auth failed: p@ss-word-9 / p%40ss-word-9 / tok-9876")
    assert text == "auth failed: *** / *** / ***"


# --- YAML -------------------------------------------------------------------------------------


def test_yaml_merge_keys_are_no_duplicates_and_a_repeat_is_one() -> None:
    text = "base: &b {x: 1, y: 2}\nmine:\n  <<: *b\n  y: 3\n"
    assert parse_yaml(text, "t") == {"base": {"x": 1, "y": 2}, "mine": {"x": 1, "y": 3}}
    with pytest.raises(UserError, match=r"t: line 3: duplicate key 'y' \(first at line 2\)"):
        parse_yaml("a: 1\ny: 2\ny: 3\n", "t")


# --- settings of an existing study ------------------------------------------------------------


def test_settings_given_again_apply_when_they_match(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.db'}"
    study = make_study(url, "s", SMALL_SPACE, "1GB")
    settings = settings_of(study)
    from autotune.storage import open_storage

    again = create_or_load(open_storage(url), "s", settings, {"loss_tolerance", "seed"})
    assert again.study_name == "s"
    changed = StudySettings.from_attrs({**settings.to_attrs(), "loss_tolerance": 0.1})
    with pytest.raises(UserError, match=r"has loss_tolerance=0.02, not 0.1"):
        create_or_load(open_storage(url), "s", changed, {"loss_tolerance"})
    # not given (the option's default): the study's own value stands, no error
    assert create_or_load(open_storage(url), "s", changed, set()).study_name == "s"
