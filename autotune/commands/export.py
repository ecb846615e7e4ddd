"""``autotune export``: the winner as a DeepSpeed, Hugging Face, accelerate, axolotl config or
a launch command."""

from __future__ import annotations

from pathlib import Path

import click

from autotune.backends import backend_named
from autotune.commands.options import FiniteFloat, force_option, storage_option
from autotune.commands.output import console, writing
from autotune.errors import UserError
from autotune.estimator.gpus import gpu_spec
from autotune.export import EXPORTERS, UserSettings, export, measured_on
from autotune.safe_files import database_files
from autotune.selector import select
from autotune.storage import open_storage
from autotune.study import load_existing, settings_of
from autotune.units import format_size


@click.command("export")
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option("--format", "fmt", required=True, help=f"One of: {', '.join(EXPORTERS)}.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--lr",
    type=FiniteFloat(min=0, min_open=True),
    default=None,
    help="Learning rate to write (not tuned by the study; default: left to your trainer).",
)
@click.option(
    "--weight-decay",
    type=FiniteFloat(min=0),
    default=None,
    help="Weight decay to write (not tuned by the study; default: left to your trainer).",
)
@force_option
def export_cmd(
    study_name: str | None,
    storage: str,
    fmt: str,
    out: Path,
    lr: float | None,
    weight_decay: float | None,
    force: bool,
) -> None:
    """Write the winner as a DeepSpeed, Hugging Face, accelerate, axolotl config or a command."""
    if fmt not in EXPORTERS:
        raise UserError(f"unknown export format '{fmt}' (known: {', '.join(EXPORTERS)})")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    study = load_existing(open_storage(storage, read_only=True), study_name)
    sel = select(study)
    if sel.winner is None:
        raise UserError(
            f"study '{study.study_name}' has no trial that fits {format_size(sel.budget_bytes)}"
            " yet: nothing to export"
        )
    settings = settings_of(study)
    with writing(out):
        path = export(
            fmt,
            sel.winner.config,
            settings,
            out,
            UserSettings(lr, weight_decay),
            force=force,
            protected=database_files(storage),
        )
    console.print(f"wrote {fmt} config of trial {sel.winner.number} to {path}", markup=False)
    backend = backend_named(settings.backend)
    if backend.measures and not backend.cuda:  # on a CPU: the speeds are no GPU's
        console.print(measured_on(settings), style="yellow", markup=False)
    if not backend.measures:
        gpu = gpu_spec(settings.target_gpu).name
        console.print(f"[yellow]predicted for {gpu}, not measured[/yellow]: run it there first")
