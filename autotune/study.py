"""The Optuna study: storage, settings kept with the study, the objective, the loss reference.

Objectives: maximise tokens/s, minimise peak memory (MiB). Going over the budget and
regressing the loss are *constraints* (``constraints_func``), so an OOM trial is a completed
trial the sampler learns from, never a FAIL it ignores. Only a crash or a hang of the job is a
FAIL, with its reason stored on the trial.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import UserError
from autotune.runner import TrialRunner
from autotune.space import SearchSpace
from trials.spec import TrialResult, TrialSpec
from trials.techniques import is_exact

DEFAULT_STORAGE = "sqlite:///autotune.db"
#: per-step relative loss difference allowed for exact techniques (float reassociation noise)
EXACT_RTOL = 1e-3
MIB = 2**20


@dataclass
class StudySettings:
    """What defines a study; stored in the study's user attrs and checked when it is reopened."""

    model: str
    model_config: dict[str, Any]
    budget_bytes: int
    budget_label: str
    backend: str
    seq_len: int
    global_batch_size: int
    space: dict[str, Any]
    loss_tolerance: float = 0.02
    warmup_steps: int = 2
    measured_steps: int = 2
    seed: int = 0
    lr: float = 3e-3
    nproc: int = 1
    target_gpu: str = ""  # backend "estimate": the GPU the predictions are for (gpus.GPUS key)
    host_budget_bytes: int = 0  # host RAM a trial may use (--host-memory); 0: unlimited
    #: keys that must match to add trials to an existing study
    identity: tuple[str, ...] = field(
        default=(
            "model",
            "budget_bytes",
            "backend",
            "seq_len",
            "global_batch_size",
            "space",
            "nproc",
        ),
        repr=False,
    )

    def default_study_name(self) -> str:
        ranks = f"-x{self.nproc}" if self.nproc > 1 else ""
        return f"{self.model}-{self.budget_label}-{self.backend}{ranks}"

    def to_attrs(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("identity")
        return d

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> StudySettings:
        known = set(cls.__dataclass_fields__) - {"identity"}
        return cls(**{k: v for k, v in attrs.items() if k in known})

    def spec(self, config: dict[str, Any], budget: int | None) -> TrialSpec:
        return TrialSpec(
            model_config=self.model_config,
            config=config,
            seq_len=self.seq_len,
            global_batch_size=self.global_batch_size,
            budget_bytes=budget,
            backend="cuda" if self.backend == "cuda" else "cpu",
            warmup_steps=self.warmup_steps,
            measured_steps=self.measured_steps,
            seed=self.seed,
            lr=self.lr,
            nproc=self.nproc,
            host_budget_bytes=self.host_budget_bytes or None,
        )


def _settings_attr(study: optuna.Study) -> dict[str, Any] | None:
    return study.user_attrs.get("settings")


#: settings a user may give again for an existing study: refused when they differ from its own
#: (they change how its past trials are judged or what they ran), with the option to omit
GIVEN_OPTIONS = {"loss_tolerance": "--loss-tolerance", "seed": "--seed", "target_gpu": "--gpu"}
#: seconds to wait for the settings of a study another process has just created
SETTINGS_WAIT_S = 10.0


def create_or_load(
    storage: RDBStorage,
    name: str,
    settings: StudySettings,
    given: frozenset[str] | set[str] = frozenset(),
) -> optuna.Study:
    """Open study ``name``, creating it with ``settings``; refuse to mix different settings.

    ``given``: the settings the user typed (not defaults); for an existing study each must
    match what it has (``GIVEN_OPTIONS``), or the line says what it has.
    """
    if name not in {s.study_name for s in storage.get_all_studies()}:
        try:
            study = optuna.create_study(
                study_name=name, storage=storage, directions=["maximize", "minimize"]
            )
        except optuna.exceptions.DuplicatedStudyError:
            pass  # another first run created it a moment ago: join it below, like a rerun
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(["tokens_per_s", "peak_mib"])
            study.set_user_attr("settings", settings.to_attrs())
            return study
    study = optuna.load_study(study_name=name, storage=storage)
    stored = _wait_for_settings(study)
    if stored is None:
        raise UserError(f"study '{name}' was not made by autotune; use another --study-name")
    for key in settings.identity:
        if key in stored and stored[key] != getattr(settings, key):
            what = "another search space" if key == "space" else f"{key}={stored[key]!r}"
            raise UserError(
                f"study '{name}' exists with {what}, not {getattr(settings, key)!r}; "
                "use another --study-name"
                if key != "space"
                else f"study '{name}' exists with {what}; use another --study-name"
            )
    if "model_config" in stored and stored["model_config"] != settings.model_config:
        raise UserError(
            f"study '{name}' was made with another config of model '{settings.model}'; "
            "use another --study-name"
        )
    for key in sorted(given & GIVEN_OPTIONS.keys()):
        if key in stored and stored[key] != getattr(settings, key):
            raise UserError(
                f"study '{name}' has {key}={stored[key]!r}, not {getattr(settings, key)!r} "
                f"({GIVEN_OPTIONS[key]}); omit {GIVEN_OPTIONS[key]} to continue it, or use "
                "another --study-name"
            )
    return study


def _wait_for_settings(study: optuna.Study) -> dict[str, Any] | None:
    """The study's settings; a study created by another process this instant gets its
    settings a moment after it exists (two writes), so wait for them a little."""
    deadline = time.monotonic() + SETTINGS_WAIT_S
    while True:
        stored = _settings_attr(study)
        if stored is not None or study.trials or time.monotonic() > deadline:
            return stored
        time.sleep(0.2)


def load_existing(storage: RDBStorage, name: str | None) -> optuna.Study:
    """An existing study by name; with no name, the only (or most recent) one in the storage."""
    summaries = storage.get_all_studies()
    if not summaries:
        raise UserError("no study in this storage yet: run `autotune run` first")
    if name is None:
        name = max(summaries, key=lambda s: s._study_id).study_name
    elif name not in {s.study_name for s in summaries}:
        known = ", ".join(s.study_name for s in summaries)
        raise UserError(f"no study named '{name}' (studies here: {known})")
    study = optuna.load_study(study_name=name, storage=storage)
    if _settings_attr(study) is None:
        raise UserError(f"study '{name}' was not made by autotune")
    return study


def settings_of(study: optuna.Study) -> StudySettings:
    attrs = _settings_attr(study)
    assert attrs is not None
    return StudySettings.from_attrs(attrs)


# --- loss reference --------------------------------------------------------------------------


@dataclass(frozen=True)
class LossCheck:
    regression: float  # relative; exact: max per-step |diff|, lossy: mean of measured steps
    tolerance: float
    exact: bool

    @property
    def ok(self) -> bool:
        return self.regression <= self.tolerance


def check_loss(
    losses: Sequence[float], reference: Sequence[float], exact: bool, tolerance: float, last: int
) -> LossCheck | None:
    """Compare a trial's per-step losses with the reference's (same seed, same data)."""
    n = min(len(losses), len(reference))
    if n == 0 or any(not math.isfinite(x) for x in losses[:n]):
        return None if n == 0 else LossCheck(math.inf, EXACT_RTOL if exact else tolerance, exact)
    if exact:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n], strict=True))
        return LossCheck(worst, EXACT_RTOL, True)
    k = max(1, min(last, n))
    mean, ref = sum(losses[n - k : n]) / k, sum(reference[n - k : n]) / k
    return LossCheck((mean - ref) / abs(ref), tolerance, False)


def reference_losses(study: optuna.Study) -> list[float] | None:
    ref = study.user_attrs.get("reference_losses")
    return list(ref) if ref else None


def ensure_reference(study: optuna.Study, space: SearchSpace) -> None:
    """Queue the exact reference as the next trial unless it ran or is queued/running."""
    if reference_losses(study) is not None:
        return
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("role") == "reference" and t.state in (
            TrialState.WAITING,
            TrialState.RUNNING,
        ):
            return
    study.enqueue_trial(
        space.params_for(space.reference_config()), user_attrs={"role": "reference"}
    )


def _earlier_reference(study: optuna.Study, number: int) -> bool:
    return any(
        t.user_attrs.get("role") == "reference"
        and t.number < number
        and t.state in (TrialState.RUNNING, TrialState.COMPLETE)
        for t in study.get_trials(deepcopy=False)
    )


# --- the objective ---------------------------------------------------------------------------


class TrialCrashed(Exception):
    """The job crashed or hung: a FAIL, unlike an OOM, which is a measured result."""


#: trials that run without the budget, so their peak is the true one even when over it
UNBOUNDED_ROLES = ("reference", "ladder")


def true_peak(attrs: dict[str, Any]) -> bool:
    """Whether a trial's ``peak_bytes`` is its real peak (not cut short by the budget)."""
    return attrs.get("status") == "ok" or attrs.get("role") in UNBOUNDED_ROLES


def find_duplicate(
    study: optuna.Study, config: dict[str, Any], need_true_peak: bool = False
) -> FrozenTrial | None:
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("config") == config and "duplicate_of" not in t.user_attrs:
            if need_true_peak and not true_peak(t.user_attrs):
                continue
            return t
    return None


_RESULT_ATTRS = (
    "status",
    "peak_bytes",
    "tokens_per_s",
    "losses",
    "error",
    "wall_s",
    "memory_breakdown",
    "stderr_tail",
    "rank_peaks",
    "construction_peak_bytes",
    "training_peak_bytes",
    "construction_breakdown",
    "host_peak_bytes",
)


class Objective:
    """Sample a config, run it (or reuse an identical finished trial), record it."""

    def __init__(self, study: optuna.Study, space: SearchSpace, runner: TrialRunner) -> None:
        self.study = study
        self.space = space
        self.runner = runner
        self.settings = settings_of(study)
        self.on_result: Callable[[FrozenTrial | optuna.Trial, TrialResult], None] | None = None

    def __call__(self, trial: optuna.Trial) -> tuple[float, float]:
        config = self.space.sample(trial.suggest_categorical)  # type: ignore[arg-type]
        trial.set_user_attr("config", config)
        role = trial.user_attrs.get("role")
        if role == "reference" and _earlier_reference(self.study, trial.number):
            role = ""  # queued twice by processes that started together: one reference is enough
            trial.set_user_attr("role", role)
        is_reference = role == "reference"
        # the reference and ladder steps run without the budget: their peak is the true one
        unbounded = role in UNBOUNDED_ROLES
        earlier = (
            None if is_reference else find_duplicate(self.study, config, need_true_peak=unbounded)
        )
        if earlier is not None:
            result = TrialResult.from_dict(
                {
                    k: earlier.user_attrs.get(k)
                    for k in _RESULT_ATTRS
                    if earlier.user_attrs.get(k) is not None
                }
            )
            trial.set_user_attr("duplicate_of", earlier.number)
        else:
            # The reference must produce a loss curve even if it does not fit: it runs unbounded
            # and is judged against the budget afterwards.
            budget = None if unbounded else self.settings.budget_bytes
            try:
                result = self.runner.run(
                    self.settings.spec(config, budget), f"trial-{trial.number}"
                )
            except KeyboardInterrupt:  # the runner has killed the job; say so on the trial
                trial.set_user_attr("status", "failed")
                trial.set_user_attr("error", "interrupted (Ctrl-C); its job was stopped")
                raise
            if (
                unbounded
                and result.status == "ok"
                and result.peak_bytes > self.settings.budget_bytes
            ):
                result.status = "oom"
                result.error = f"{role} ran unbounded; its peak is over the budget"
        for key in _RESULT_ATTRS:
            trial.set_user_attr(key, getattr(result, key))
        for key, value in self.runner.attrs_for(result).items():
            trial.set_user_attr(key, value)
        if self.on_result:
            self.on_result(trial, result)
        if result.status == "failed":
            raise TrialCrashed(result.error)

        if is_reference and result.losses:
            self.study.set_user_attr("reference_losses", result.losses)
            self.study.set_user_attr("reference_trial", trial.number)
        ref = reference_losses(self.study)
        check = None
        if ref is not None and result.status == "ok":
            check = check_loss(
                result.losses,
                ref,
                is_exact(config),
                self.settings.loss_tolerance,
                self.settings.measured_steps,
            )
        if check is not None:
            trial.set_user_attr("loss_regression", check.regression)
            trial.set_user_attr("loss_tolerance", check.tolerance)
        budget = self.settings.budget_bytes
        over = (
            (result.peak_bytes - budget) / budget
            if result.status == "ok"
            else max(1e-6, (result.peak_bytes - budget) / budget)
        )
        loss_violation = (check.regression - check.tolerance) if check else 0.0
        # <= 0 is feasible; the sampler reads these from the trial (Optuna's set_constraint)
        constraints = {"memory": over, "loss": min(loss_violation, 1e6)}
        for name, value in constraints.items():
            trial.set_constraint(name, value)
        # optuna-dashboard (0.21) shows only the old list format of constraints: a copy as a
        # user attr makes feasibility visible there without counting any constraint twice
        trial.set_user_attr("constraints", constraints)
        return result.tokens_per_s, result.peak_bytes / MIB


def _autotune_sampler(
    study: optuna.Study, space: SearchSpace, seed: int
) -> optuna.samplers.BaseSampler:
    from autotune.strategy import AutotuneSampler, analytical_predictor

    s = settings_of(study)
    predict = analytical_predictor(
        s.model_config,
        seq_len=s.seq_len,
        global_batch_size=s.global_batch_size,
        nproc=s.nproc,
        gpu_key=s.target_gpu or None,
    )
    return AutotuneSampler(
        space.grid(), predict, s.budget_bytes, seed=seed, loss_tolerance=s.loss_tolerance
    )


def _tpe_sampler(study: optuna.Study, space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=6)


def _random_sampler(
    study: optuna.Study, space: SearchSpace, seed: int
) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)


#: ``--strategy`` -> sampler; constraints reach every one through ``Trial.set_constraint``
STRATEGIES: dict[str, Callable[[optuna.Study, SearchSpace, int], optuna.samplers.BaseSampler]] = {
    "autotune": _autotune_sampler,
    "tpe": _tpe_sampler,
    "random": _random_sampler,
}


def make_sampler(
    study: optuna.Study,
    seed: int,
    salt: int = 0,
    *,
    space: SearchSpace | None = None,
    strategy: str = "autotune",
) -> optuna.samplers.BaseSampler:
    """The strategy's sampler, reseeded per session so a resumed study does not replay
    proposals; ``salt`` (a worker's pid) keeps workers that start together apart."""
    n_done = len(study.get_trials(deepcopy=False))
    if space is None:
        space = SearchSpace.from_dict(settings_of(study).space, "study")
    return STRATEGIES[strategy](study, space, seed + n_done + salt)


def workdir_for(study_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", study_name)
    return Path("autotune_runs") / safe
