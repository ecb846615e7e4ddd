"""``autotune resume``: continue a study by name."""

from __future__ import annotations

from typing import Any

import click

from autotune.commands.controller import climb, optimize, reopen
from autotune.commands.options import LaunchingCommand, controller_options
from autotune.commands.output import answer, console
from autotune.launchers import launcher_of
from autotune.pending import PENDING_DIR
from autotune.space import SearchSpace
from autotune.study import workdir_for


@click.command(cls=LaunchingCommand)
@controller_options
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=0),
    default=12,
    show_default=True,
    help="0 with --ladder: only the ladder.",
)
@click.option("--ladder", is_flag=True, help="Then measure the missing rungs of the ladder.")
@click.option("--table", is_flag=True, help="Print every trial's row before the answer.")
def resume(
    study_name: str,
    n_trials: int,
    storage: str,
    trial_timeout: float,
    timeout: float | None,
    data: str | None,
    ladder: bool,
    table: bool,
    **launcher: Any,
) -> None:
    """Continue a study by name with its stored settings (and its launcher, unless given).

    Slurm jobs that a stopped controller left queued or running are collected into their
    trials (``--trials 0``: only that)."""
    study, settings = reopen(storage, study_name, data, launcher)
    console.print(f"resuming study '{study_name}': {len(study.trials)} trials so far", markup=False)
    # measurements an earlier run kept (``autotune.pending``) are stored by ``optimize``
    kept = any((workdir_for(study) / PENDING_DIR).glob("trial-*.json"))
    if n_trials or kept or launcher_of(settings.launcher).outlives_controller:
        optimize(
            study,
            SearchSpace.from_dict(settings.space, "study"),
            n_trials,
            timeout,
            trial_timeout,
            storage,
            confirm=n_trials > 0,  # --trials 0 only collects what earlier runs left
        )
    answer(study, storage, table=table)
    if ladder:
        climb(study, trial_timeout, storage)
