"""The ``autotune`` command line: run, resume, show, export."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import optuna
from click.core import ParameterSource
from rich.markup import escape

from autotune.display import (
    certainty_line,
    commands_grid,
    ladder_table,
    print_answer,
    print_failures,
    results_table,
)
from autotune.errors import EnvironmentFailure, OneLineGroup, UserError
from autotune.estimate_backend import (
    estimate_space,
    hardware_for,
    machine_memory,
    queue_class_bests,
    runner_for,
    target_gpu,
)
from autotune.estimate_cli import MAX_BATCH, MAX_SEQ_LEN, banner, confirm_winner, estimate_cmd
from autotune.estimator.exhaustive import ClassBest
from autotune.estimator.gpus import gpu_spec
from autotune.export import EXPORTERS, UserSettings, export, measured_on
from autotune.finalists import remeasure
from autotune.hardware import Hardware
from autotune.ladder import ladder_cells, run_ladder
from autotune.launchers import (
    Adoption,
    SlurmRunner,
    adopt,
    concurrency,
    launcher_attrs,
    launcher_options,
    make_runner,
)
from autotune.lossguard import Prober, ProbeSettings
from autotune.masking import mask_url, url_secrets
from autotune.models import check_seq_len, resolve_model
from autotune.pending import PENDING_DIR, PendingResults
from autotune.progress import StudyProgress
from autotune.runner import InProcessRunner, SubprocessRunner, TrialRunner
from autotune.safe_files import database_files, write_folder
from autotune.selector import CONTENDERS_ATTR, select, selection_json
from autotune.space import SearchSpace
from autotune.storage import open_storage
from autotune.study import (
    DEFAULT_ALLOW,
    DEFAULT_STORAGE,
    GIVEN_OPTIONS,
    STRATEGIES,
    Objective,
    ResultNotStored,
    StudySettings,
    TrialCrashed,
    create_or_load,
    ensure_reference,
    fail_running_trials,
    load_existing,
    make_sampler,
    settings_of,
    storage_errors,
    workdir_for,
    write_error_reason,
)
from autotune.terminal import make_console, printable, shell_line
from autotune.trial_cost import TIMEOUT_FLOOR_S, study_costs
from autotune.units import budget_label, format_size, parse_size
from trials.data import Documents
from trials.techniques import FIDELITY_CLASSES, classes_up_to
from trials.techniques.zero import runs_deepspeed

#: Real CPU trials build the model in this machine's memory; beyond this they can't run here.
MAX_CPU_TRIAL_PARAMS = 500_000_000

console = make_console()
err_console = make_console(stderr=True)
#: a study name is a folder name for its trial jobs (255 bytes at most) and Optuna keeps 512
MAX_STUDY_NAME = 200
#: in a report folder: the files ``report`` wrote there (it replaces only those without --force)
REPORT_MANIFEST = ".autotune-report.json"
#: numpy's and torch's seeds are 32-bit
MAX_SEED = 2**32 - 1


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
    confirm: bool = True,
) -> None:
    """Run ``n_trials`` of the study; then, with ``confirm`` (``run``/``resume``, not workers,
    ladder rungs or collecting Slurm jobs), re-measure the finalists."""
    settings = settings_of(study)
    launched = make_runner(settings.launcher, workdir_for(study), trial_timeout)
    runner = runner_for(settings, launched)
    objective = Objective(
        study,
        space,
        runner,
        *_prober(settings, launched),
        pending=PendingResults(workdir_for(study) / PENDING_DIR),
        costs=None
        if settings.backend == "estimate"
        else study_costs(settings, trial_timeout, settings.trial_timeout_floor_s),
    )
    # measurements an earlier controller kept on disk (its storage failed, it was stopped)
    for number, where in objective.replay_pending():
        kept_as = "" if where == number else f" as trial {where}"
        console.print(f"stored the kept measurement of trial #{number}{kept_as}", markup=False)
    # Slurm jobs a previous controller left running are collected into their trials
    adopted = (
        adopt(
            study,
            open_storage(storage_url),
            Objective(study, space, runner, *_prober(settings, launched)),
            TrialCrashed,
        )
        if isinstance(launched, SlurmRunner)
        else Adoption()
    )
    for number in adopted.numbers:
        console.print(f"collecting trial #{number}: its Slurm job is still known to the cluster")
    # workers draw trials; queueing the reference is the job of run/resume. Predictions have
    # no loss curve, so an estimate study has no reference and no loss guard.
    if not worker and settings.backend != "estimate":
        ensure_reference(study, space)
    study.sampler = make_sampler(
        study, settings.seed, salt=os.getpid() if worker else 0, space=space, strategy=strategy
    )
    # a line per finished trial and per long phase, in a terminal (above a bar) or not
    with StudyProgress(study, console, n_trials).running() as progress:
        objective.say = progress.say
        if objective.prober is not None:
            objective.prober.say = progress.say
        stopping = launched.stopping if isinstance(launched, SlurmRunner) else None
        try:
            with _terminate_as_interrupt(stopping):
                if n_trials:
                    _optimize_loop(
                        study, objective, n_trials, timeout, settings.launcher, progress.callback
                    )
                adopted.join()
        except Exception as exc:
            fault = _storage_fault(exc)
            if fault is None:
                raise
            progress.stop()
            # the machine's fault (a full disk, a lost database), not the input's: exit 1
            fate = fail_running_trials(study, objective.started)
            raise EnvironmentFailure(
                f"{_one_line(fault, objective)}; {fate}"
                f"{_kept_note(objective, study.study_name, storage_url)}"
            ) from None
        except KeyboardInterrupt:
            progress.stop()
            # plain echo, not rich: the command must stay one line, exactly as printed
            click.echo(
                "interrupted; the running trial was stopped and marked failed. Resume with"
                f"{resume_hint(study.study_name, storage_url)}",
                err=True,
            )
            sys.exit(130)
        if objective.interrupted:
            progress.stop()
            click.echo(
                f"interrupted ({objective.interrupted}) while a loss probe ran; the trial's "
                "measurement is stored, its loss not judged. Resume with"
                f"{resume_hint(study.study_name, storage_url)}",
                err=True,
            )
            sys.exit(130)
    if confirm and not worker and settings.backend != "estimate":
        _confirm_finalists(study, launched, storage_url, progress.say)
    if not worker and settings.backend != "estimate":
        from autotune.strategy import record_contenders  # numpy: only after a search

        record_contenders(study)  # the answer's certainty line (strategy.contenders)


def _optimize_loop(
    study: optuna.Study,
    objective: Objective,
    n_trials: int,
    timeout: float | None,
    launcher: dict[str, Any],
    on_trial: Callable[[optuna.Study, optuna.trial.FrozenTrial], None],
) -> None:
    """``study.optimize``, going on after a trial that another worker took over while this
    controller was paused (Optuna raises on telling it; its measurement is already stored as a
    new trial, ``Objective.rescue``)."""
    start = time.monotonic()
    while True:
        left = None if timeout is None else timeout - (time.monotonic() - start)
        n = n_trials - len(objective.started)
        if n <= 0 or (left is not None and left <= 0):
            return
        seen = len(objective.taken_over)
        try:
            study.optimize(
                objective,
                n_trials=n,
                timeout=left,
                catch=(TrialCrashed,),
                n_jobs=concurrency(launcher),
                callbacks=[objective.after_trial, on_trial],
            )
            return
        except Exception as exc:
            if _storage_fault(exc) is not None:
                raise
            objective.rescue()
            if len(objective.taken_over) == seen:
                raise
            for taken in objective.taken_over[seen:]:
                console.print(f"{taken}; going on", style="yellow", markup=False)


def _storage_fault(exc: BaseException) -> BaseException | None:
    """The storage error behind ``exc``: Optuna, failing to tell a trial, may raise another
    error from its own clean-up (an ``UnboundLocalError``, ``AssertionError: Should not
    reach.``) with the storage's error as its context."""
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        if isinstance(inner, (ResultNotStored, *storage_errors())):
            return inner
        inner = inner.__cause__ or inner.__context__
    return None


def _kept_numbers(objective: Objective) -> list[str]:
    return [path.stem.split("-")[1] for path in objective.kept()]


def _kept_note(objective: Objective, study_name: str, storage_url: str) -> str:
    kept = objective.kept()
    if not kept:
        return ""
    return (
        f"; the measurement of trial {', '.join(_kept_numbers(objective))} is kept in "
        f"{kept[0].parent} and stored by the next run of this study here, e.g."
        f"{resume_hint(study_name, storage_url, '--trials', '0')}"
    )


def _prober(settings: StudySettings, real: TrialRunner) -> tuple[Prober | None, str]:
    """The loss probe of lossy numerics (autotune/lossguard.py), or None and why not."""
    if settings.probe_steps <= 0:
        why = "predicted study" if settings.backend == "estimate" else "probes are off"
        return None, f"{why} (--probe-steps N trains a proxy)"
    probe = ProbeSettings(
        steps=settings.probe_steps,
        seeds=settings.probe_seeds,
        lr=settings.lr,
        backend="cuda" if settings.backend == "cuda" else "cpu",
    )
    # a local CPU study trains its probes in this process: a probe's proxy trains in seconds,
    # a job process would spend most of its time importing torch and transformers
    local_cpu = type(real) is SubprocessRunner and settings.backend == "cpu"
    return Prober(settings.model_config, probe, InProcessRunner() if local_cpu else real), ""


def _confirm_finalists(
    study: optuna.Study,
    runner: TrialRunner,
    storage_url: str,
    say: Callable[[str], None] | None = None,
) -> None:
    """Re-measure side by side, interleaved, the fastest configurations of each class."""
    stopping = runner.stopping if isinstance(runner, SlurmRunner) else None
    try:
        with _terminate_as_interrupt(stopping):
            ran = remeasure(study, runner, settings_of(study).confirm_rounds, say)
    except KeyboardInterrupt:
        click.echo(
            "interrupted while re-measuring the finalists. Resume with"
            f"{resume_hint(study.study_name, storage_url)}",
            err=True,
        )
        sys.exit(130)
    if ran:
        console.print(f"re-measured the fastest configurations side by side: {ran} runs")


def _one_line(exc: BaseException, objective: Objective | None = None) -> str:
    """A write error of the optimize loop in words: the result, a trial folder, the storage."""
    if isinstance(exc, ResultNotStored):
        return str(exc)
    kept = _kept_numbers(objective) if objective is not None else []
    if kept and not isinstance(exc, OSError):
        return f"could not store trial {', '.join(kept)}'s result: {write_error_reason(exc)}"
    if isinstance(exc, OSError):  # a trial folder or file (a full disk, a read-only folder)
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot write{where}: {exc.strerror or exc}"
    return f"could not write to the study's storage: {write_error_reason(exc)}"


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


class Interrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` that names its signal (``SIGTERM``, or ``Ctrl-C`` for SIGINT),
    for the reason stored on the trial it stopped (``autotune.study.interrupt_name``)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextlib.contextmanager
def _terminate_as_interrupt(stopping: threading.Event | None = None) -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler's stop) ends trials as cleanly as Ctrl-C does; both set
    ``stopping``, which tells trials waiting in other threads (Slurm jobs) to cancel theirs."""

    def interrupt(signum: int, frame: object) -> None:
        if stopping is not None:
            stopping.set()
        raise Interrupted(signal.Signals(signum).name if signum != signal.SIGINT else "Ctrl-C")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    previous_int = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _report(
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
    if settings.backend == "estimate":
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


@main.command()
@click.option("--model", required=True, help="Registered model name or a path to a config.json.")
@click.option("--budget", required=True, help="Memory budget per device, e.g. 24GB, 24GiB, 300MB.")
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    default=None,
    help="Default 12 (--backend estimate: every configuration is scored and the best of each "
    "fidelity class recorded as a trial).",
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
    type=FiniteFloat(min=0.0, max=10.0),
    default=0.02,
    show_default=True,
    help="Allowed relative loss regression of lossy techniques vs the reference.",
)
@click.option(
    "--allow",
    type=click.Choice(FIDELITY_CLASSES),
    default=DEFAULT_ALLOW,
    show_default=True,
    help="The widest fidelity class searched, in order exact < mixed < reduced_state < "
    "other_optimizer < adapters: `exact` searches only exact techniques, `mixed` adds 16-bit "
    "compute, `adapters` adds LoRA/QLoRA.",
)
@click.option(
    "--probe-steps",
    type=click.IntRange(min=0),
    default=None,
    help="Steps of the loss probe that judges lossy numerics on a small proxy of the model "
    "(default 200; --backend estimate: 0, no probes).",
)
@click.option(
    "--confirm-rounds",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Rounds of side-by-side re-measurement of each class's fastest configurations before "
    "a winner is named; 0: none.",
)
@click.option(
    "--probe-seeds",
    type=click.IntRange(min=2),
    default=2,
    show_default=True,
    help="Seeds per probe: their spread is the noise band shown with each verdict.",
)
@trial_timeout_option
@click.option(
    "--trial-timeout-floor",
    type=FiniteFloat(min=1.0),
    default=TIMEOUT_FLOOR_S,
    show_default=True,
    help="The least seconds a trial job gets before it is killed (its start: imports, model "
    "build), whatever its predicted steps take.",
)
@timeout_option
@click.option("--seq-len", type=click.IntRange(min=8, max=MAX_SEQ_LEN), default=None)
@click.option("--global-batch-size", type=click.IntRange(min=1, max=MAX_BATCH), default=None)
@click.option(
    "--documents",
    default=None,
    metavar="MIN:MAX",
    help="Train on variable-length documents of MIN to MAX tokens (as fine-tuning data), "
    "padded or packed (the packing dimension); default: every sequence --seq-len tokens.",
)
@click.option("--seed", type=click.IntRange(min=0, max=MAX_SEED), default=0, show_default=True)
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
    type=click.IntRange(min=1, max=1024),
    default=None,
    help="CPU: run each trial as N processes (torchrun, gloo); the budget is per process.",
)
@click.option("--table", is_flag=True, help="Print every trial's row before the answer.")
@click.option(
    "--gpus",
    type=click.IntRange(min=1, max=1024),
    default=None,
    help="CUDA: run each trial on N GPUs (torchrun, nccl); the budget is per GPU.",
)
@click.option(
    "--nodes",
    type=click.IntRange(min=1, max=1024),
    default=1,
    show_default=True,
    help="Nodes each trial spans (torchrun agents meeting through c10d rendezvous); with "
    "--gpus-per-node (CUDA, estimate) or --nproc-per-node (CPU).",
)
@click.option("--gpus-per-node", type=click.IntRange(min=1, max=1024), default=None)
@click.option("--nproc-per-node", type=click.IntRange(min=1, max=1024), default=None)
@launcher_options
@click.option(
    "--host-memory",
    default=None,
    help="Host RAM a trial may use on each machine, e.g. 128GB (default: this machine's "
    "memory; --backend estimate or --launcher slurm: unlimited, always shown).",
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
    allow: str,
    probe_steps: int | None,
    confirm_rounds: int,
    probe_seeds: int,
    trial_timeout: float,
    trial_timeout_floor: float,
    timeout: float | None,
    seq_len: int | None,
    global_batch_size: int | None,
    documents: str | None,
    seed: int,
    strategy: str,
    ladder: bool,
    nproc: int | None,
    gpus: int | None,
    nodes: int,
    gpus_per_node: int | None,
    nproc_per_node: int | None,
    launcher: str | None,
    partition: str | None,
    account: str | None,
    slurm_time: str | None,
    in_flight: int | None,
    sbatch_options: tuple[str, ...],
    table: bool,
    host_memory: str | None,
) -> None:
    """Run (or continue) a study of real training trials (or of predictions, without a GPU)."""
    budget_bytes = parse_size(budget)
    if study_name is not None:
        _check_study_name(study_name)
    host_limit = parse_size(host_memory) if host_memory else None
    entry = resolve_model(model)
    check_seq_len(seq_len, entry.config, entry.name)
    docs = _documents(documents, seq_len or entry.seq_len)
    space = SearchSpace.load(space_path)
    hardware = Hardware.detect(None if backend in ("auto", "estimate") else backend)
    if hardware.backend == "cuda" and not _cuda_available():
        if launcher != "slurm" or gpu is None:
            raise UserError(
                "--backend cuda: no CUDA GPU is visible to torch here"
                + ("; with --launcher slurm name the nodes' GPU with --gpu" if launcher else "")
            )
        hardware = hardware_for(gpu_spec(gpu), gpus_per_node or gpus or 1)
    gpu_target = None
    if backend == "estimate" or (
        backend == "auto" and hardware.backend == "cpu" and entry.n_params > MAX_CPU_TRIAL_PARAMS
    ):
        gpu_target = target_gpu(gpu, budget_bytes)
        if backend == "auto":
            console.print(
                f"[bold yellow]{escape(banner(entry.name, entry.n_params, gpu_target))}[/]"
            )
        if space_path is None:
            space = estimate_space()
        hardware = hardware_for(gpu_target, gpus_per_node or gpus or 1)
    elif hardware.backend == "cpu" and entry.n_params > MAX_CPU_TRIAL_PARAMS:
        raise UserError(
            f"{entry.name} has {entry.n_params / 1e9:.1f}B parameters: too big for real CPU "
            "trials on this machine; use a GPU (--backend cuda), --backend estimate, or a "
            "small model"
        )
    if (
        gpu is not None
        and gpu_target is None
        and not (hardware.backend == "cuda" and launcher == "slurm")
    ):
        raise UserError(
            f"--gpu {printable(gpu)} names the GPU that --backend estimate predicts for (or the "
            f"Slurm nodes' GPU); these trials run on this machine's {hardware.backend.upper()}"
            ", which --gpu does not change: drop --gpu, or add --backend estimate"
        )
    per_node = _per_node(nodes, nproc, gpus, nproc_per_node, gpus_per_node, hardware, gpu_target)
    launcher_settings = (
        {"name": "local"}
        if gpu_target
        else launcher_attrs(
            {},
            launcher,
            partition,
            account,
            slurm_time,
            in_flight,
            sbatch_options,
            gpus_per_node=per_node if hardware.backend == "cuda" else 0,
        )
    )
    if (
        gpu_target is None
        and nodes > 1
        and hardware.backend == "cuda"
        and (launcher_settings["name"] == "local")
    ):
        raise UserError(
            f"--nodes {nodes} on CUDA: nodes are the cluster's; use --launcher slurm "
            "(the local launcher simulates nodes with CPU processes only)"
        )
    ranks = nodes * per_node
    gbs = global_batch_size or entry.global_batch_size
    resolved = space.resolve(gbs, hardware, classes_up_to(allow), documents=docs is not None)
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
        allow=allow,
        probe_steps=probe_steps if probe_steps is not None else (0 if gpu_target else 200),
        probe_seeds=probe_seeds,
        confirm_rounds=confirm_rounds,
        trial_timeout_floor_s=trial_timeout_floor,
        nodes=nodes,
        documents=docs.stored() if docs else None,
        launcher=launcher_settings,
        # default: this machine's memory; unlimited for predictions and for Slurm jobs (the
        # nodes' memory is not this login node's: --host-memory gives it)
        host_budget_bytes=host_limit
        or (0 if gpu_target or launcher_settings["name"] == "slurm" else machine_memory()),
    )
    name = study_name or settings.default_study_name()
    _check_study_name(name)
    ctx = click.get_current_context()
    given = {
        key
        for key, option in (
            ("loss_tolerance", "loss_tolerance"),
            ("seed", "seed"),
            ("target_gpu", "gpu"),
        )
        if ctx.get_parameter_source(option) not in (ParameterSource.DEFAULT, None)
    }
    assert given <= GIVEN_OPTIONS.keys()
    study = create_or_load(open_storage(storage), name, settings, given)
    where = f"on {gpu_target.name}" if gpu_target else "here"
    for line in resolved.dropped:
        console.print(f"unavailable {where}: {line}", style="dim", markup=False)
    per_class = None
    if gpu_target is not None:  # every configuration scored; each class's best is a trial
        per_class, queued = queue_class_bests(study, console)
        n_trials = max(n_trials or 0, queued)
    n_trials = n_trials or 12
    console.print(
        f"study '{name}': {entry.name} ({entry.n_params / 1e6:,.1f}M params), budget "
        f"{format_size(budget_bytes)}, backend {settings.backend}, "
        f"{len(study.trials)} trials so far, running {n_trials} more",
        markup=False,
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
    _report(study, storage, table=table, per_class=per_class)
    if ladder:
        _climb(study, trial_timeout, storage)


def _check_study_name(name: str) -> None:
    if not name.strip():
        raise UserError("--study-name is empty: give a name, or leave the option out")
    if len(name) > MAX_STUDY_NAME:
        raise UserError(
            f"--study-name is {len(name)} characters long; use at most {MAX_STUDY_NAME}"
        )
    if not name.isprintable():
        raise UserError(
            f"--study-name {printable(name)!r} holds control characters (a newline?); "
            "use printable characters"
        )


def _documents(text: str | None, seq_len: int) -> Documents | None:
    """``--documents MIN:MAX``, within the sequence length."""
    if text is None:
        return None
    try:
        docs = Documents.parse(text)
    except ValueError as exc:
        raise UserError(f"--documents: {exc}") from None
    if docs.longest > MAX_SEQ_LEN:
        raise UserError(f"--documents {printable(text)}: documents of more than "
                        f"{MAX_SEQ_LEN:,} tokens (docs/guide/limits.md)")  # fmt: skip
    if docs.shortest > seq_len:
        raise UserError(
            f"--documents {text}: the shortest document is longer than the sequence ({seq_len})"
        )
    return docs


def _climb(study: optuna.Study, trial_timeout: float, storage_url: str) -> None:
    """Run the ladder's missing rungs into the study, then print the ladder."""
    space = SearchSpace.from_dict(settings_of(study).space, "study")

    def optimize(n: int) -> None:
        console.print(f"ablation ladder: measuring {n} configuration(s)")
        _optimize(study, space, n, None, trial_timeout, storage_url, confirm=False)

    climbed = run_ladder(study, space, optimize)
    console.print(ladder_table(ladder_cells(climbed), climbed.budget_bytes))
    winner = select(study).winner
    if winner is not None and climbed.target is not None and winner.number != climbed.target.number:
        console.print(f"[yellow]the winner is now trial {winner.number}[/yellow]")


def _per_node(
    nodes: int,
    nproc: int | None,
    gpus: int | None,
    nproc_per_node: int | None,
    gpus_per_node: int | None,
    hardware: Hardware,
    gpu_target: Any,
) -> int:
    """Ranks on each node: --gpus-per-node (CUDA, estimate) or --nproc-per-node (CPU); with one
    node, --gpus N / --nproc N say the same."""
    for one, per in (("--gpus", gpus), ("--nproc", nproc)):
        if per is not None and nodes > 1:
            raise UserError(f"{one} is for one node; with --nodes {nodes} use {one}-per-node")
    if gpu_target is not None:  # the estimate backend: GPUs of the target machine
        if nproc_per_node is not None or nproc is not None:
            raise UserError("--nproc/--nproc-per-node are for CPU trials; the estimate backend "
                            "plans GPUs: use --gpus-per-node")  # fmt: skip
        return gpus_per_node or gpus or 1
    if gpus_per_node is not None and hardware.backend != "cuda":
        raise UserError("--gpus-per-node needs the cuda backend; on the CPU use --nproc-per-node")
    if nproc_per_node is not None and hardware.backend == "cuda":
        raise UserError("--nproc-per-node is for CPU trials; on CUDA use --gpus-per-node")
    per = gpus_per_node or nproc_per_node
    if nodes > 1 and per is None:
        raise UserError(f"--nodes {nodes}: say how many ranks each node runs with "
                        "--gpus-per-node G (CUDA) or --nproc-per-node P (CPU)")  # fmt: skip
    if per is not None and (gpus is not None or nproc is not None):
        raise UserError("give either --gpus/--nproc or --nodes with --gpus-per-node/"
                        "--nproc-per-node, not both")  # fmt: skip
    if per is not None:
        return per
    return _ranks(nproc, gpus, hardware)


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
@launcher_options
@click.option("--table", is_flag=True, help="Print every trial's row before the answer.")
def resume(
    study_name: str,
    n_trials: int,
    storage: str,
    trial_timeout: float,
    timeout: float | None,
    ladder: bool,
    table: bool,
    **launcher: Any,
) -> None:
    """Continue a study by name with its stored settings (and its launcher, unless given).

    Slurm jobs that a stopped controller left queued or running are collected into their
    trials (``--trials 0``: only that)."""
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    settings = _relaunch(study, launcher)
    console.print(f"resuming study '{study_name}': {len(study.trials)} trials so far", markup=False)
    # measurements an earlier run kept (``autotune.pending``) are stored by ``_optimize``
    kept = any((workdir_for(study) / PENDING_DIR).glob("trial-*.json"))
    if n_trials or kept or settings.launcher.get("name") == "slurm":
        _optimize(
            study,
            SearchSpace.from_dict(settings.space, "study"),
            n_trials,
            timeout,
            trial_timeout,
            storage,
            confirm=n_trials > 0,  # --trials 0 only collects what earlier runs left
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
@launcher_options
def worker(
    study_name: str,
    storage: str,
    n_trials: int,
    trial_timeout: float,
    timeout: float | None,
    **launcher: Any,
) -> None:
    """Draw trials from an existing study; run one per machine, or several, at once.

    Every worker runs its trials on its own machine's devices and records them in the shared
    storage (PostgreSQL across machines; SQLite for workers on one machine).
    """
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    settings = _relaunch(study, launcher)
    if (
        settings.backend == "cuda"
        and settings.launcher.get("name") != "slurm"
        and not (_cuda_available())
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


def _relaunch(study: optuna.Study, given: dict[str, Any]) -> StudySettings:
    """The study's settings with its launcher changed by the options given to this command."""
    settings = settings_of(study)
    if settings.backend == "estimate":
        return settings
    gpus = settings.nproc // settings.nodes if settings.backend == "cuda" else 0
    stored = settings.launcher or {"name": "local"}  # studies made before launchers existed
    settings.launcher = launcher_attrs(stored, gpus_per_node=gpus, **given)
    if settings.launcher != stored:
        study.set_user_attr("settings", settings.to_attrs())
    return settings


@main.command()
@click.option("--study", "study_name", default=None, help="Default: the most recent study.")
@storage_option
@click.option("--json", "as_json", is_flag=True, help="Print the trials and winner as JSON.")
def show(study_name: str | None, storage: str, as_json: bool) -> None:
    """Print the trials table and the winner from the database alone."""
    study = load_existing(open_storage(storage, read_only=True), study_name)
    if as_json:
        # strict JSON: a non-finite number (an inf loss regression) is null, not Infinity
        click.echo(json.dumps(_finite(selection_json(study)), indent=2, allow_nan=False))
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
@force_option
def report(study_name: str | None, storage: str, out: Path, force: bool) -> None:
    """Write the Pareto plot, the memory breakdown and the ablation ladder (runs nothing)."""
    from autotune.report import write_report  # matplotlib: only for this command

    if not out.parent.exists():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    study = load_existing(open_storage(storage, read_only=True), study_name)
    with _writing(out):
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


@main.command("export")
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
    with _writing(out):
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
    if settings.backend == "cpu":
        console.print(measured_on(settings), style="yellow", markup=False)
    if settings.backend == "estimate":
        gpu = gpu_spec(settings.target_gpu).name
        console.print(f"[yellow]predicted for {gpu}, not measured[/yellow]: run it there first")


def _finite(value: Any) -> Any:
    """``value`` with every nan/inf float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


#: the machine's fault, not the input's: exit code 1
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """An OSError while writing ``out`` (or a file beside it) as one line."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or out
        if exc.errno in _ENVIRONMENT_ERRNOS:
            raise EnvironmentFailure(f"cannot write {where}: {exc.strerror}") from None
        raise UserError(f"cannot write {where}: {exc.strerror}; choose another --out") from None


main.add_command(estimate_cmd)


if __name__ == "__main__":
    main()
