"""A throwaway PostgreSQL cluster on loopback, for the tests of many workers on one study.

Uses the server binaries of Debian's ``postgresql`` package (``.ci/run`` installs it). As root
(CI runs as root, and PostgreSQL refuses to) the server runs as the ``postgres`` user. The
cluster lives in a temporary folder, listens on 127.0.0.1 on a free port, and requires a
password, so the tests can check that the password is never printed.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: a URL here (e.g. from CI) is used instead of starting a cluster
PG_URL_ENV = "AUTOTUNE_TEST_PG_URL"
USER = "autotune"
PASSWORD = "pw-s3cret-9f4d"


class Unavailable(Exception):
    """PostgreSQL cannot run here (no binaries, or the server did not start)."""


def find_binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version)
    return found[-1] if found else shutil.which(name)


def _version(path: str) -> float:
    try:
        return float(Path(path).parts[-3])
    except ValueError:
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    root: Path
    port: int
    server: subprocess.Popen[bytes]
    #: how the server was started, to start it again on the same data and port (``restart``)
    command: list[str] | None = None
    as_user: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/postgres"

    def halt(self) -> None:
        """Stop the server as an administrator does (``pg_ctl stop -m fast``: the clients'
        connections are ended), keeping its data for ``restart``."""
        self.server.send_signal(signal.SIGINT)  # "fast" shutdown: does not wait for clients
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start the halted server again, on the same data and port."""
        assert self.command is not None and self.server.poll() is not None
        with open(self.root / "server.log", "ab") as out:
            self.server = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                **(self.as_user or {}),
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.url):
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise Unavailable("postgres did not start again")
            time.sleep(0.2)

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.root, ignore_errors=True)


def start(timeout_s: float = 60.0) -> Cluster:
    if importlib.util.find_spec("psycopg") is None:
        raise Unavailable("psycopg is not installed (pip install 'autotune[postgres]')")
    initdb, postgres = find_binary("initdb"), find_binary("postgres")
    if initdb is None or postgres is None:
        raise Unavailable("no PostgreSQL server binaries (apt-get install postgresql)")
    as_user: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    if os.geteuid() == 0:
        try:
            pg = pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("running as root and there is no 'postgres' user") from None
        as_user = {"user": pg.pw_uid, "group": pg.pw_gid}
        os.chown(root, pg.pw_uid, pg.pw_gid)
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if as_user:
        os.chown(pwfile, as_user["user"], as_user["group"])
    data, log = root / "data", root / "server.log"
    init = subprocess.run(
        [initdb, "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth=scram-sha-256",
         "-E", "UTF8", "--no-sync"],
        capture_output=True, text=True, cwd=root, **as_user,
    )  # fmt: skip
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise Unavailable(f"initdb failed: {init.stderr.strip()[-300:]}")
    port = _free_port()
    command = [postgres, "-D", str(data), "-h", "127.0.0.1", "-p", str(port), "-k", str(root),
               "-c", "fsync=off", "-c", "max_connections=50"]  # fmt: skip
    with open(log, "wb") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=root, **as_user
        )  # fmt: skip
    cluster = Cluster(root, port, server, command, as_user)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            text = log.read_text(errors="replace").strip()[-300:]
            cluster.stop()
            raise Unavailable(f"postgres exited with {server.returncode}: {text}")
        if _accepts(cluster.url):
            return cluster
        time.sleep(0.3)
    cluster.stop()
    raise Unavailable(f"postgres did not accept connections within {timeout_s:g}s")


def _accepts(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True
