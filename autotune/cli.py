"""The ``autotune`` command line: the group that registers the commands (each in its own module
under ``autotune/commands/``)."""

from __future__ import annotations

import warnings

import click
import optuna

from autotune.commands.estimate import estimate_cmd
from autotune.commands.export import export_cmd
from autotune.commands.output import next_commands, resume_hint
from autotune.commands.report import report
from autotune.commands.resume import resume
from autotune.commands.run import run
from autotune.commands.show import show
from autotune.commands.worker import worker
from autotune.errors import OneLineGroup

__all__ = ["main", "next_commands", "resume_hint", "run"]


@click.group(cls=OneLineGroup)
@click.version_option(package_name="autotune")
def main() -> None:
    """Find the fastest way to train a model inside a memory budget, by measurement."""
    # ERROR: Optuna's warning for a failed trial prints a traceback; autotune stores the reason
    # and the job's stderr on the trial and shows them itself.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    # Optuna flags heartbeats, grouped TPE and metric names as experimental; they are what we want.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


for command in (run, resume, worker, show, report, export_cmd, estimate_cmd):
    main.add_command(command)


if __name__ == "__main__":
    main()
