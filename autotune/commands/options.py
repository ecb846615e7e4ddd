"""Options that several commands share, as click decorators."""

from __future__ import annotations

import math
from typing import Any

import click

from autotune.study import DEFAULT_STORAGE


class FiniteFloat(click.FloatRange):
    """A float option in a range that also refuses ``nan`` and ``inf`` (click lets them by)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


storage_option = click.option(
    "--storage",
    default=DEFAULT_STORAGE,
    show_default=True,
    envvar="AUTOTUNE_STORAGE",
    help="Any SQLAlchemy URL (sqlite:///file.db, postgresql://user:pw@host/db); or set "
    "AUTOTUNE_STORAGE, which keeps a password out of the process list.",
)
trial_timeout_option = click.option(
    "--trial-timeout",
    type=FiniteFloat(min=1.0),
    default=600.0,
    show_default=True,
    help="Seconds before a trial job is killed and marked failed.",
)
force_option = click.option(
    "--force",
    is_flag=True,
    help="Replace files (or a symbolic link) at the output's names that autotune did not "
    "write; never the study's database.",
)
timeout_option = click.option(
    "--timeout",
    type=FiniteFloat(min=1.0),
    default=None,
    help="Stop starting new trials after this many seconds.",
)
