"""Opening a study's storage: Optuna's RDB storage with heartbeats, shared safely by workers.

A controller that dies (``kill -9``, a lost machine) stops heartbeating; the next process that
runs trials on the study fails its stale RUNNING trial and queues the same configuration again,
once (Optuna's ``RetryHeartbeatStaleTrialCallback``).

SQLite: every transaction starts with ``BEGIN IMMEDIATE`` so two processes never both hold a
read lock and then deadlock on upgrading it ("database is locked" without waiting); the busy
timeout then makes each writer wait its turn. PostgreSQL: a plain ``postgresql://`` URL uses
psycopg 3 when psycopg2 is not installed.

A database server that restarts or drops the connection is waited for: every storage call of a
study opened here is tried again, with a growing pause, for up to ``storage_retry_s()`` seconds
while the fault is a lost or refused connection (``ReconnectingStorage``); the pool checks each
connection before use (``pool_pre_ping``), so the first call after a restart does not fail on a
connection the server has closed. A heartbeat that cannot be written is skipped, not raised.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import sqlite3
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote

import sqlalchemy
import sqlalchemy.exc
from optuna.exceptions import ExperimentalWarning, StorageInternalError, UpdateFinishedTrialError
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
#: seconds a storage call waits, trying again, for a database server whose connection was lost
STORAGE_RETRY_S = 60.0
#: overrides STORAGE_RETRY_S (0: no retry)
STORAGE_RETRY_ENV = "AUTOTUNE_STORAGE_RETRY_S"
#: the first pause between tries; it doubles up to RETRY_PAUSE_MAX_S
RETRY_PAUSE_S = 0.25
RETRY_PAUSE_MAX_S = 5.0
#: words of the drivers' messages for a connection that is gone or cannot be made (psycopg,
#: PostgreSQL's own shutdown and start-up messages)
_CONNECTION_WORDS = (
    "server closed the connection",
    "connection refused",
    "could not connect",
    "connection is closed",
    "connection already closed",
    "connection to server",
    "terminating connection",
    "the database system is shutting down",
    "the database system is starting up",
    "the database system is in recovery mode",
    "consuming input failed",
    "ssl syscall error",
    "broken pipe",
    "connection reset",
    "connection timed out",
)


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


def storage_retry_s() -> float:
    raw = os.environ.get(STORAGE_RETRY_ENV, "")
    if not raw:
        return STORAGE_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UserError(f"{STORAGE_RETRY_ENV}={raw!r}: use a number of seconds >= 0")
    return value


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a lost or refused connection to a database server:
    the fault a retry can outlast, unlike a full disk, a missing table or a bad value."""
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if isinstance(inner, sqlalchemy.exc.DBAPIError) and inner.connection_invalidated:
            return True
        if isinstance(inner, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
            low = str(inner).lower()
            if any(words in low for words in _CONNECTION_WORDS):
                return True
        inner = inner.__cause__ or inner.__context__
    return False


_T = TypeVar("_T")


def _first_line(exc: BaseException) -> str:
    """The driver's own words under SQLAlchemy's and Optuna's wrappers, masked."""
    inner: BaseException = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    lines = str(getattr(inner, "orig", None) or inner).strip().splitlines()
    return mask_text(lines[0] if lines else type(inner).__name__)[:200]


class DatabaseFileGone(StorageInternalError):
    """The study's SQLite file was deleted or replaced while this process had it open: SQLite
    would go on writing into the deleted file, or create an empty one in its place."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"the database file {path} was deleted or replaced while the study ran")


class ReconnectingStorage(RDBStorage):
    """Optuna's RDB storage whose calls outlast a database server's restart: a call that fails
    on a lost or refused connection is tried again, the pause doubling from ``RETRY_PAUSE_S``,
    until ``retry_s`` seconds have passed; then its error is raised. Other faults (a full disk,
    a trial another process finished) are raised at once."""

    retry_s: float = STORAGE_RETRY_S
    #: an SQLite study's file and its identity (device, inode) when it was opened
    sqlite_file: tuple[Path, int, int] | None = None
    #: a lost connection has been said and not yet its return
    _waiting = False

    def watch_file(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            st = path.stat()
            self.sqlite_file = (path.absolute(), st.st_dev, st.st_ino)

    def _check_file(self) -> None:
        if self.sqlite_file is None:
            return
        path, dev, ino = self.sqlite_file
        try:
            st = path.stat()
            now = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        except OSError:
            return  # unreadable for another reason: SQLite's own error says which
        if now != (dev, ino):  # raised outside the except: its own words are the reason
            raise DatabaseFileGone(path)

    def _retrying(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        self._check_file()
        deadline = time.monotonic() + self.retry_s
        pause = RETRY_PAUSE_S
        failed_before = False
        while True:
            try:
                value = call(self, *args, **kwargs)
            except UpdateFinishedTrialError:
                # a state change whose commit was lost with the connection, then applied: what
                # was asked is what the trial has
                if failed_before and call is RDBStorage.set_trial_state_values:
                    return True  # type: ignore[return-value]
                raise
            except (sqlalchemy.exc.SQLAlchemyError, StorageInternalError) as exc:
                left = deadline - time.monotonic()
                if not connection_lost(exc) or left <= 0:
                    raise
                if not failed_before and not self._waiting:
                    self._waiting = True  # one line per outage, on stderr
                    print(
                        f"the study's database server is unreachable ({_first_line(exc)}); "
                        f"trying again for up to {self.retry_s:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                failed_before = True
                time.sleep(min(pause, left))
                pause = min(2 * pause, RETRY_PAUSE_MAX_S)
            else:
                if self._waiting:
                    self._waiting = False
                    print("the study's database server is back", file=sys.stderr, flush=True)
                return value

    def record_heartbeat(self, trial_id: int) -> None:
        """A heartbeat that cannot be written is skipped (the next one tries again): Optuna's
        heartbeat thread ends, with a traceback, on the first error it meets."""
        with contextlib.suppress(sqlalchemy.exc.SQLAlchemyError, StorageInternalError, OSError):
            self._check_file()
            RDBStorage.record_heartbeat(self, trial_id)


#: the calls of RDBStorage that reach the database, each tried again on a lost connection
_RETRIED = (
    "create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr",
    "get_study_id_from_name", "get_study_name_from_id", "get_study_directions",
    "get_study_user_attrs", "get_study_system_attrs", "get_trial_user_attrs",
    "get_trial_system_attrs", "get_all_studies", "create_new_trial", "set_trial_param",
    "get_trial_param", "set_trial_state_values", "set_trial_intermediate_value",
    "set_trial_user_attr", "set_trial_system_attr", "get_trial_id_from_study_id_trial_number",
    "get_trial", "get_all_trials", "get_best_trial", "_get_stale_trial_ids",
)  # fmt: skip


def _retried(name: str) -> Callable[..., Any]:
    call = getattr(RDBStorage, name)

    def method(self: ReconnectingStorage, *args: Any, **kwargs: Any) -> Any:
        return self._retrying(call, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = call.__doc__
    return method


for _name in _RETRIED:
    setattr(ReconnectingStorage, _name, _retried(_name))


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
    else:
        # a pooled connection the server closed (a restart) is replaced before use
        engine_kwargs["pool_pre_ping"] = True
    if read_only:
        engine_kwargs = _read_only_engine_kwargs(target, path)
        if path is not None:  # the creator opens the file read-only; the URL's query is moot
            target = target.partition("?")[0]
        _check_schema(target, engine_kwargs, url)
    storage = _create(target, url, interval, engine_kwargs, read_only)
    storage.retry_s = storage_retry_s()
    if path is not None:
        storage.watch_file(path)
    if sqlite and not read_only:
        event.listen(storage.engine, "begin", _begin_immediate)
        storage.engine.dispose()  # connections made before the listener are not reused
    return storage


def _create(
    target: str, url: str, interval: int, engine_kwargs: dict[str, Any], read_only: bool
) -> ReconnectingStorage:
    """Optuna's RDBStorage; a first run racing another on a new database tries again."""
    for attempt in range(SCHEMA_TRIES):
        try:
            with warnings.catch_warnings():  # Optuna calls heartbeats experimental; we rely on them
                warnings.simplefilter("ignore", ExperimentalWarning)
                return ReconnectingStorage(
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
