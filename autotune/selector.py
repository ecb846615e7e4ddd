"""From a study's trials to a decision: the winner, the Pareto front, or the closest miss.

The winner is the fastest trial that fits the budget and keeps the loss (exact techniques
within float noise of the reference, lossy ones within the study's tolerance). Everything is
recomputed from what the database holds, so ``show`` and ``run`` always agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.study import check_loss, reference_losses, settings_of
from trials.techniques import is_exact


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
    rank_peaks: list[int] | None = None  # each rank's peak in a multi-process trial
    host_peak_bytes: int = 0  # host memory: measured peak RSS, or predicted (estimate backend)

    @property
    def feasible(self) -> bool:
        return self.status == "ok" and self.fits and self.loss_ok is not False


@dataclass
class Selection:
    rows: list[Row]
    winner: Row | None
    pareto: list[Row]
    closest: Row | None  # when nothing is feasible: the smallest peak among trials that ran
    budget_bytes: int


#: a FAIL with no reason of its own: its controller stopped heartbeating (killed, machine lost)
STALE = "its controller stopped mid-trial (no heartbeat)"


def rows_of(study: optuna.Study) -> list[Row]:
    settings = settings_of(study)
    ref = reference_losses(study)
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
        config = a.get("config") or {}
        peak = int(a.get("peak_bytes") or 0)
        check = None
        if ref is not None and status == "ok" and a.get("losses"):
            check = check_loss(
                a["losses"], ref, is_exact(config), settings.loss_tolerance, settings.measured_steps
            )
        rows.append(
            Row(
                number=t.number,
                config=config,
                status=status,
                peak_bytes=peak,
                tokens_per_s=float(a.get("tokens_per_s") or 0.0),
                loss_regression=check.regression if check else None,
                loss_tolerance=check.tolerance if check else None,
                fits=status == "ok" and peak <= settings.budget_bytes,
                loss_ok=check.ok if check else None,
                role=a.get("role", ""),
                error=a.get("error", "") or (STALE if t.state == TrialState.FAIL else ""),
                duplicate_of=a.get("duplicate_of"),
                memory_breakdown=a.get("memory_breakdown") or None,
                predicted=bool(a.get("predicted", False)),
                stderr_tail=a.get("stderr_tail") or "",
                retry_of=(t.system_attrs.get("retry_history") or [None])[-1],
                rank_peaks=a.get("rank_peaks") or None,
                host_peak_bytes=int(a.get("host_peak_bytes") or 0),
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
            o.tokens_per_s >= r.tokens_per_s
            and o.peak_bytes <= r.peak_bytes
            and (o.tokens_per_s > r.tokens_per_s or o.peak_bytes < r.peak_bytes)
            for o in ran
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r.peak_bytes)


def select(study: optuna.Study) -> Selection:
    settings = settings_of(study)
    rows = rows_of(study)
    feasible = [r for r in rows if r.feasible and r.duplicate_of is None]
    winner = max(feasible, key=lambda r: r.tokens_per_s) if feasible else None
    measured = [r for r in rows if r.status in ("ok", "oom") and r.peak_bytes > 0]
    closest = None
    if winner is None and measured:
        closest = min(measured, key=lambda r: r.peak_bytes)
    return Selection(rows, winner, pareto_front(rows), closest, settings.budget_bytes)


def selection_json(study: optuna.Study) -> dict[str, Any]:
    """What ``autotune show --json`` prints: every trial, the winner, the Pareto front."""
    sel = select(study)
    settings = settings_of(study)
    rows = []
    for r in sel.rows:
        d = asdict(r)
        d["feasible"] = r.feasible
        rows.append(d)
    return {
        "study": study.study_name,
        "model": settings.model,
        "budget_bytes": sel.budget_bytes,
        "backend": settings.backend,
        "winner": sel.winner.number if sel.winner else None,
        "closest": sel.closest.number if sel.closest else None,
        "pareto": [r.number for r in sel.pareto],
        "trials": rows,
    }
