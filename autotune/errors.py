"""Errors a user caused: one clear line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

import errno
import sys
from collections.abc import Sequence
from typing import Any

import click

from autotune.masking import mask_text
from autotune.terminal import printable


class UserError(click.ClickException):
    """Bad input: a budget, a model name, a space file, a storage URL, a study mismatch.

    click prints ``Error: <message>`` on stderr and exits with ``exit_code``.
    """

    exit_code = 2


class EnvironmentFailure(click.ClickException):
    """Not the input but the machine: a database server that is down, a full disk.

    Exit code 1, like any other run that failed; still one line, never a traceback.
    """

    exit_code = 1


#: errors of the machine, not of autotune: one line, exit code 1
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


def _is_storage_error(exc: BaseException) -> bool:
    """A database error (connection lost, locked too long): one line, never a traceback."""
    import optuna
    import sqlalchemy.exc

    return isinstance(exc, (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError))


#: what SQLite says of a damaged file, anywhere in an error's chain
_CORRUPT = ("database disk image is malformed", "file is not a database", "file is encrypted")


def corrupt_database(exc: BaseException) -> str:
    """SQLite's words when ``exc`` (or an error it came from: Optuna's own "an exception is
    raised during the commit" wraps it) says the database file is damaged; '' otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).lower()
        for words in _CORRUPT:
            if words in text:
                return words
        current = current.__cause__ or current.__context__
    return ""


def corrupt_message(where: str, words: str) -> str:
    return (
        f"{where}: the database file is damaged (SQLite: {words}); restore it from a backup "
        "or use another database"
    )


class OneLineGroup(click.Group):
    """A command group whose errors, click's usage errors too, are one line on stderr.

    click's own handler prints the usage and a help hint above a usage error; here every
    ``ClickException`` becomes ``Error: <message> (see --help)`` alone, with its exit code.
    """

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            # every message passes the masking: a password it quotes is never printed
            message = printable(mask_text(" ".join(exc.format_message().split())))
            hint = " (see --help)" if isinstance(exc, click.UsageError) else ""
            click.echo(f"Error: {message}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except BrokenPipeError:  # `autotune show | head`: the reader left; nothing to say
            sys.stderr.close()
            sys.exit(1)
        except OSError as exc:
            if exc.errno not in _ENVIRONMENT_ERRNOS:
                raise
            where = f" {exc.filename}" if exc.filename else ""
            click.echo(f"Error: cannot write{where}: {exc.strerror}", err=True)
            sys.exit(1)
        except Exception as exc:
            if not _is_storage_error(exc):
                raise
            damaged = corrupt_database(exc)
            if damaged:
                click.echo(f"Error: {corrupt_message('the study', damaged)}", err=True)
                sys.exit(UserError.exit_code)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            click.echo(f"Error: the study's storage failed: {mask_text(lines[0])[:300]}", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
