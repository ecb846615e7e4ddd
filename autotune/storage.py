"""Opening a study's storage: Optuna's RDB storage with heartbeats, shared safely by workers.

A controller that dies (``kill -9``, a lost machine) stops heartbeating; the next process that
runs trials on the study fails its stale RUNNING trial and queues the same configuration again,
once (Optuna's ``RetryHeartbeatStaleTrialCallback``).

SQLite: every transaction starts with ``BEGIN IMMEDIATE`` so two processes never both hold a
read lock and then deadlock on upgrading it ("database is locked" without waiting); the busy
timeout then makes each writer wait its turn. PostgreSQL: a plain ``postgresql://`` URL uses
psycopg 3 when psycopg2 is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import sqlalchemy
import sqlalchemy.exc
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from sqlalchemy import event
from sqlalchemy.engine import make_url

from autotune.errors import EnvironmentFailure, UserError, corrupt_database, corrupt_message
from autotune.masking import has_unencoded_at, mask_secret, mask_text, mask_url, remember

__all__ = ["mask_secret", "mask_text", "mask_url", "open_storage"]

#: seconds between heartbeats of a running trial; its grace period is ``GRACE_FACTOR`` times that
HEARTBEAT_S = 10
GRACE_FACTOR = 3
#: overrides HEARTBEAT_S (tests use 1 so a killed controller's trial goes stale in seconds)
HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"
#: seconds an SQLite writer waits for another process's transaction before giving up
SQLITE_BUSY_TIMEOUT_S = 60
#: the tables every Optuna RDB storage has; a read-only command refuses a database without them
OPTUNA_TABLES = frozenset({"studies", "trials", "version_info", "alembic_version"})
#: tries at creating a new database's schema: two first runs at once race on it
SCHEMA_TRIES = 5
SQLITE_MAGIC = b"SQLite format 3\x00"


def heartbeat_interval() -> int:
    raw = os.environ.get(HEARTBEAT_ENV, "")
    if not raw:
        return HEARTBEAT_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{HEARTBEAT_ENV}={raw!r}: use a whole number of seconds >= 1")
    return value


def driver_url(url: str) -> str:
    """``postgresql://`` -> ``postgresql+psycopg://`` where only psycopg 3 is installed."""
    scheme, sep, rest = url.partition("://")
    if (
        sep
        and scheme in ("postgresql", "postgres")
        and importlib.util.find_spec("psycopg2") is None
        and importlib.util.find_spec("psycopg") is not None
    ):
        return f"postgresql+psycopg://{rest}"
    return url


def _begin_immediate(conn: Any) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///path`` URL (None for other URLs and in-memory databases)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.startswith("sqlite") or not rest.startswith("/"):
        return None
    path = rest[1:].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _read_only_url(url: str) -> bool:
    """An SQLite URL that asks SQLite to open the file read-only (``?mode=ro``,
    ``?immutable=1``): SQLAlchemy passes such options on only with ``uri=true``."""
    query = url.partition("?")[2]
    pairs = {k.lower(): v[-1].lower() for k, v in parse_qs(query).items()}
    return pairs.get("mode") == "ro" or pairs.get("immutable") in ("1", "true", "yes", "on")


def open_storage(url: str, must_exist: bool = False, read_only: bool = False) -> RDBStorage:
    """An RDB storage with heartbeats: a trial whose controller died is failed and retried once.

    ``must_exist``: for commands that only read or join a study, a SQLite file that is not
    there is a typo, not a new database to create. ``read_only`` (``show``, ``export``,
    ``report``): the database must already hold Optuna's tables, and it is opened so that
    nothing can be written to it (SQLite ``mode=ro``, PostgreSQL read-only transactions): no
    schema is created or stamped in a foreign or empty database.
    """
    interval = heartbeat_interval()
    remember(url)  # its password is masked in every later message of this process
    if has_unencoded_at(url):
        raise UserError(
            f"storage {mask_url(url)}: the password holds an '@'; percent-encode it as %40"
        )
    target = driver_url(url)
    sqlite = target.startswith("sqlite")
    if sqlite and not read_only and _read_only_url(target):
        raise UserError(
            f"storage {mask_url(url)} asks for a read-only database (mode=ro or immutable=1): "
            "this command writes trials; drop that option (show, export and report only read)"
        )
    path = sqlite_path(target)
    if path is not None:
        try:
            _check_sqlite_file(path, url, must_exist or read_only, read_only)
        except OSError as exc:  # a folder on the way we may not enter, an I/O error
            raise UserError(
                f"storage {mask_url(url)}: permission denied: {exc.strerror}: {path}"
                if isinstance(exc, PermissionError)
                else f"storage {mask_url(url)}: {exc.strerror}: {path}"
            ) from None
    engine_kwargs: dict[str, Any] = {}
    if sqlite:
        # isolation_level=None: pysqlite issues no BEGIN of its own; _begin_immediate does
        engine_kwargs = {
            "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "isolation_level": None}
        }
    if read_only:
        engine_kwargs = _read_only_engine_kwargs(target, path)
        if path is not None:  # the creator opens the file read-only; the URL's query is moot
            target = target.partition("?")[0]
        _check_schema(target, engine_kwargs, url)
    storage = _create(target, url, interval, engine_kwargs, read_only)
    if sqlite and not read_only:
        event.listen(storage.engine, "begin", _begin_immediate)
        storage.engine.dispose()  # connections made before the listener are not reused
    return storage


def _create(
    target: str, url: str, interval: int, engine_kwargs: dict[str, Any], read_only: bool
) -> RDBStorage:
    """Optuna's RDBStorage; a first run racing another on a new database tries again."""
    for attempt in range(SCHEMA_TRIES):
        try:
            with warnings.catch_warnings():  # Optuna calls heartbeats experimental; we rely on them
                warnings.simplefilter("ignore", ExperimentalWarning)
                return RDBStorage(
                    target,
                    heartbeat_interval=interval,
                    grace_period=GRACE_FACTOR * interval,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
                    engine_kwargs=engine_kwargs,
                    skip_table_creation=read_only,
                )
        except Exception as exc:  # SQLAlchemy and drivers raise many kinds; all mean "can't open"
            if attempt + 1 < SCHEMA_TRIES and not read_only and _schema_race(exc):
                # another process created the same tables or version row between our check
                # and our write: its schema is the one we wanted; open it again
                time.sleep(random.uniform(0.05, 0.3))
                continue
            raise _open_error(exc, url) from None
    raise AssertionError("unreachable")


def _schema_race(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (
        isinstance(exc, sqlalchemy.exc.IntegrityError)
        or (
            isinstance(exc, sqlalchemy.exc.OperationalError)
            and ("already exists" in text or "locked" in text)
        )
        or (isinstance(exc, sqlalchemy.exc.ProgrammingError) and "already exists" in text)
    )


def _check_sqlite_file(path: Path, url: str, must_exist: bool, read_only: bool) -> None:
    """The cases SQLite reports alike ("unable to open database file"), told apart."""
    where = f"storage {mask_url(url)}"
    if path.is_dir():
        raise UserError(
            f"{where}: {path} is a folder, not a database file; name a file in it, e.g. "
            f"sqlite:///{path / 'autotune.db'}"
        )
    if not path.exists():
        if must_exist:
            raise UserError(f"no database at {path} ({where}): run `autotune run` first")
        if not path.parent.is_dir():
            raise UserError(f"{where}: folder {path.parent} does not exist; create it first")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise UserError(
                f"{where}: permission denied: cannot create a database in {path.parent}; "
                "choose a folder you can write"
            )
        return
    if not path.is_file():
        raise UserError(f"{where}: {path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise UserError(f"{where}: permission denied: cannot read {path}")
    if not read_only and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        what = path if not os.access(path, os.W_OK) else f"its folder {path.parent} (journal)"
        raise UserError(f"{where}: permission denied: cannot write {what}")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head and head != SQLITE_MAGIC[: len(head)]:
        raise UserError(f"{where}: {path} is not an SQLite database (check --storage)")


def _read_only_engine_kwargs(target: str, path: Path | None) -> dict[str, Any]:
    if path is not None:
        uri = f"file:{quote(str(path.resolve()))}?mode=ro"

        def connect() -> sqlite3.Connection:
            return sqlite3.connect(
                uri,
                uri=True,
                timeout=SQLITE_BUSY_TIMEOUT_S,
                isolation_level=None,
                check_same_thread=False,
            )

        return {"creator": connect}
    if target.startswith(("postgresql", "postgres")):
        # every transaction of this session is read-only: the server refuses any write
        return {"connect_args": {"options": "-c default_transaction_read_only=on"}}
    return {}


def _check_schema(target: str, engine_kwargs: dict[str, Any], url: str) -> None:
    """A read-only command on a database without Optuna's tables (empty, foreign, a typo)."""
    try:
        engine = sqlalchemy.create_engine(target, **engine_kwargs)
        try:
            with engine.connect() as conn:
                names = set(sqlalchemy.inspect(conn).get_table_names())
                stamped = names >= OPTUNA_TABLES and all(
                    conn.execute(sqlalchemy.text(f"SELECT COUNT(*) FROM {t}")).scalar()
                    for t in ("version_info", "alembic_version")
                )
        finally:
            engine.dispose()
    except Exception as exc:
        raise _open_error(exc, url) from None
    if not stamped:
        raise UserError(
            f"storage {mask_url(url)} holds no Optuna study (an empty or foreign database): "
            "check --storage; `autotune run` creates a study"
        )


def _open_error(exc: BaseException, url: str) -> UserError | EnvironmentFailure:
    """One line for a storage that did not open, saying which of the usual causes it is."""
    text = mask_secret(" ".join(str(exc).split()), url) or type(exc).__name__
    low = text.lower()
    where = f"storage {mask_url(url)}"
    try:
        parsed = make_url(driver_url(url))
        host = f"{parsed.host or 'localhost'}:{parsed.port or ''}".rstrip(":")
    except Exception:
        host = "its server"
    damaged = corrupt_database(exc)
    if damaged:
        return UserError(corrupt_message(where, damaged))
    if isinstance(exc, ImportError | ModuleNotFoundError) or "no module named" in low:
        return UserError(f"{where}: its database driver is not installed: {text[:200]}")
    if any(k in low for k in ("connection refused", "could not connect", "timeout expired",
                              "timed out", "could not translate host name",
                              "name or service not known", "no route to host")):  # fmt: skip
        return EnvironmentFailure(
            f"{where}: cannot reach the database server at {host} (is it running, and is the "
            f"address right?): {_reason(text)}"
        )
    if "authentication failed" in low or ("password" in low and "fail" in low):
        return UserError(f"{where}: the server at {host} refused the user or password")
    if "does not exist" in low and "database" in low:
        return UserError(f"{where}: {_reason(text)}; create the database first")
    if "readonly" in low or "read-only" in low or "permission denied" in low:
        return UserError(f"{where}: permission denied: {_reason(text)}")
    if "not a database" in low:
        return UserError(f"{where}: not an SQLite database (check --storage)")
    if "no longer compatible" in low or "optuna storage upgrade" in low:
        return UserError(f"{where}: {_reason(text)}")
    return UserError(f"cannot open {where}: {_reason(text)}")


def _reason(text: str) -> str:
    return text[:200]
