"""The Optuna study: storage, settings kept with the study, the objective, the loss reference.

Objectives: maximise tokens/s, minimise peak memory (MiB). Going over the budget and
regressing the loss are *constraints* (``constraints_func``), so an OOM trial is a completed
trial the sampler learns from, never a FAIL it ignores. Only a crash or a hang of the job is a
FAIL, with its reason stored on the trial.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import distribution_to_json, json_to_distribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RDBStorage
from optuna.study._constrained_optimization import _CONSTRAINTS_KEY
from optuna.trial import FrozenTrial, TrialState

from autotune.backends import backend_named
from autotune.data_source import check_same, spec_data
from autotune.errors import UserError
from autotune.lossguard import LossVerdict, Prober, judge
from autotune.pending import Held, PendingResults
from autotune.runner import TrialRunner
from autotune.space import SearchSpace
from autotune.terminal import printable
from autotune.trial_cost import TrialCosts, reference_for_cost, study_predictor
from autotune.trial_cost import describe as describe_cost
from trials.data import Documents
from trials.spec import TrialResult, TrialSpec, tracked_steps, trial_documents
from trials.techniques import fidelity_class

DEFAULT_STORAGE = "sqlite:///autotune.db"
MIB = 2**20
#: the widest fidelity class searched unless ``--allow`` says otherwise: all but adapters
DEFAULT_ALLOW = "other_optimizer"


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
    #: timed steps; tokens/s comes from their median step time (trials/job.py)
    measured_steps: int = 6
    seed: int = 0
    lr: float = 3e-3
    nproc: int = 1  # ranks per trial, in all
    nodes: int = 1  # nodes a trial spans (``nproc / nodes`` ranks on each)
    #: how trials start (``autotune.launchers``): {"name": "local"|"slurm", options...}; not
    #: part of the identity: the same study may be continued through another launcher
    launcher: dict[str, Any] = field(default_factory=dict)
    target_gpu: str = ""  # backend "estimate": the GPU the predictions are for (gpus.GPUS key)
    host_budget_bytes: int = 0  # host RAM a trial may use (--host-memory); 0: unlimited
    #: the widest fidelity class searched (``trials.techniques.classes_up_to``)
    allow: str = DEFAULT_ALLOW
    #: loss probes of lossy numerics on a proxy (autotune/lossguard.py); 0 steps: none
    probe_steps: int = 200
    probe_seeds: int = 2
    #: interleaved re-measurement rounds of the finalists (autotune/finalists.py); 0: none
    confirm_rounds: int = 2
    #: the least seconds a trial job gets before it is killed (``autotune.trial_cost``)
    trial_timeout_floor_s: float = 300.0
    #: the trial data: [MIN, MAX] tokens per document (``trials.data.Documents``); None: every
    #: sequence is ``seq_len`` tokens
    documents: list[int] | None = None
    #: the user's dataset (``autotune.data_source``): its identity (source, bytes, SHA-256,
    #: field, tokenizer, length histogram) and the trial's documents; None: synthetic data
    data: dict[str, Any] | None = None
    #: the model folder whose pretrained weights every trial and probe starts from (None:
    #: random init; ``autotune.model_source``)
    weights: str | None = None
    #: the learning rate the user gave (``--lr``): ``lr`` is it, and every export writes it
    user_lr: float | None = None
    #: keys that must match to add trials to an existing study
    identity: tuple[str, ...] = field(
        default=(
            "model",
            "budget_bytes",
            "backend",
            "seq_len",
            "global_batch_size",
            "allow",
            "space",
            "nproc",
            "nodes",
            "documents",
            "data",
            "weights",
        ),
        repr=False,
    )

    def default_study_name(self) -> str:
        ranks = f"-x{self.nproc}" if self.nproc > 1 else ""
        if self.nodes > 1:
            ranks = f"-{self.nodes}x{self.nproc // self.nodes}"
        docs = f"-docs{self.documents[0]}-{self.documents[1]}" if self.documents else ""
        if self.data:
            docs = f"-data-{Path(self.data['source']).name}"
        return f"{self.model}-{self.budget_label}-{self.backend}{ranks}{docs}"

    def to_attrs(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("identity")
        return d

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> StudySettings:
        known = set(cls.__dataclass_fields__) - {"identity"}
        return cls(**{k: v for k, v in attrs.items() if k in known})

    def trial_documents(self) -> Documents | None:
        """The documents of the steps a trial of this study measures the memory of (None:
        fixed-length data)."""
        steps = tracked_steps(self.backend, self.warmup_steps, self.measured_steps)
        if self.data:
            return trial_documents(self.spec({}, None), self.backend)
        return Documents.of(self.documents, self.seed, steps)

    def spec(self, config: dict[str, Any], budget: int | None) -> TrialSpec:
        return TrialSpec(
            model_config=self.model_config,
            config=config,
            seq_len=self.seq_len,
            global_batch_size=self.global_batch_size,
            budget_bytes=budget,
            backend=backend_named(self.backend).device,
            warmup_steps=self.warmup_steps,
            measured_steps=self.measured_steps,
            seed=self.seed,
            lr=self.lr,
            nproc=self.nproc,
            nodes=self.nodes,
            host_budget_bytes=self.host_budget_bytes or None,
            documents=self.documents,
            data=spec_data(self.data),
            weights=self.weights,
        )


def _settings_attr(study: optuna.Study) -> dict[str, Any] | None:
    return study.user_attrs.get("settings")


#: settings a user may give again for an existing study: refused when they differ from its own
#: (they change how its past trials are judged or what they ran), with the option to omit
GIVEN_OPTIONS = {
    "loss_tolerance": "--loss-tolerance",
    "seed": "--seed",
    "target_gpu": "--gpu",
    "user_lr": "--lr",
}
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
            # before the settings: a process joining this study waits for the settings, so it
            # finds the folder id too and shares the study's folders
            study.set_user_attr(FOLDER_ID_ATTR, uuid.uuid4().hex[:12])
            study.set_user_attr("settings", settings.to_attrs())
            return study
    study = optuna.load_study(study_name=name, storage=storage)
    stored = _wait_for_settings(study)
    if stored is None:
        raise UserError(f"study '{name}' was not made by autotune; use another --study-name")
    # a study from before a setting existed had its default (fixed-length data)
    stored = {"documents": None, "data": None, "weights": None, **stored}
    check_same(name, stored["data"], settings.data)
    for key in settings.identity:
        if key == "data":
            continue
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
        # the most recent: the highest id (the storage's public lookup, not FrozenStudy's
        # private ``_study_id``)
        name = max((s.study_name for s in summaries), key=storage.get_study_id_from_name)
    elif name not in {s.study_name for s in summaries}:
        known = ", ".join(printable(s.study_name) for s in summaries)
        raise UserError(f"no study named '{printable(name)}' (studies here: {known})")
    study = optuna.load_study(study_name=name, storage=storage)
    if _settings_attr(study) is None:
        raise UserError(f"study '{printable(name)}' was not made by autotune")
    return study


#: the stored type of each setting (its annotation): what another tool wrote is checked
_SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "dict[str, Any]": (dict,),
    "list[int] | None": (list, type(None)),
    "str | None": (str, type(None)),
    "float | None": (int, float, type(None)),
}


def settings_of(study: optuna.Study) -> StudySettings:
    """The study's stored settings; settings another tool wrote in another shape are one
    clear error, not a ``TypeError`` deep inside a command."""
    attrs = _settings_attr(study)
    name = printable(study.study_name)
    if not isinstance(attrs, dict):
        raise UserError(f"study '{name}': its settings are not autotune's (written by another "
                        "tool?); run a new study")  # fmt: skip
    for f in fields(StudySettings):
        kinds = _SETTING_TYPES.get(str(f.type))
        value = attrs.get(f.name)
        if f.name not in attrs or kinds is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise UserError(
                f"study '{name}': in its stored settings, {f.name} is "
                f"{printable(repr(value))[:80]}"
                f", not a {f.type}: written by another tool? run a new study"
            )
    from autotune.models import SIZE_LIMITS  # transformers only when a config is built

    config = attrs.get("model_config") or {}
    for key, limit in SIZE_LIMITS.items():
        value = config.get(key)
        if isinstance(value, int) and value > limit:
            raise UserError(f"study '{name}': its stored settings' model config has {key} "
                            f"{value:,}, more than {limit:,} (docs/guide/limits.md)")  # fmt: skip
    try:
        return StudySettings.from_attrs(attrs)
    except (TypeError, ValueError) as exc:
        raise UserError(f"study '{name}': its settings are not autotune's: {exc}") from None


# --- loss reference --------------------------------------------------------------------------


def reference_losses(study: optuna.Study) -> list[float] | None:
    ref = study.user_attrs.get("reference_losses")
    return list(ref) if ref else None


def least_memory_exact(space: SearchSpace, settings: StudySettings) -> dict[str, Any]:
    """The exact configuration of the space predicted to need the least device memory (e.g.
    ZeRO-3 with both offloads, full checkpointing, micro-batch 1): if anything exact fits, it
    does. Ties go to the space's ``reference`` preferences, then to the first in grid order."""
    exact = space.restrict(("exact",)).grid()
    predict = study_predictor(settings)

    def key(item: tuple[int, dict[str, Any]]) -> tuple[float, int, int]:
        i, config = item
        prefer = sum(config.get(k) == v for k, v in space.reference.items())
        return (predict(config)[0], -prefer, i)

    return min(enumerate(exact), key=key)[1]


def reference_for(space: SearchSpace, settings: StudySettings) -> dict[str, Any]:
    """The study's loss reference: the exact configuration predicted to fit the budget with the
    shortest predicted step (``trial_cost.reference_for_cost``); its loss curve is the one every
    exact trial is compared with, and it is trained first, so its cost is the study's first."""
    return reference_for_cost(
        space.restrict(("exact",)).grid(),
        study_predictor(settings),
        settings.budget_bytes,
        settings.seq_len * settings.global_batch_size * settings.nproc,
        space.reference,
    )


def ensure_reference(study: optuna.Study, space: SearchSpace) -> None:
    """Queue the exact reference once per study: never again once a reference trial exists in
    any state (a crashed one is retried by the heartbeat callback, not here)."""
    if reference_losses(study) is not None:
        return
    if any(t.user_attrs.get("role") == "reference" for t in study.get_trials(deepcopy=False)):
        return
    config = study.user_attrs.get("reference_config")
    if config is None and not space.has_exact():
        # e.g. a bf16-only space: nothing to compare exact trials with; lossy ones go by the probe
        study.set_user_attr("no_exact_reference", True)
        return
    if config is None:
        try:
            config = reference_for(space, settings_of(study))
        except (KeyError, ValueError, NotImplementedError):
            # an architecture the analytical estimator does not know: the space's preferences
            config = space.restrict(("exact",)).reference_config()
        study.set_user_attr("reference_config", config)
    study.enqueue_trial(space.params_for(config), user_attrs={"role": "reference"})


def no_reference_why(study: optuna.Study) -> str:
    """Why exact trials of this study have no reference curve to be checked against."""
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("role") != "reference":
            continue
        if t.state == TrialState.RUNNING:
            return f"the reference (trial {t.number}) is still running"
        error = t.user_attrs.get("error") or t.state.name.lower()
        return f"the reference (trial {t.number}) has no curve: {error}"
    if settings_of(study).backend == "estimate":
        return "predicted, not trained (exact by construction)"
    if study.user_attrs.get("no_exact_reference"):
        return "the space has no exact configuration to train as the reference"
    return "no reference trial yet"


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


#: seconds between looks at an earlier trial that measures the same configuration
SAME_CONFIG_POLL_S = 1.0
#: seconds an earlier RUNNING trial may take to record its configuration (it does so right
#: after it starts); one that never does is not waited for
DECLARE_WAIT_S = 60.0


def wait_for_earlier_same(study: optuna.Study, number: int, config: dict[str, Any]) -> None:
    """Wait while an earlier trial (a lower number) measures ``config`` right now: two
    controllers started together may draw the same configuration (the queued reference twice,
    the same plan); the later one then reuses the earlier one's result (``find_duplicate``)
    instead of measuring it at the same time. An earlier trial always runs and never waits for
    a later one, so no two wait on each other; a later trial first waits (a bounded time) for
    every earlier RUNNING trial to record its configuration, so none is missed. An earlier
    trial whose controller died is failed by the heartbeat sweep, which ends the wait."""
    started = time.monotonic()
    while True:
        earlier = [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.number < number
        ]
        undeclared = time.monotonic() - started < DECLARE_WAIT_S and any(
            "config" not in t.user_attrs for t in earlier
        )
        if not undeclared and not any(t.user_attrs.get("config") == config for t in earlier):
            return
        time.sleep(SAME_CONFIG_POLL_S)
        optuna.storages.fail_stale_trials(study)


_UNSET = object()

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
    "transient",
    "construction_peak_bytes",
    "training_peak_bytes",
    "oom_rank",
    "capped",
    "skipped_steps",
    "alloc_conf",
    "device_memory",
    "construction_breakdown",
    "host_peak_bytes",
    "step_time_s",
    "step_spread",
    "load_per_core",
)


def deterministic_failure(result: TrialResult) -> bool:
    """A failure the same configuration would hit again (an exception in the job, an
    unsupported combination, a crash), unlike a time limit, which a busy machine can cause, or
    a scheduler's verdict on the job (``TrialResult.transient``)."""
    return (
        result.status == "failed"
        and not result.transient
        and not result.error.startswith("timed out")
    )


class ResultNotStored(Exception):
    """The trial ran but its result could not be written to the storage (a full disk, a lost
    database): the trial is marked failed where the storage still allows it."""

    def __init__(self, number: int, reason: str) -> None:
        super().__init__(f"could not store trial {number}'s result: {reason}")
        self.number = number


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a failed write to the study's storage raises (SQLAlchemy wraps the driver's)."""
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    return (SQLAlchemyError, StorageInternalError, OSError)


def write_error_reason(exc: BaseException) -> str:
    """The driver's own words (``database or disk is full``) under Optuna's and SQLAlchemy's
    wrappers: the first line of the innermost cause."""
    inner: BaseException = exc
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__  # type: ignore[assignment]
    text = str(inner).strip().splitlines()
    return (text[0] if text else type(inner).__name__)[:300]


def fail_running_trials(study: optuna.Study, numbers: list[int], attempts: int = 3) -> str:
    """After a write error: mark those of trials ``numbers`` still RUNNING failed (Optuna itself
    tries first; with ``--in-flight`` several run at once); say what became of them, in words
    for the one line the command ends with."""
    marked, stuck = [], []
    for number in numbers:
        for attempt in range(attempts):
            try:
                state = study.get_trials(deepcopy=False)[number].state
                if state == TrialState.RUNNING:
                    study.tell(number, state=TrialState.FAIL)
                    marked.append(number)
                break
            except storage_errors():
                time.sleep(0.5 * (attempt + 1))
        else:
            stuck.append(number)
    words = []
    if not marked and not stuck and numbers:
        with contextlib.suppress(*storage_errors()):  # Optuna's own tell may have failed it
            if study.get_trials(deepcopy=False)[numbers[-1]].state == TrialState.FAIL:
                marked.append(numbers[-1])
    if marked:
        words.append(f"trial {', '.join(map(str, marked))} is marked failed")
    if stuck:
        words.append(
            f"trial {', '.join(map(str, stuck))} could not be marked failed either; the next "
            "`autotune resume` fails it once its heartbeat has expired"
        )
    return "; ".join(words) or "no trial was left running"


class TakenOver(Exception):
    """This controller's trial was failed by another process while this one was stopped or
    paused past its heartbeat's grace (Optuna then lets no one tell it); its measurement, if
    it had one, is stored as a new trial (``recovered_from``)."""

    def __init__(self, number: int, recorded_as: int | None) -> None:
        kept = "" if recorded_as is None else f"; its measurement is stored as trial {recorded_as}"
        super().__init__(f"trial {number} was taken over by another worker while this one was "
                         f"paused{kept}")  # fmt: skip
        self.number = number
        self.recorded_as = recorded_as


#: user attr of a trial that holds the measurement of another (a taken-over trial's number)
RECOVERED_FROM_ATTR = "recovered_from"


def interrupt_name(exc: BaseException) -> str:
    """The signal a ``KeyboardInterrupt`` stands for (the CLI's handler names SIGTERM)."""
    return str(getattr(exc, "signal_name", "") or "Ctrl-C")


class Objective:
    """Sample a config, run it (or reuse an identical finished trial), record it.

    With ``pending`` each finished measurement is first kept on local disk
    (``autotune.pending``) and removed once the trial is stored; ``replay_pending`` stores
    those a failed storage, a stopped or a paused controller left there.
    """

    def __init__(
        self,
        study: optuna.Study,
        space: SearchSpace,
        runner: TrialRunner,
        prober: Prober | None = None,
        no_probe_why: str = "",
        pending: PendingResults | None = None,
        costs: TrialCosts | None = None,
    ) -> None:
        self.study = study
        self.space = space
        self.runner = runner
        self.settings = settings_of(study)
        self.prober = prober  # lossy numerics are judged on a proxy (autotune/lossguard.py)
        self.no_probe_why = no_probe_why
        self.pending = pending
        #: each trial's measured steps and time limit from its predicted step (None: the
        #: study's steps and the runner's limit)
        self.costs = costs
        #: hears a line when a trial measures fewer steps or gets its own time limit
        self.say: Callable[[str], None] | None = None
        self.on_result: Callable[[FrozenTrial | optuna.Trial, TrialResult], None] | None = None
        #: the trials this objective started (``--in-flight``: several threads at once); after a
        #: write error those still RUNNING are failed (``fail_running_trials``)
        self.started: list[int] = []
        #: the signal that stopped a loss probe ("SIGTERM", "Ctrl-C"); the study is then stopped
        #: after that trial is stored
        self.interrupted = ""
        #: trials another process took over while this one was paused, and where their
        #: measurements went (``TakenOver``)
        self.taken_over: list[TakenOver] = []
        self._held: dict[int, Held] = {}
        #: each running trial's measurement, as it will be stored (``_judged``)
        self._records: dict[int, dict[str, Any]] = {}

    def __call__(self, trial: optuna.Trial) -> tuple[float, float]:
        self.started.append(trial.number)
        try:
            return self._run(trial)
        except UpdateFinishedTrialError:
            # another process failed this trial while this one was paused past its heartbeat's
            # grace: what it measured goes into a new trial, and this controller goes on
            record = self._records.pop(trial.number, None)
            recorded = None
            if record is not None:
                if record["values"] is None:
                    self._judged(record, TrialResult.from_dict(record["user_attrs"]))
                recorded = self._add_trial(record)
            self._forget(trial.number)
            taken = TakenOver(trial.number, recorded)
            self.taken_over.append(taken)
            raise taken from None

    def _run(self, trial: optuna.Trial) -> tuple[float, float]:
        config = self.space.sample(trial.suggest_categorical)  # type: ignore[arg-type]
        trial.set_user_attr("config", config)
        trial.set_user_attr("fidelity", fidelity_class(config))
        role = trial.user_attrs.get("role")
        if role == "reference" and _earlier_reference(self.study, trial.number):
            role = ""  # queued twice by processes that started together: one reference is enough
            trial.set_user_attr("role", role)
        is_reference = role == "reference"
        # the reference and ladder steps run without the budget: their peak is the true one
        unbounded = role in UNBOUNDED_ROLES
        if not is_reference:
            wait_for_earlier_same(self.study, trial.number, config)
        earlier = (
            None if is_reference else find_duplicate(self.study, config, need_true_peak=unbounded)
        )
        extra: dict[str, Any] = {}
        if earlier is not None:
            result = TrialResult.from_dict(
                {
                    k: earlier.user_attrs.get(k)
                    for k in _RESULT_ATTRS
                    if earlier.user_attrs.get(k) is not None
                }
            )
            extra["duplicate_of"] = earlier.number
        else:
            # The reference must produce a loss curve even if it does not fit: it runs unbounded
            # and is judged against the budget afterwards.
            budget = None if unbounded else self.settings.budget_bytes
            spec = self.settings.spec(config, budget)
            if self.costs is not None:
                cost = self.costs.for_config(config, self.study)
                spec.measured_steps, spec.timeout_s = cost.measured_steps, cost.timeout_s
                for key, value in cost.attrs().items():
                    trial.set_user_attr(key, value)
                if self.say is not None and cost.measured_steps < self.settings.measured_steps:
                    self.say(
                        f"trial #{trial.number}: "
                        f"{describe_cost(cost, self.settings.measured_steps)}"
                    )
            try:
                result = self.runner.run_for(trial, spec, f"trial-{trial.number}")
            except KeyboardInterrupt as exc:  # the runner has killed the job; say so on the trial
                trial.set_user_attr("status", "failed")
                trial.set_user_attr(
                    "error", f"interrupted ({interrupt_name(exc)}); its job was stopped"
                )
                raise
            if (
                unbounded
                and result.status == "ok"
                and result.peak_bytes > self.settings.budget_bytes
            ):
                result.status = "oom"
                result.error = f"{role} ran unbounded; its peak is over the budget"
        attrs = {
            **{k: v for k, v in trial.user_attrs.items() if k not in _RESULT_ATTRS},
            **extra,
            "config": config,
            "fidelity": fidelity_class(config),
            **{key: getattr(result, key) for key in _RESULT_ATTRS},
            **self.runner.attrs_for(result),
        }
        crashed = result.status == "failed" and not deterministic_failure(result)
        record: dict[str, Any] = {
            "number": trial.number,
            "params": trial.params,
            "distributions": {k: distribution_to_json(d) for k, d in trial.distributions.items()},
            "user_attrs": attrs,
            "role": role or "",
            "values": None,
        }
        if not crashed:
            self._records[trial.number] = record
        if self.pending is not None and not crashed:
            # the measurement is safe on local disk before anything is written to the storage
            self._held[trial.number] = held = self.pending.hold(trial.number)
            held.save(record)
        try:
            current = trial.user_attrs
            for key, value in attrs.items():
                if current.get(key, _UNSET) != value:
                    trial.set_user_attr(key, value)
        except storage_errors() as exc:
            reason = write_error_reason(exc)
            with contextlib.suppress(*storage_errors(), UpdateFinishedTrialError):
                trial.set_user_attr("status", "failed")  # as much as the storage still takes
                trial.set_user_attr("error", f"result not stored: {reason}")
            raise ResultNotStored(trial.number, reason) from exc
        if self.on_result:
            self.on_result(trial, result)
        if crashed:
            raise TrialCrashed(result.error)
        self._judged(record, result)
        if self.pending is not None:
            self._held[trial.number].save(record)
        self._apply(record, trial)
        values = record["values"]
        return values[0], values[1]

    def _judged(self, record: dict[str, Any], result: TrialResult) -> None:
        """Fill ``record`` with the loss verdict, the constraints and the objective values."""
        attrs = record["user_attrs"]
        config, role = attrs["config"], record["role"]
        is_reference = role == "reference"
        if result.status == "failed":
            # The same configuration would fail again: a completed trial that violates the
            # ``failed`` constraint, so every sampler sees it as infeasible and autotune's never
            # proposes it again (an identical proposal reuses this result: find_duplicate).
            self._constrain(record, memory=0.0, loss=0.0, failed=1.0, result=result)
            return
        verdict = None
        if result.status == "ok":
            try:
                verdict = judge(
                    config,
                    result.losses,
                    is_reference=is_reference,
                    reference=reference_losses(self.study),
                    no_reference_why="" if is_reference else no_reference_why(self.study),
                    prober=self.prober,
                    no_probe_why=self.no_probe_why,
                    tolerance=self.settings.loss_tolerance,
                )
            except KeyboardInterrupt as exc:
                # stopped while its loss probe ran (the probe's job is killed): the measurement
                # is kept, unjudged and saying so, and the study stops after storing it
                self.interrupted = interrupt_name(exc)
                with contextlib.suppress(RuntimeError):  # outside optimize (a replay): no loop
                    self.study.stop()
                verdict = LossVerdict(
                    "none",
                    None,
                    note=f"not judged: interrupted ({self.interrupted}) while its loss probe "
                    "ran; the measurement is kept",
                )
            # the one stored verdict: selector, ladder, report and strategy read it from here
            attrs["loss_verdict"] = verdict.to_attrs()
            if verdict.regression is not None:
                attrs["loss_regression"] = verdict.regression
                attrs["loss_tolerance"] = verdict.tolerance
        budget = self.settings.budget_bytes
        over = (
            (result.peak_bytes - budget) / budget
            if result.status == "ok"
            else max(1e-6, (result.peak_bytes - budget) / budget)
        )
        loss_violation = (
            verdict.regression - verdict.tolerance
            if verdict is not None
            and verdict.regression is not None
            and verdict.tolerance is not None
            else 0.0
        )
        self._constrain(
            record, memory=over, loss=min(loss_violation, 1e6), failed=0.0, result=result
        )

    def _apply(self, record: dict[str, Any], trial: optuna.Trial | None = None) -> None:
        """Write a judged record's attrs, constraints and the study's reference curve into its
        own trial (still RUNNING); the caller tells its values."""
        number = record["number"]
        storage = self.study._storage
        trial_id = (
            trial._trial_id
            if trial is not None
            else storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        )
        current = storage.get_trial(trial_id)
        for key, value in record["user_attrs"].items():
            if current.user_attrs.get(key, _UNSET) != value:
                storage.set_trial_user_attr(trial_id, key, value)
        for name, value in record["constraints"].items():
            key = f"{_CONSTRAINTS_KEY}:{name}"
            if current.system_attrs.get(key, _UNSET) != value:
                storage.set_trial_system_attr(trial_id, key, value)
        self._reference(record, number)

    def _reference(self, record: dict[str, Any], number: int) -> None:
        losses = record["user_attrs"].get("losses")
        status = record["user_attrs"].get("status")
        if record["role"] == "reference" and losses and status != "failed":
            self.study.set_user_attr("reference_losses", losses)
            self.study.set_user_attr("reference_trial", number)

    def _add_trial(self, record: dict[str, Any]) -> int:
        """A judged record as a new COMPLETE trial (its own was finished by another process):
        the same parameters, attrs, constraints and values, and ``recovered_from``."""
        distributions = {k: json_to_distribution(d) for k, d in record["distributions"].items()}
        frozen = optuna.trial.create_trial(
            state=TrialState.COMPLETE,
            params=record["params"],
            distributions=distributions,
            values=record["values"],
            user_attrs={
                **{k: v for k, v in record["user_attrs"].items() if k != "role"},
                RECOVERED_FROM_ATTR: record["number"],
            },
            system_attrs={f"{_CONSTRAINTS_KEY}:{k}": v for k, v in record["constraints"].items()},
        )
        storage = self.study._storage
        trial_id = storage.create_new_trial(self.study._study_id, template_trial=frozen)
        number = storage.get_trial_number_from_id(trial_id)
        self._reference(record, number)
        return number

    def _forget(self, number: int) -> None:
        self._records.pop(number, None)
        held = self._held.pop(number, None)
        if held is not None:
            held.done()

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Optuna's callback once a trial is told: its measurement is stored."""
        if trial.state.is_finished():
            self._forget(trial.number)

    def rescue(self) -> list[TakenOver]:
        """After ``optimize`` raised: the measurements of this controller's trials that another
        process failed meanwhile (Optuna's tell then raises), each stored as a new trial."""
        rescued = []
        for number, record in list(self._records.items()):
            trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(
                self.study._study_id, number
            )
            if self.study._storage.get_trial(trial_id).state != TrialState.FAIL:
                continue
            if record["values"] is None:
                self._judged(record, TrialResult.from_dict(record["user_attrs"]))
            rescued.append(TakenOver(number, self._add_trial(record)))
            self._forget(number)
        self.taken_over += rescued
        return rescued

    def kept(self) -> list[Path]:
        """The files of measurements this controller could not store."""
        return [held.path for held in self._held.values() if held.path.exists()]

    def replay_pending(self) -> list[tuple[int, int]]:
        """Store the measurements earlier controllers of this study kept on disk (their storage
        failed, or they were stopped before storing them): into their own trial where it is still
        RUNNING, else as a new trial. Returns (trial, where it is now) for each one stored."""
        if self.pending is None:
            return []
        done = []
        for held in self.pending.waiting():
            try:
                record = held.load()
                if record is None:
                    held.done()  # half-written by a process that died mid-write: nothing in it
                    continue
                number = int(record["number"])
                where = self._replay(record)
                if where is not None:
                    done.append((number, where))
                held.done()
            finally:
                held.release()
        return done

    def _replay(self, record: dict[str, Any]) -> int | None:
        number = int(record["number"])
        trial = self.study._storage.get_trial(
            self.study._storage.get_trial_id_from_study_id_trial_number(
                self.study._study_id, number
            )
        )
        if trial.state == TrialState.COMPLETE:
            return None  # stored before its controller stopped
        if record.get("values") is None:
            self._judged(record, TrialResult.from_dict(record["user_attrs"]))
        if trial.state == TrialState.RUNNING:
            try:
                self._apply(record)
                self.study.tell(number, record["values"])
                return number
            except (UpdateFinishedTrialError, ValueError):
                pass  # another process failed it meanwhile (a stale heartbeat)
        return self._add_trial(record)

    def _constrain(
        self,
        record: dict[str, Any],
        *,
        memory: float,
        loss: float,
        failed: float,
        result: TrialResult,
    ) -> None:
        # <= 0 is feasible; the sampler reads these from the trial (Optuna's constraints, as
        # ``Trial.set_constraint`` stores them)
        constraints = {"memory": memory, "loss": loss, "failed": failed}
        record["constraints"] = constraints
        # optuna-dashboard (0.21) shows only the old list format of constraints: a copy as a
        # user attr makes feasibility visible there without counting any constraint twice
        record["user_attrs"]["constraints"] = constraints
        peak = result.peak_bytes or (self.settings.budget_bytes if failed > 0 else 0)
        record["values"] = [result.tokens_per_s, peak / MIB]


def _autotune_sampler(
    study: optuna.Study, space: SearchSpace, seed: int
) -> optuna.samplers.BaseSampler:
    from autotune.strategy import AutotuneSampler

    s = settings_of(study)
    # on a real GPU the prior is that GPU's spec (a card the table lacks keeps the nominal one)
    predict = study_predictor(s)
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


#: study user attr: a random id made once per study, which names its trial folders
FOLDER_ID_ATTR = "folder_id"


def workdir_for(study: optuna.Study, root: Path = Path("autotune_runs")) -> Path:
    """The study's trial folders: ``<root>/<name>-<id>``, the id random and kept with the study,
    so two databases holding a study of the same name, or names that read alike once made
    safe for a path, never share folders (nor read each other's results)."""
    folder_id = study.user_attrs.get(FOLDER_ID_ATTR)
    if not folder_id:
        folder_id = uuid.uuid4().hex[:12]
        study.set_user_attr(FOLDER_ID_ATTR, folder_id)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", study.study_name)
    # the id as stored: another tool may have written a path ("../..") or a newline there
    safe_id = re.sub(r"[^A-Za-z0-9]+", "_", str(folder_id))
    return root / f"{safe}-{safe_id}"
