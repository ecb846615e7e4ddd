"""The loop that runs a study's trials (``run``, ``resume``, ``worker``, the ladder): the
runner of the study's launcher, the objective, the search, stops by Ctrl-C or SIGTERM as one
line and exit code 130, storage faults as one line and exit code 1, the finalists."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import optuna

from autotune.backends import backend_named
from autotune.commands.output import console, resume_hint
from autotune.data_source import moved_to
from autotune.data_source import ready as data_ready
from autotune.display import ladder_table
from autotune.errors import EnvironmentFailure
from autotune.estimate_backend import runner_for
from autotune.finalists import remeasure
from autotune.ladder import ladder_cells, run_ladder
from autotune.launchers import concurrency, launcher_attrs, make_runner
from autotune.lossguard import Prober, ProbeSettings
from autotune.pending import PENDING_DIR, PendingResults
from autotune.progress import StudyProgress
from autotune.runner import InProcessRunner, SubprocessRunner, TrialRunner
from autotune.selector import select
from autotune.space import SearchSpace
from autotune.storage import open_storage
from autotune.study import (
    Objective,
    ResultNotStored,
    StudySettings,
    TrialCrashed,
    ensure_reference,
    fail_running_trials,
    load_existing,
    make_sampler,
    settings_of,
    storage_errors,
    workdir_for,
    write_error_reason,
)
from autotune.trial_cost import study_costs


def optimize(
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
    data_ready(
        settings.data, study.study_name, backend_named(settings.backend).measures, console.print
    )
    launched = make_runner(settings.launcher, workdir_for(study), trial_timeout)
    runner = runner_for(settings, launched)
    objective = Objective(
        study,
        space,
        runner,
        *_prober(settings, launched),
        pending=PendingResults(workdir_for(study) / PENDING_DIR),
        costs=study_costs(settings, trial_timeout, settings.trial_timeout_floor_s)
        if backend_named(settings.backend).measures
        else None,
    )
    # measurements an earlier controller kept on disk (its storage failed, it was stopped)
    for number, where in objective.replay_pending():
        kept_as = "" if where == number else f" as trial {where}"
        console.print(f"stored the kept measurement of trial #{number}{kept_as}", markup=False)
    # jobs a previous controller left running (Slurm's) are collected into their trials
    adopted = launched.adopt(
        study,
        lambda: open_storage(storage_url),
        lambda: Objective(study, space, runner, *_prober(settings, launched)),
        TrialCrashed,
    )
    for number in adopted.numbers:
        console.print(f"collecting trial #{number}: {adopted.why}")
    # workers draw trials; queueing the reference is the job of run/resume. Predictions have
    # no loss curve, so an estimate study has no reference and no loss guard.
    if not worker and backend_named(settings.backend).measures:
        ensure_reference(study, space)
    study.sampler = make_sampler(
        study, settings.seed, salt=os.getpid() if worker else 0, space=space, strategy=strategy
    )
    # a line per finished trial and per long phase, in a terminal (above a bar) or not
    with StudyProgress(study, console, n_trials).running() as progress:
        objective.say = progress.say
        if objective.prober is not None:
            objective.prober.say = progress.say
        try:
            with _terminate_as_interrupt(launched.stopping):
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
    if confirm and not worker and backend_named(settings.backend).measures:
        _confirm_finalists(study, launched, storage_url, progress.say)
    if not worker and backend_named(settings.backend).measures:
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
    backend = backend_named(settings.backend)
    if settings.probe_steps <= 0:
        why = "probes are off" if backend.measures else "predicted study"
        return None, f"{why} (--probe-steps N trains a proxy)"
    probe = ProbeSettings(
        steps=settings.probe_steps,
        seeds=settings.probe_seeds,
        lr=settings.lr,
        backend=backend.device,
        data=settings.data,
        seq_len=settings.seq_len,
    )
    # a local CPU study trains its probes in this process: a probe's proxy trains in seconds,
    # a job process would spend most of its time importing torch and transformers
    local_cpu = type(real) is SubprocessRunner and backend.measures and not backend.cuda
    runner = InProcessRunner() if local_cpu else real
    return Prober(settings.model_config, probe, runner, settings.weights), ""


def _confirm_finalists(
    study: optuna.Study,
    runner: TrialRunner,
    storage_url: str,
    say: Callable[[str], None] | None = None,
) -> None:
    """Re-measure side by side, interleaved, the fastest configurations of each class."""
    try:
        with _terminate_as_interrupt(runner.stopping):
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


def climb(study: optuna.Study, trial_timeout: float, storage_url: str) -> None:
    """Run the ladder's missing rungs into the study, then print the ladder."""
    space = SearchSpace.from_dict(settings_of(study).space, "study")

    def rungs(n: int) -> None:
        console.print(f"ablation ladder: measuring {n} configuration(s)")
        optimize(study, space, n, None, trial_timeout, storage_url, confirm=False)

    climbed = run_ladder(study, space, rungs)
    console.print(ladder_table(ladder_cells(climbed), climbed.budget_bytes))
    winner = select(study).winner
    if winner is not None and climbed.target is not None and winner.number != climbed.target.number:
        console.print(f"[yellow]the winner is now trial {winner.number}[/yellow]")


def reopen(
    storage: str, study_name: str, data: str | None, given: dict[str, Any]
) -> tuple[optuna.Study, StudySettings]:
    """``resume``/``worker``: the stored study, its data where it is now (the same bytes, or
    stop) and its settings with the launcher options given to this command."""
    study = load_existing(open_storage(storage, must_exist=True), study_name)
    follow_data(study, data)
    data_ready(settings_of(study).data, study_name, needs_file=False)
    return study, relaunch(study, given)


def follow_data(study: optuna.Study, source: str | None) -> None:
    """``--data`` of ``resume``/``worker``: the study's dataset at its new place (the same
    bytes), stored with the study; other bytes are one line, nothing written."""
    if source is None:
        return
    settings = settings_of(study)
    settings.data = moved_to(settings.data, source, study.study_name)
    study.set_user_attr("settings", settings.to_attrs())


def relaunch(study: optuna.Study, given: dict[str, Any]) -> StudySettings:
    """The study's settings with its launcher changed by the options given to this command."""
    settings = settings_of(study)
    backend = backend_named(settings.backend)
    if not backend.measures:  # predictions run in this process, through no launcher
        return settings
    gpus = backend.gpus_per_node(settings.nproc, settings.nodes)
    stored = settings.launcher or {"name": "local"}  # studies made before launchers existed
    settings.launcher = launcher_attrs(stored, given, gpus_per_node=gpus)
    if settings.launcher != stored:
        study.set_user_attr("settings", settings.to_attrs())
    return settings
