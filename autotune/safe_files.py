"""Files that ``export`` and ``report`` write: never onto what the user did not name.

As git refuses to overwrite an untracked file: a file that is already there is replaced only
when this tool wrote it (its hash is recorded in a manifest beside it and it is unchanged since)
or with ``--force``. Never, even with ``--force``: the study's own database (and its journal),
or anything that is not a regular file (a FIFO would block, a device would be replaced). Every
file is written atomically (a temporary file in the same folder, then ``os.replace``), which
also means a symbolic link planted at a name is replaced, never written through; a link is
only replaced with ``--force``, as any file the tool did not write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from autotune.errors import UserError
from autotune.storage import sqlite_path
from autotune.terminal import printable

#: the manifest key: file name -> sha256 of the content this tool wrote
WRITTEN_KEY = "written"
#: the files SQLite keeps beside a database
SQLITE_SIDE = ("", "-journal", "-wal", "-shm")

T = TypeVar("T")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def database_files(storage_url: str) -> list[Path]:
    """The study's own files (an SQLite database and its journals): never an output."""
    path = sqlite_path(storage_url)
    return [] if path is None else [Path(f"{path}{side}") for side in SQLITE_SIDE]


def _same(a: Path, b: Path) -> bool:
    with contextlib.suppress(OSError):
        if os.path.samefile(a, b):
            return True
    return os.path.realpath(a) == os.path.realpath(b)


def read_manifest(path: Path) -> dict[str, str] | None:
    """The files a manifest (a JSON object with ``written``) records; None: not one of ours."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or os.path.getsize(path) > 1_000_000:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    written = data.get(WRITTEN_KEY) if isinstance(data, dict) else None
    if not isinstance(written, dict):
        return None
    return {str(k): str(v) for k, v in written.items()}


def _content_sha(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return sha256(f.read())
    except OSError:
        return None


def check_targets(
    targets: Iterable[Path],
    manifest: Path,
    force: bool,
    protected: Iterable[Path] = (),
    option: str = "--out",
) -> None:
    """Refuse, before anything is written, any target that is not ours to replace."""
    targets = list(targets)
    protected = list(protected)
    existing = []
    for target in targets:  # first what even --force does not write through
        shown = printable(str(target))
        for own in protected:
            if _same(target, own):
                raise UserError(
                    f"{option} {shown} is the study's own database: choose another file"
                )
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UserError(f"cannot write {shown}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            if not force:
                raise UserError(
                    f"{shown} is a symbolic link autotune did not make: remove it, choose "
                    f"another {option}, or add --force to replace the link (not its target)"
                )
        elif stat.S_ISDIR(st.st_mode):
            raise UserError(f"cannot write {shown}: it is a directory; choose another {option}")
        elif not stat.S_ISREG(st.st_mode):
            raise UserError(
                f"cannot write {shown}: not a regular file (a FIFO, a device or a socket); "
                f"choose another {option}"
            )
        else:
            existing.append(target)
    if force:
        return
    recorded = read_manifest(manifest) or {}
    for target in existing:  # then what only --force replaces: files autotune did not write
        ours = (
            read_manifest(target) is not None
            if _same(target, manifest)
            else recorded.get(target.name) is not None
            and recorded.get(target.name) == _content_sha(target)
        )
        if not ours:
            raise UserError(
                f"{printable(str(target))} already exists and autotune did not write it (or "
                f"it was changed since): choose another {option}, or add --force to replace it"
            )


def write_atomic(path: Path, data: bytes | str) -> str:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename:
    a reader sees the old file or the new one, a link at ``path`` is replaced, not followed.
    Returns the content's sha256."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would create it (mkstemp's is 0600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return sha256(raw)


def manifest_entry(recorded: dict[str, str]) -> dict[str, Any]:
    return {WRITTEN_KEY: dict(sorted(recorded.items()))}


def write_folder(
    out: Path,
    build: Callable[[Path], T],
    force: bool,
    manifest_name: str,
    protected: Iterable[Path] = (),
) -> T:
    """Fill the folder ``out`` with what ``build`` writes into a fresh staging folder beside
    it: all of it or, on any error, nothing (a folder this call created is not left behind).
    ``out`` may exist (a real folder, not a link unless ``force``): its files are replaced
    under ``check_targets``'s rules, recorded in ``out/<manifest_name>``."""
    shown = printable(str(out))
    if out.is_symlink() and not force:
        raise UserError(
            f"{shown} is a symbolic link autotune did not make: remove it, choose another "
            "--out, or add --force to write into the folder it names"
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"cannot write {shown}: it is a file, not a folder; choose another --out")
    for own in protected:
        if _same(out, own):
            raise UserError(f"--out {shown} is the study's own database: choose another folder")
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        result = build(stage)
        names = sorted(p.name for p in stage.iterdir() if p.is_file())
        if not out.exists():
            recorded = {n: _content_sha(stage / n) or "" for n in names}
            write_atomic(stage / manifest_name, json.dumps(manifest_entry(recorded), indent=2))
            os.chmod(stage, 0o777 & ~_umask())
            os.rename(stage, out)  # a folder made here: whole, in one step
            return result
        manifest = out / manifest_name
        check_targets([out / n for n in names], manifest, force, protected)
        recorded = read_manifest(manifest) or {}
        for name in names:
            recorded[name] = _content_sha(stage / name) or ""
            os.replace(stage / name, out / name)
        write_atomic(manifest, json.dumps(manifest_entry(recorded), indent=2))
        return result
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def nothing_left(paths: Iterable[Path]) -> Iterator[None]:
    """On an error, remove those of ``paths`` that did not exist before."""
    fresh = [p for p in paths if not os.path.lexists(p)]
    try:
        yield
    except BaseException:
        for p in fresh:
            with contextlib.suppress(OSError):
                p.unlink()
        raise
