"""What the commands print and write: the answer block, the commands to type next (each one
quoted command to paste), files written as one line on failure."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import optuna
from click.core import ParameterSource
from rich.markup import escape

from autotune.backends import backend_named
from autotune.display import (
    certainty_line,
    commands_grid,
    print_answer,
    print_failures,
    results_table,
)
from autotune.errors import EnvironmentFailure, UserError
from autotune.estimate_cli import confirm_winner
from autotune.estimator.exhaustive import ClassBest
from autotune.estimator.gpus import gpu_spec
from autotune.export import EXPORTERS
from autotune.masking import mask_url, url_secrets
from autotune.selector import CONTENDERS_ATTR, select
from autotune.study import DEFAULT_STORAGE, settings_of
from autotune.terminal import make_console, shell_line
from trials.techniques.zero import runs_deepspeed

console = make_console()
err_console = make_console(stderr=True)


def answer(
    study: optuna.Study,
    storage_url: str,
    table: bool = True,
    per_class: dict[str, ClassBest] | None = None,
) -> None:
    """The answer block, after the full trials table when ``table`` (``show``, ``--table``).
    On the estimate backend the selector's winner is no answer: the best per fidelity class is
    (``per_class``, as ``run`` scored the space; ``confirm_winner`` prints it)."""
    sel = select(study)
    settings = settings_of(study)
    title = f"study {escape(study.study_name)}"
    counts = {k: sum(r.status == k for r in sel.rows) for k in ("ok", "oom", "failed")}
    full_table = "(the full table: autotune show, or --table)"
    winner = sel.winner.config if sel.winner is not None else None
    commands = next_commands(study.study_name, storage_url, winner)
    if not backend_named(settings.backend).measures:
        title += f": predicted for {gpu_spec(settings.target_gpu).name}, not measured"
        if table:
            console.print(results_table(sel, title))
        else:
            console.print(
                f"{len(sel.rows)} configurations predicted: {counts['ok']} fit, "
                f"{counts['oom']} over the budget {full_table}"
            )
        if per_class is not None:
            console.print("tracing the best configuration's step on fake tensors", style="dim")
            confirm_winner(study, settings, console, per_class)
        console.print(commands_grid(commands))
    else:
        if table:
            console.print(results_table(sel, title))
            print_failures(console, sel.rows)
        else:
            console.print(
                f"{len(sel.rows)} trials: {counts['ok']} ran, {counts['oom']} over the budget, "
                f"{counts['failed']} failed {full_table}"
            )
        print_answer(console, sel, commands)
        certainty = certainty_line(
            study.user_attrs.get(CONTENDERS_ATTR), resume_hint(study.study_name, storage_url)
        )
        if certainty:
            console.print(certainty, markup=False)
    console.print(f"stored in {mask_url(storage_url)} as study '{study.study_name}'", markup=False)


def next_commands(
    study_name: str, storage_url: str, winner: dict[str, Any] | None = None
) -> dict[str, str]:
    """What to type next: the export, resume and report commands, each one quoted command to
    paste (as ``resume_hint``: a storage URL with a password is not printed; a ``storage`` line
    then says to set AUTOTUNE_STORAGE), and the other export formats. The export is DeepSpeed's
    JSON, or accelerate's config for a winner that runs without DeepSpeed (plain torch, FSDP2)."""
    where, note = _study_args(study_name, storage_url)
    fmt, file = ("deepspeed", "ds_config.json")
    if winner is not None and not runs_deepspeed(winner):
        fmt, file = ("accelerate", "accelerate_config.yaml")
    out = {
        "export": shell_line(["autotune", "export", *where, "--format", fmt, "--out", file]),
        "formats": "or --format " + ", ".join(f for f in EXPORTERS if f != fmt),
        "resume": shell_line(["autotune", "resume", *where, "--trials", "12"]),
        "report": shell_line(["autotune", "report", *where, "--out", "autotune_report"]),
    }
    if note:
        out["storage"] = "run them" + note
    return out


def _study_args(study_name: str, storage_url: str) -> tuple[list[str], str]:
    """The options that name the study and its storage in a command to paste, and a note. A
    storage URL with a password (or one read from AUTOTUNE_STORAGE) is left out: the command
    then reads it from AUTOTUNE_STORAGE, as the note says."""
    parts = ["--study", study_name]
    ctx = click.get_current_context(silent=True)
    from_env = (
        ctx is not None and ctx.get_parameter_source("storage") == ParameterSource.ENVIRONMENT
    )
    if url_secrets(storage_url) or from_env:
        return parts, " (with AUTOTUNE_STORAGE set to the study's storage URL)"
    if storage_url != DEFAULT_STORAGE:
        parts += ["--storage", storage_url]
    return parts, ""


def resume_hint(study_name: str, storage_url: str, *extra: str) -> str:
    """``: autotune resume ...``, one quoted command to paste (``_study_args`` names the
    study and its storage)."""
    where, note = _study_args(study_name, storage_url)
    return f"{note}: {shell_line(['autotune', 'resume', *where, *extra])}"


#: the machine's fault, not the input's: exit code 1
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """An OSError while writing ``out`` (or a file beside it) as one line."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or out
        if exc.errno in _ENVIRONMENT_ERRNOS:
            raise EnvironmentFailure(f"cannot write {where}: {exc.strerror}") from None
        raise UserError(f"cannot write {where}: {exc.strerror}; choose another --out") from None
