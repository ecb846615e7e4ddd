"""``autotune worker``: draw trials from an existing study, beside other workers."""

from __future__ import annotations

import os
from typing import Any

import click

from autotune.backends import backend_named
from autotune.commands.controller import optimize, reopen
from autotune.commands.options import LaunchingCommand, controller_options
from autotune.commands.output import answer, console
from autotune.errors import UserError
from autotune.launchers import launcher_of
from autotune.plan import cuda_available
from autotune.space import SearchSpace


@click.command(cls=LaunchingCommand)
@controller_options
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    default=12,
    show_default=True,
    help="Trials this worker runs (the study's total is the sum over its workers).",
)
def worker(
    study_name: str,
    storage: str,
    n_trials: int,
    trial_timeout: float,
    timeout: float | None,
    data: str | None,
    **launcher: Any,
) -> None:
    """Draw trials from an existing study; run one per machine, or several, at once.

    Every worker runs its trials on its own machine's devices and records them in the shared
    storage (PostgreSQL across machines; SQLite for workers on one machine).
    """
    study, settings = reopen(storage, study_name, data, launcher)
    if (
        backend_named(settings.backend).cuda
        and not launcher_of(settings.launcher).remote
        and not (cuda_available())
    ):
        raise UserError(
            f"study '{study_name}' measures on CUDA GPUs and this machine has no CUDA GPU "
            "visible: run its workers where the GPUs are"
        )
    console.print(
        f"worker {os.getpid()} on study '{study_name}': {len(study.trials)} trials so far, "
        f"running {n_trials}",
        markup=False,
    )
    optimize(
        study,
        SearchSpace.from_dict(settings.space, "study"),
        n_trials,
        timeout,
        trial_timeout,
        storage,
        worker=True,
    )
    answer(study, storage, table=False)
