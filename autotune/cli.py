"""The ``autotune`` command line: run, resume, show, export."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import optuna
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.display import (
    describe,
    ladder_table,
    print_answer,
    print_failures,
    results_table,
)
from autotune.errors import OneLineGroup, UserError
from autotune.estimate_cli import (
    ESTIMATE_TRIALS,
    banner,
    confirm_winner,
    estimate_cmd,
    estimate_space,
    hardware_for,
    runner_for,
    target_gpu,
)
from autotune.estimator.gpus import gpu_spec
from autotune.export import EXPORTERS, export
from autotune.hardware import Hardware
from autotune.ladder import ladder_cells, run_ladder
from autotune.models import resolve_model
from autotune.runner import SubprocessRunner
from autotune.selector import select, selection_json
from autotune.space import SearchSpace
from autotune.storage import mask_url, open_storage
from autotune.study import (
    DEFAULT_STORAGE,
    STRATEGIES,
    Objective,
    StudySettings,
    TrialCrashed,
    create_or_load,
    ensure_reference,
    load_existing,
    make_sampler,
    settings_of,
    workdir_for,
)
from autotune.units import budget_label, format_size, parse_size
from trials.spec import TrialResult

#: Real CPU trials build the model in this machine's memory; beyond this they can't run here.
MAX_CPU_TRIAL_PARAMS = 500_000_000

# as wide as the terminal (rich reads it, or COLUMNS; 80 when neither is known)
console = Console()
err_console = Console(stderr=True)

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
    type=click.FloatRange(min=1.0),
    default=600.0,
    show_default=True,
    help="Seconds before a trial job is killed and marked failed.",
)
timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Stop starting new trials after this many seconds.",
)


@click.group(cls=OneLineGroup)
@click.version_option(package_name="autotune")
def main() -> None:
    """Find the fastest way to train a model inside a memory budget, by measurement."""
    # ERROR: Optuna's warning for a failed trial prints a traceback; autotune stores the reason
    # and the job's stderr on the trial and shows them itself.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    # Optuna flags heartbeats, grouped TPE and metric names as experimental; they are what we want.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def _optimize(
    study: optuna.Study,
    space: SearchSpace,
    n_trials: int,
    timeout: float | None,
    trial_timeout: float,
    storage_url: str,
    worker: bool = False,
    strategy: str = "autotune",
) -> None:
    settings = settings_of(study)
    runner = runner_for(
        settings, SubprocessRunner(workdir_for(study.study_name), timeout_s=trial_timeout)
    )
    objective = Objective(study, space, runner)
    # workers draw trials; queueing the reference is the job of run/resume. Predictions have
    # no loss curve, so an estimate study has no reference and no loss guard.
    if not worker and settings.backend != "estimate":
        ensure_reference(study, space)
    study.sampler = make_sampler(
        study, settings.seed, salt=os.getpid() if worker else 0, space=space, strategy=strategy
    )
    with Progress(
        TextColumn("[bold]trials"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("", total=n_trials)

        def on_result(trial: Any, result: TrialResult) -> None:
            progress.update(
                task,
                advance=1,
                description=f"#{trial.number} {result.status} {format_size(result.peak_bytes)}"
                f" {describe(trial.user_attrs.get('config', {}))}",
            )

        objective.on_result = on_result
        try:
            with _terminate_as_interrupt():
                study.optimize(objective, n_trials=n_trials, timeout=timeout, catch=(TrialCrashed,))
        except KeyboardInterrupt:
            progress.stop()
            err_console.print(
                f"[yellow]interrupted[/yellow]; the running trial was stopped and marked failed. "
                f"Resume with: autotune resume --study {study.study_name} "
                f"--storage '{mask_url(storage_url)}'"
            )
            sys.exit(130)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler's stop) ends trials as cleanly as Ctrl-C does."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report(study: optuna.Study, storage_url: str, table: bool = True) -> None:
    """The answer block, after the full trials table when ``table`` (``show``, ``--table``)."""
    sel = select(study)
    settings = settings_of(study)
    title = f"study {study.study_name}"
    predicted_for = ""
    if settings.backend == "estimate":
        predicted_for = gpu_spec(settings.target_gpu).name
        title += f": predicted for {predicted_for}, not measured"
    if table:
        console.print(results_table(sel, title=title))
        print_failures(console, sel.rows)
    else:
        counts = {k: sum(r.status == k for r in sel.rows) for k in ("ok", "oom", "failed")}
        console.print(
            f"{len(sel.rows)} trials: {counts['ok']} ran, {counts['oom']} over the budget, "
            f"{counts['failed']} failed (the full table: autotune show, or --table)"
        )
    print_answer(console, sel, _next_commands(study, storage_url), predicted_for)
    console.print(f"stored in {mask_url(storage_url)} as study '{study.study_name}'")


def _next_commands(study: optuna.Study, storage_url: str) -> dict[str, str]:
    """What to type next, for this study and storage (the password masked)."""
    where = f" --study {shlex.quote(study.study_name)}"
    if storage_url != DEFAULT_STORAGE:
        where += f" --storage {shlex.quote(mask_url(storage_url))}"
    return {
        "export": f"autotune export{where} --format deepspeed --out ds_config.json"
        " (or hf, accelerate, axolotl, command)",
        "resume": f"autotune resume{where} --trials 12",
        "report": f"autotune report{where} --out autotune_report",
    }


@main.command()
@click.option("--model", required=True, help="Registered model name or a path to a config.json.")
@click.option("--budget", required=True, help="Memory budget per device, e.g. 24GB, 24GiB, 300MB.")
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    default=None,
    help=f"Default 12 (--backend estimate: {ESTIMATE_TRIALS}).",
)
@storage_option
@click.option("--study-name", default=None, help="Default: <model>-<budget>-<backend>.")
@click.option(
    "--space",
    "space_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Search space YAML (default: the packaged search_spaces/default.yaml).",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "cpu", "cuda", "estimate"]),
    default="auto",
    show_default=True,
    help="estimate: predictions for --gpu, chosen by auto without a GPU for models too big "
    "for CPU trials.",
)
@click.option("--gpu", default=None, help="Target GPU of --backend estimate (default: by budget).")
@click.option(
    "--loss-tolerance",
    type=click.FloatRange(min=0.0),
    default=0.02,
    show_default=True,
    help="Allowed relative loss regression of lossy techniques vs the reference.",
)
@trial_timeout_option
@timeout_option
@click.option("--seq-len", type=click.IntRange(min=8), default=None)
@click.option("--global-batch-size", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--strategy",
    type=click.Choice(sorted(STRATEGIES)),
    default="autotune",
    show_default=True,
    help="autotune: estimator-ordered, corrected by measurements (see autotune/strategy.py).",
)
@click.option(
    "--ladder",
    is_flag=True,
    help="Then measure the ablation ladder from the plain baseline to the winner.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    help="CPU: run each trial as N processes (torchrun, gloo); the budget is per process.",
)
@click.option("--table", is_flag=True, help="Print every trial's row before the answer.")
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="CUDA: run each trial on N GPUs (torchrun, nccl); the budget is per GPU.",
)
def run(
    model: str,
    budget: str,
    n_trials: int | None,
    storage: str,
    study_name: str | None,
    space_path: str | None,
    backend: str,
    gpu: str | None,
    loss_tolerance: float,
    trial_timeout: float,
    timeout: float | None,
    seq_len: int | None,
    global_batch_size: int | None,
    seed: int,
    strategy: str,
    ladder: bool,
    nproc: int | None,
    gpus: int | None,
    table: bool,
) -> None:
    """Run (or continue) a study of real training trials (or of predictions, without a GPU)."""
    budget_bytes = parse_size(budget)
    entry = resolve_model(model)
    space = SearchSpace.load(space_path)
    hardware = Hardware.detect(None if backend in ("auto", "estimate") else backend)
    if hardware.backend == "cuda" and not _cuda_available():
        raise UserError("--backend cuda: no CUDA GPU is visible to torch here")
    gpu_target = None
    if backend == "estimate" or (
        backend == "auto" and hardware.backend == "cpu" and entry.n_params > MAX_CPU_TRIAL_PARAMS
    ):
        gpu_target = target_gpu(gpu, budget_bytes)
        if backend == "auto":
            console.print(f"[bold yellow]{banner(entry.name, entry.n_params, gpu_target)}[/]")
        if space_path is None:
            space = estimate_space()
        hardware = hardware_for(gpu_target)
        n_trials = n_trials or ESTIMATE_TRIALS
    elif hardware.backend == "cpu" and entry.n_params > MAX_CPU_TRIAL_PARAMS:
        raise UserError(
            f"{entry.name} has {entry.n_params / 1e9:.1f}B parameters: too big for real CPU "
            "trials on this machine; use a GPU (--backend cuda), --backend estimate, or a "
            "small model"
        )
    n_trials = n_trials or 12
    ranks = _ranks(nproc, gpus, hardware) if gpu_target is None else 1
    gbs = global_batch_size or entry.global_batch_size
    resolved = space.resolve(gbs, hardware)
    settings = StudySettings(
        model=entry.name,
        model_config=entry.config,
        budget_bytes=budget_bytes,
        budget_label=budget_label(budget),
        backend="estimate" if gpu_target else hardware.backend,
        target_gpu=gpu_target.key if gpu_target else "",
        seq_len=seq_len or entry.seq_len,
        global_batch_size=gbs,
        space=resolved.as_dict(),
        loss_tolerance=loss_tolerance,
        seed=seed,
        nproc=ranks,
    )
    name = study_name or settings.default_study_name()
    study = create_or_load(open_storage(storage), name, settings)
    where = f"on {gpu_target.name}" if gpu_target else "here"
    for line in resolved.dropped:
        console.print(f"[dim]unavailable {where}: {line}[/dim]")
    console.print(
        f"study '{name}': {entry.name} ({entry.n_params / 1e6:,.1f}M params), budget "
        f"{format_size(budget_bytes)}, backend {settings.backend}, "
        f"{len(study.trials)} trials so far, running {n_trials} more"
    )
    _optimize(
        study,
        SearchSpace.from_dict(settings_of(study).space, "study"),
        n_trials,
        timeout,
        trial_timeout,
        storage,
        strategy=strategy,
    )
    _report(study, storage, table=table)
    if gpu_target is not None:
        confirm_winner(study, settings_of(study), console)
    if ladder:
        _climb(study, trial_timeout, storage)


def _climb(study: optuna.Study, trial_timeout: float, storage_url: str) -> None:
    """Run the ladder's missing rungs into the study, then print the ladder."""
    space = SearchSpace.from_dict(settings_of(study).space, "study")

    def optimize(n: int) -> None:
        console.print(f"ablation ladder: measuring {n} configuration(s)")
        _optimize(study, space, n, None, trial_timeout, storage_url)

    climbed = run_ladder(study, space, optimize)
    console.print(ladder_table(ladder_cells(climbed), climbed.budget_bytes))
    winner = select(study).winner
    if winner is not None and climbed.target is not None and winner.number != climbed.target.number:
        console.print(f"[yellow]the winner is now trial {winner.number}[/yellow]")


def _ranks(nproc: int | None, gpus: int | None, hardware: Hardware) -> int:
    """Processes per trial: --gpus N on CUDA, --nproc N on the CPU."""
    if gpus is not None and hardware.backend != "cuda":
        raise UserError("--gpus needs the cuda backend; on the CPU use --nproc N")
    if nproc is not None and hardware.backend == "cuda":
        raise UserError("--nproc is for CPU trials; on CUDA use --gpus N")
    if gpus is not None and gpus > hardware.gpu_count:
        raise UserError(f"--gpus {gpus}: only {hardware.gpu_count} CUDA GPU(s) visible here")
    return gpus or nproc or 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@main.command()
@click.option("--study", "study_name", required=True)
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=0),
    default=12,
    show_default=True,
    help="0 with --ladder: only the ladder.",
)
@storage_option
@trial_timeout_option
@timeout_option
@click.option("--ladder", is_flag=True, help="Then measure the missing rungs of the ladder.")
@click.option("--table", is_flag=True, help="Print every trial's row before the answer.")
def resume(
    study_name: str,
    n_trials: int,
    storage: str,
    trial_timeout: float,
    timeout: float | None,
    ladder: bool,
    table: bool,
) -> None:
    """Continue a study by name with its stored settings."""
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    settings = settings_of(study)
    console.print(f"resuming study '{study_name}': {len(study.trials)} trials so far")
    if n_trials:
        _optimize(
            study,
            SearchSpace.from_dict(settings.space, "study"),
            n_trials,
            timeout,
            trial_timeout,
            storage,
        )
    _report(study, storage, table=table)
    if ladder:
        _climb(study, trial_timeout, storage)


@main.command()
@click.option("--study", "study_name", required=True)
@storage_option
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    default=12,
    show_default=True,
    help="Trials this worker runs (the study's total is the sum over its workers).",
)
@trial_timeout_option
@timeout_option
def worker(
    study_name: str, storage: str, n_trials: int, trial_timeout: float, timeout: float | None
) -> None:
    """Draw trials from an existing study; run one per machine, or several, at once.

    Every worker runs its trials on its own machine's devices and records them in the shared
    storage (PostgreSQL across machines; SQLite for workers on one machine).
    """
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    settings = settings_of(study)
    if settings.backend == "cuda" and not _cuda_available():
        raise UserError(
            f"study '{study_name}' measures on CUDA GPUs and this machine has no CUDA GPU "
            "visible: run its workers where the GPUs are"
        )
    console.print(
        f"worker {os.getpid()} on study '{study_name}': {len(study.trials)} trials so far, "
        f"running {n_trials}"
    )
    _optimize(
        study,
        SearchSpace.from_dict(settings.space, "study"),
        n_trials,
        timeout,
        trial_timeout,
        storage,
        worker=True,
    )
    _report(study, storage, table=False)


@main.command()
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the trials and winner as JSON.")
def show(study_name: str | None, storage: str, as_json: bool) -> None:
    """Print the trials table and the winner from the database alone."""
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    if as_json:
        click.echo(json.dumps(selection_json(study), indent=2))
        return
    _report(study, storage)


@main.command()
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("autotune_report"),
    show_default=True,
    help="Folder for pareto.png, memory.png, report.md and report.html.",
)
def report(study_name: str | None, storage: str, out: Path) -> None:
    """Write the Pareto plot, the memory breakdown and the ablation ladder (runs nothing)."""
    from autotune.report import write_report  # matplotlib: only for this command

    study = load_existing(open_storage(storage, must_exist=True), study_name)
    if not out.parent.exists():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    written = write_report(study, out)
    console.print(ladder_table(ladder_cells(written.ladder), written.ladder.budget_bytes))
    if not written.ladder.complete and written.ladder.target is not None:
        console.print(
            f"[yellow]{len(written.ladder.missing)} ladder configuration(s) not measured; "
            f"run them with[/yellow] autotune resume --study {study.study_name} --trials 0 --ladder"
        )
    for path in (written.pareto_png, written.memory_png, written.markdown, written.html):
        if path is not None:
            console.print(f"wrote {path}")


@main.command("export")
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option("--format", "fmt", required=True, help=f"One of: {', '.join(EXPORTERS)}.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
def export_cmd(study_name: str | None, storage: str, fmt: str, out: Path) -> None:
    """Write the winner as a DeepSpeed, Hugging Face or accelerate config."""
    if fmt not in EXPORTERS:
        raise UserError(f"unknown export format '{fmt}' (known: {', '.join(EXPORTERS)})")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    sel = select(study)
    if sel.winner is None:
        raise UserError(
            f"study '{study.study_name}' has no trial that fits {format_size(sel.budget_bytes)}"
            " yet: nothing to export"
        )
    settings = settings_of(study)
    path = export(fmt, sel.winner.config, settings, out)
    console.print(f"wrote {fmt} config of trial {sel.winner.number} to {path}")
    if settings.backend == "estimate":
        gpu = gpu_spec(settings.target_gpu).name
        console.print(f"[yellow]predicted for {gpu}, not measured[/yellow]: run it there first")


main.add_command(estimate_cmd)


if __name__ == "__main__":
    main()
