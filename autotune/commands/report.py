"""``autotune report``: the plots, the memory breakdown and the ladder, as files."""

from __future__ import annotations

from pathlib import Path

import click

from autotune.commands.options import force_option, storage_option
from autotune.commands.output import console, resume_hint, writing
from autotune.display import ladder_table
from autotune.errors import UserError
from autotune.ladder import ladder_cells
from autotune.safe_files import database_files, write_folder
from autotune.storage import open_storage
from autotune.study import load_existing

#: in a report folder: the files ``report`` wrote there (it replaces only those without --force)
REPORT_MANIFEST = ".autotune-report.json"


@click.command()
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("autotune_report"),
    show_default=True,
    help="Folder for pareto.png, memory.png, report.md and report.html.",
)
@force_option
def report(study_name: str | None, storage: str, out: Path, force: bool) -> None:
    """Write the Pareto plot, the memory breakdown and the ablation ladder (runs nothing)."""
    from autotune.report import write_report  # matplotlib: only for this command

    if not out.parent.exists():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    study = load_existing(open_storage(storage, read_only=True), study_name)
    with writing(out):
        written = write_folder(
            out,
            lambda stage: write_report(study, stage),
            force,
            REPORT_MANIFEST,
            database_files(storage),
        ).moved_to(out)
    console.print(ladder_table(ladder_cells(written.ladder), written.ladder.budget_bytes))
    if not written.ladder.complete and written.ladder.target is not None:
        click.echo(
            f"{len(written.ladder.missing)} ladder configuration(s) not measured; run them with"
            f"{resume_hint(study.study_name, storage, '--trials', '0', '--ladder')}"
        )
    for path in (written.pareto_png, written.memory_png, written.markdown, written.html):
        if path is not None:
            console.print(f"wrote {path}", markup=False)
