"""From a study's trials to a decision: a winner per fidelity class, the Pareto front, or the
closest miss.

A trial is feasible when it fits the budget and its stored loss verdict
(``autotune/lossguard.py``) did not reject it. Within each class group (exact or mixed precision
full training first, then reduced-precision state, other optimizers, adapters) the fastest is
the winner only if it beats the others by more than the noise: the larger of
``NOISE_FLOOR`` (DeepSpeed's autotuner uses 5%) and the measured spread (step times within a
trial, and side-by-side re-measurements of the finalists, ``autotune/finalists.py``, which
then decide alone: speeds taken at different moments are never compared). Configurations within
the noise of the fastest tie, and a tie goes to the simplest: fewer techniques, lower ZeRO
stage, no offload. The study's ``winner`` is the full-training one when one fits. Everything is
recomputed from what the database holds, so ``show`` and ``run`` always agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.estimator.speed import MODEL_ERROR
from autotune.lossguard import LossVerdict
from autotune.strategy import CONTENDERS_ATTR, FOREIGN, foreign_record
from autotune.study import settings_of
from autotune.units import format_size
from trials.techniques import TECHNIQUES, classes_up_to, fidelity_class

#: the smallest speed difference that names a winner (DeepSpeed's autotuner: 5%)
NOISE_FLOOR = 0.05
#: 1-minute load average per CPU core, or median relative step-time spread, above which the
#: machine is reported as loaded while measuring
LOADED_PER_CORE = 1.0
LOADED_SPREAD = 0.10
#: class groups, best first: the headline answer trains the whole model in exact or mixed
#: precision; every other class is a trade the user may accept
GROUPS: dict[str, tuple[str, ...]] = {
    "full": ("exact", "mixed"),
    "reduced_state": ("reduced_state",),
    "other_optimizer": ("other_optimizer",),
    "adapters": ("adapters",),
}
GROUP_LABELS: dict[str, str] = {
    "full": "full training, exact or mixed precision",
    "reduced_state": "if you accept 8-bit optimizer state",
    "other_optimizer": "if you accept another optimizer (Adafactor, Lion)",
    "adapters": "with LoRA adapters on a frozen base",
}


@dataclass
class Row:
    number: int
    config: dict[str, Any]
    status: str  # ok | oom | failed | running | pruned
    peak_bytes: int
    tokens_per_s: float
    loss_regression: float | None
    loss_tolerance: float | None
    fits: bool
    loss_ok: bool | None
    role: str = ""
    error: str = ""
    duplicate_of: int | None = None
    memory_breakdown: dict[str, int] | None = None
    predicted: bool = False
    stderr_tail: str = ""
    retry_of: int | None = None  # the trial whose controller died, run again as this one
    #: the trial whose measurement this one holds (taken over while its controller was paused,
    #: or stored from the measurements a failed storage left on disk: ``autotune.pending``)
    recovered_from: int | None = None
    rank_peaks: list[int] | None = None  # each rank's peak in a multi-process trial
    #: host memory: measured peak RSS, or predicted (estimate backend); studies recorded before
    #: RSS was measured fall back to the offloaded bytes of the breakdown
    host_peak_bytes: int = 0
    fidelity: str = "exact"
    verdict: LossVerdict | None = None
    step_spread: float = 0.0  # interquartile range of the step times / median, within the trial
    load_per_core: float = 0.0
    #: tokens/s of interleaved re-measurements of this configuration (finalists only)
    remeasured: list[float] = field(default_factory=list)
    construction_peak_bytes: int = 0  # while the model was built (before the first step)
    training_peak_bytes: int = 0  # during the steps
    oom_rank: int | None = None  # the rank that ran out of memory in a multi-process trial
    capped: bool = False  # run without a budget and stopped by the physical card
    pruned_by_estimate: bool = False  # an OOM predicted by the estimator, never run

    @property
    def feasible(self) -> bool:
        return self.status == "ok" and self.fits and self.loss_ok is not False

    @property
    def speed(self) -> float:
        """The tokens/s decisions use: the median of the side-by-side re-measurements where
        there are some (the trial's own measurement was taken at another moment), else the
        trial's own."""
        return statistics.median(self.remeasured) if self.remeasured else self.tokens_per_s

    @property
    def spread(self) -> float:
        """Relative noise of ``speed``: the larger of the within-trial step-time spread and the
        range of the re-measurements; with fewer than two re-measurements (one round), the range
        over the trial's own measurement and its re-measurement, the only noise known."""
        samples = (
            self.remeasured if len(self.remeasured) > 1 else [self.tokens_per_s, *self.remeasured]
        )
        between = (max(samples) - min(samples)) / self.speed if self.speed > 0 else 0.0
        return max(self.step_spread, between)


def simplicity(config: dict[str, Any]) -> tuple[int, int, int]:
    """(techniques used, sharding, offloads): smaller is simpler. A technique is used where a
    dimension differs from plain training (its ``Knob.baseline``); sharding and offloads add up
    its choices' ``Knob.complexity`` (the ZeRO stage; the optimizer's and the parameters'
    offload)."""
    plain = TECHNIQUES.baseline()
    used = sum(1 for k, value in plain.items() if k in config and config[k] != value)
    shards, offloads = TECHNIQUES.complexity(config)
    return used, shards, offloads


@dataclass
class ClassResult:
    """One class group's answer: its winner and the configurations it ties with."""

    group: str
    winner: Row | None
    ties: list[Row] = field(default_factory=list)  # within ``margin`` of the fastest
    margin: float = NOISE_FLOOR
    searched: bool = True  # False: --allow left this group out
    tried: int = 0  # trials of this group that ran to the end or out of memory
    regressed: int = 0  # of those, the ones that fit the budget but broke the loss guard

    @property
    def contenders(self) -> list[Row]:
        return ([self.winner] if self.winner else []) + self.ties


def margin_between(a: Row, b: Row) -> float:
    return max(NOISE_FLOOR, a.spread, b.spread)


def decide(feasible: list[Row]) -> tuple[Row | None, list[Row], float]:
    """The winner among feasible rows, the rows it ties with, and the margin used."""
    if not feasible:
        return None, [], NOISE_FLOOR
    if all(r.predicted for r in feasible):
        # predictions have no noise: the fastest is named, as the estimate backend's own
        # answer names it (``estimator.exhaustive.best_per_class``: then the least memory), and
        # the ones within the speed model's error are its ties
        best = min(feasible, key=lambda r: (-r.speed, r.peak_bytes, r.number))
        floor = best.speed * (1 - MODEL_ERROR)
        ties = sorted(
            (r for r in feasible if r is not best and r.speed >= floor), key=lambda r: -r.speed
        )
        return best, ties, MODEL_ERROR
    # speeds taken at different moments never decide: once the finalists were re-measured
    # side by side (autotune/finalists.py), the decision is theirs alone
    remeasured = [r for r in feasible if r.remeasured]
    if remeasured:
        feasible = remeasured
    best = max(feasible, key=lambda r: r.speed)
    contenders = [r for r in feasible if r.speed >= best.speed * (1 - margin_between(best, r))]
    winner = min(contenders, key=lambda r: (*simplicity(r.config), -r.speed, r.number))
    margin = max(margin_between(best, r) for r in contenders)
    ties = sorted((r for r in contenders if r is not winner), key=lambda r: -r.speed)
    return winner, ties, margin


@dataclass
class Selection:
    rows: list[Row]
    winner: Row | None
    pareto: list[Row]
    closest: Row | None  # when nothing is feasible: the smallest peak among trials that ran
    budget_bytes: int
    classes: dict[str, ClassResult] = field(default_factory=dict)  # GROUPS key -> answer
    load_warning: str = ""  # the machine was loaded while measuring: speeds are noisier

    @property
    def ties(self) -> list[Row]:
        """The configurations the winner ties with (its group's)."""
        for result in self.classes.values():
            if result.winner is not None and result.winner is self.winner:
                return result.ties
        return []


#: a FAIL with no reason of its own: its controller stopped heartbeating (killed, machine lost)
STALE = "its controller stopped mid-trial (no heartbeat)"


def rows_of(study: optuna.Study) -> list[Row]:
    settings = settings_of(study)
    remeasured: dict[str, list[float]] = study.user_attrs.get("remeasured") or {}
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if t.state == TrialState.RUNNING:
            status = "running"
        elif t.state == TrialState.WAITING:
            continue
        else:
            status = a.get("status", "failed")
        if t.state == TrialState.FAIL and status != "failed":
            status = "failed"
        foreign = foreign_record(a)
        try:
            verdict = (
                LossVerdict.from_attrs(a.get("loss_verdict"))
                if status == "ok" and not foreign
                else None
            )
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            foreign = f"loss_verdict: {exc}"
        if foreign:
            config = a["config"] if isinstance(a.get("config"), dict) else {}
            rows.append(
                Row(number=t.number, config=config, status="failed", peak_bytes=0,
                    tokens_per_s=0.0, loss_regression=None, loss_tolerance=None, fits=False,
                    loss_ok=None, error=FOREIGN + foreign)
            )  # fmt: skip
            continue
        config = a.get("config") or {}
        peak = int(a.get("peak_bytes") or 0)
        # the verdict stored by the objective (autotune/lossguard.py), never recomputed here
        breakdown = a.get("memory_breakdown") or {}
        rows.append(
            Row(
                number=t.number,
                config=config,
                status=status,
                peak_bytes=peak,
                tokens_per_s=float(a.get("tokens_per_s") or 0.0),
                loss_regression=verdict.regression if verdict else None,
                loss_tolerance=verdict.tolerance if verdict else None,
                fits=status == "ok" and peak <= settings.budget_bytes,
                loss_ok=verdict.ok if verdict else None,
                role=a.get("role", ""),
                error=a.get("error", "") or (STALE if t.state == TrialState.FAIL else ""),
                duplicate_of=a.get("duplicate_of"),
                memory_breakdown=breakdown or None,
                predicted=bool(a.get("predicted", False)),
                stderr_tail=a.get("stderr_tail") or "",
                retry_of=(t.system_attrs.get("retry_history") or [None])[-1],
                recovered_from=_trial_number(a.get("recovered_from")),
                rank_peaks=a.get("rank_peaks") or None,
                host_peak_bytes=int(
                    a.get("host_peak_bytes") or breakdown.get("host_offloaded") or 0
                ),
                fidelity=a.get("fidelity") or fidelity_class(config),
                verdict=verdict,
                step_spread=float(a.get("step_spread") or 0.0),
                load_per_core=float(a.get("load_per_core") or 0.0),
                remeasured=[float(x) for x in remeasured.get(str(t.number), [])],
                construction_peak_bytes=int(a.get("construction_peak_bytes") or 0),
                training_peak_bytes=int(a.get("training_peak_bytes") or 0),
                oom_rank=a.get("oom_rank"),
                capped=bool(a.get("capped", False)),
                pruned_by_estimate=bool(a.get("pruned_by_estimate", False)),
            )
        )
    return rows


def pareto_front(rows: list[Row]) -> list[Row]:
    """Trials that ran to the end and that no other beats on both speed and memory."""
    ran = [
        r for r in rows if r.status == "ok" and r.loss_ok is not False and r.duplicate_of is None
    ]
    front = []
    for r in ran:
        dominated = any(
            o.speed >= r.speed
            and o.peak_bytes <= r.peak_bytes
            and (o.speed > r.speed or o.peak_bytes < r.peak_bytes)
            for o in ran
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r.peak_bytes)


def machine_load(rows: list[Row]) -> str:
    """A warning when the machine was loaded while the trials measured speed, else ''."""
    ran = [r for r in rows if r.status == "ok" and not r.predicted and r.duplicate_of is None]
    if not ran:
        return ""
    load = statistics.median(r.load_per_core for r in ran)
    spread = statistics.median(r.step_spread for r in ran)
    if load <= LOADED_PER_CORE and spread <= LOADED_SPREAD:
        return ""
    return (
        f"the machine was loaded while measuring (load {load:.1f} per core, median step-time "
        f"spread {spread:.0%}): speed differences within the noise are reported as ties"
    )


def select(study: optuna.Study) -> Selection:
    settings = settings_of(study)
    rows = rows_of(study)
    allowed = classes_up_to(settings.allow)
    classes = {}
    for group, members in GROUPS.items():
        mine = [r for r in rows if r.fidelity in members and r.duplicate_of is None]
        feasible = [r for r in mine if r.feasible]
        tried = sum(r.status in ("ok", "oom") for r in mine)
        winner, ties, margin = decide(feasible)
        regressed = sum(r.status == "ok" and r.fits and r.loss_ok is False for r in mine)
        classes[group] = ClassResult(
            group, winner, ties, margin, any(c in allowed for c in members), tried, regressed
        )
    # the most faithful group that has a feasible configuration gives the headline winner
    winner = next((c.winner for c in classes.values() if c.winner is not None), None)
    measured = [
        r
        for r in rows
        if r.status in ("ok", "oom") and r.peak_bytes > 0 and not r.pruned_by_estimate
    ]
    closest = None
    if winner is None and measured:
        closest = min(measured, key=lambda r: r.peak_bytes)
    return Selection(
        rows,
        winner,
        pareto_front(rows),
        closest,
        settings.budget_bytes,
        classes,
        machine_load(rows),
    )


def class_summary(sel: Selection, describe: Callable[[dict[str, Any]], str]) -> list[str]:
    """One plain-text line per class group, the full-training answer first: its configuration,
    device peak, host memory, tokens/s, ties and the loss verdict's source."""
    lines = []
    budget = format_size(sel.budget_bytes)
    for group, result in sel.classes.items():
        label = GROUP_LABELS[group]
        if not result.searched:
            widest = GROUPS[group][-1]
            lines.append(f"{label}: not searched (--allow {widest} includes it)")
            continue
        w = result.winner
        if w is None:
            what = f"{result.tried} tried, none fits {budget}" if result.tried else "not tried"
            if result.regressed:
                what = (
                    f"{result.tried} tried, none passes: {result.regressed} fit {budget} but "
                    "regress the loss"
                )
            lines.append(f"{label}: {what}")
            continue
        host = f", host {format_size(w.host_peak_bytes)}" if w.host_peak_bytes else ""
        line = (
            f"{label}: trial {w.number}: {describe(w.config)}: peak {format_size(w.peak_bytes)}"
            f" of {budget}{host}, {w.speed:,.0f} tokens/s"
        )
        if result.ties:
            others = ", ".join(f"#{r.number}" for r in result.ties[:3])
            if len(result.ties) > 3:
                others += f" and {len(result.ties) - 3} more"
            line += f"; ties with {others} within {result.margin:.0%}: the simplest is named"
        lines.append(line + f"; loss: {verdict_text(w)}")
    return lines


def verdict_text(row: Row) -> str:
    """How the row's loss verdict was reached, in words."""
    v = row.verdict
    if v is None:
        return "no verdict (did not run to the end)"
    if v.via == "reference" and row.role == "reference":
        return "the reference"
    if v.via == "none":
        return f"no verdict: {v.note}"
    assert v.regression is not None and v.tolerance is not None
    result = "within" if v.ok else "over"
    if v.via == "reference":
        return f"matches the reference to {v.regression:.0e} per step ({result} {v.tolerance:.0e})"
    noise = f" ±{v.noise:.2%} seed noise" if v.noise is not None else ""
    return f"{v.regression:+.2%}{noise} on a probe, {result} tolerance {v.tolerance:.0%} ({v.note})"


def _trial_number(value: Any) -> int | None:
    """A trial number another trial's attr names (None for anything else another tool wrote)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def selection_json(study: optuna.Study) -> dict[str, Any]:
    """What ``autotune show --json`` prints: every trial, the winner, the Pareto front."""
    sel = select(study)
    settings = settings_of(study)
    rows = []
    for r in sel.rows:
        d = asdict(r)
        d["feasible"] = r.feasible
        d["speed"] = r.speed
        d["spread"] = r.spread
        rows.append(d)
    return {
        "study": study.study_name,
        "model": settings.model,
        "budget_bytes": sel.budget_bytes,
        "backend": settings.backend,
        "winner": sel.winner.number if sel.winner else None,
        "closest": sel.closest.number if sel.closest else None,
        "pareto": [r.number for r in sel.pareto],
        "ties": [r.number for r in sel.ties],
        "classes": {
            g: {
                "winner": c.winner.number if c.winner else None,
                "ties": [r.number for r in c.ties],
                "margin": c.margin,
                "searched": c.searched,
            }
            for g, c in sel.classes.items()
        },
        "load_warning": sel.load_warning,
        # estimate backend: the best full training per host memory size where it changes
        "host_frontier": study.user_attrs.get("host_frontier", []),
        # untried configurations that could still win (strategy.record_contenders)
        "unmeasured_contenders": study.user_attrs.get(CONTENDERS_ATTR),
        "trials": rows,
    }
