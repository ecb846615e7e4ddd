"""Errors a user caused: one clear line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

import click


class UserError(click.ClickException):
    """Bad input: a budget, a model name, a space file, a storage URL, a study mismatch.

    click prints ``Error: <message>`` on stderr and exits with ``exit_code``.
    """

    exit_code = 2
