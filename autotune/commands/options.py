"""Options that several commands share, as click decorators."""

from __future__ import annotations

import math
from typing import Any

import click

from autotune.launchers import LAUNCHERS
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
    help="The most seconds a trial job may run before it is killed and marked failed; each "
    "trial's own limit is 4x its predicted steps' time, at least --trial-timeout-floor "
    "(docs/guide/reliability.md).",
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


class LauncherChoice(click.Choice):  # type: ignore[type-arg]
    """``--launcher``'s choices: the launchers registered when the command line is parsed."""

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return tuple(LAUNCHERS)

    @choices.setter
    def choices(self, value: Any) -> None:
        pass


class LauncherOption(click.Option):
    """``--launcher``, its help a sentence per registered launcher."""

    @property  # type: ignore[override]
    def help(self) -> str:
        return " ".join(f"{one.name}: {one.help}" for one in LAUNCHERS.values())

    @help.setter
    def help(self, value: Any) -> None:
        pass


class LaunchingCommand(click.Command):
    """A command that runs trials: after its ``--launcher`` come the options of every registered
    launcher (``autotune.launchers.Launcher.options``); the command receives them by name."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        at = next((i for i, p in enumerate(params) if p.name == "launcher"), None)
        if at is None:
            return params
        own = [o for one in LAUNCHERS.values() for o in one.click_options]
        return [*params[: at + 1], *own, *params[at + 1 :]]


launcher_option = click.option(
    "--launcher", cls=LauncherOption, type=LauncherChoice([]), default=None
)


data_moved_option = click.option(
    "--data",
    "data",
    default=None,
    help="Where the study's dataset is now, when it has moved: accepted when its bytes are the "
    "study's (the same SHA-256), and stored with the study.",
)


def controller_options(f: Any) -> Any:
    """What ``resume`` and ``worker`` share: the study by name, its storage, the time limits,
    where its dataset has moved (``--data``) and the launcher (``--launcher`` and, with
    ``LaunchingCommand``, each launcher's options)."""
    for option in reversed(
        [
            click.option("--study", "study_name", required=True),
            storage_option,
            trial_timeout_option,
            timeout_option,
            data_moved_option,
            launcher_option,
        ]
    ):
        f = option(f)
    return f
