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
import re
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from optuna.exceptions import ExperimentalWarning
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from sqlalchemy import event

from autotune.errors import UserError

#: seconds between heartbeats of a running trial; its grace period is ``GRACE_FACTOR`` times that
HEARTBEAT_S = 10
GRACE_FACTOR = 3
#: overrides HEARTBEAT_S (tests use 1 so a killed controller's trial goes stale in seconds)
HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"
#: seconds an SQLite writer waits for another process's transaction before giving up
SQLITE_BUSY_TIMEOUT_S = 60

_PASSWORD = re.compile(r"(://[^:/@]+:)([^@]*)@")


def mask_url(url: str) -> str:
    """The storage URL with any password replaced by ``***``."""
    return _PASSWORD.sub(r"\1***@", url)


def mask_secret(text: str, url: str) -> str:
    """``text`` with the URL's password (raw and percent-decoded) replaced by ``***``."""
    text = mask_url(text)
    match = _PASSWORD.search(url)
    if match and match.group(2):
        for secret in {match.group(2), unquote(match.group(2))}:
            text = text.replace(secret, "***")
    return text


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


def open_storage(url: str, must_exist: bool = False) -> RDBStorage:
    """An RDB storage with heartbeats: a trial whose controller died is failed and retried once.

    ``must_exist``: for commands that only read or join a study, a SQLite file that is not
    there is a typo, not a new database to create.
    """
    interval = heartbeat_interval()
    target = driver_url(url)
    sqlite = target.startswith("sqlite")
    path = sqlite_path(target)
    if must_exist and path is not None and not path.is_file():
        raise UserError(f"no database at {path} (storage {mask_url(url)}): run `autotune run`")
    engine_kwargs: dict[str, Any] | None = None
    if sqlite:
        # isolation_level=None: pysqlite issues no BEGIN of its own; _begin_immediate does
        engine_kwargs = {
            "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "isolation_level": None}
        }
    try:
        with warnings.catch_warnings():  # Optuna calls heartbeats experimental; we rely on them
            warnings.simplefilter("ignore", ExperimentalWarning)
            storage = RDBStorage(
                target,
                heartbeat_interval=interval,
                grace_period=GRACE_FACTOR * interval,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
                engine_kwargs=engine_kwargs,
            )
    except Exception as exc:  # SQLAlchemy and drivers raise many kinds; all mean "can't open"
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise UserError(
            f"cannot open storage {mask_url(url)}: {mask_secret(reason, url)[:200]}"
        ) from None
    if sqlite:
        event.listen(storage.engine, "begin", _begin_immediate)
        storage.engine.dispose()  # connections made before the listener are not reused
    return storage
