"""The ablation ladder: from the plain baseline to the winner, one technique at a time.

The baseline is plain training: fp32, no checkpointing, default attention, AdamW, no ZeRO, and
the whole global batch in one micro-batch (each technique's ``Knob.baseline``, or
``baseline_of``). A *technique* is one dimension on which the winner differs from the
baseline (a dimension that exists only under a condition, such as
``checkpoint_every``, travels with the one it depends on). Each rung adds the technique that
helps most from the rung below, greedily, judged by measurement: while the configuration is
over the budget, the one that saves the most memory; once it fits, the one that is fastest and
still fits. Every candidate is a real trial in the study (``role=ladder``, run without the
budget so an over-budget peak is the true one); trials that already measured a configuration
are reused. Measuring all candidates of a rung also shows each technique's saving on the
baseline alone, next to its saving where it is finally added: the interactions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from autotune.display import describe
from autotune.errors import UserError
from autotune.selector import Row, rows_of, select
from autotune.space import Choice, SearchSpace
from autotune.study import UNBOUNDED_ROLES, settings_of
from autotune.terminal import shell_line
from autotune.units import format_size
from trials.techniques import TECHNIQUES

#: rounds of measuring one rung's candidates before ``run_ladder`` gives up
MAX_ROUNDS = 16


@dataclass
class Step:
    """One rung: the techniques applied so far (in the order they were added) and its trial."""

    techniques: tuple[str, ...]
    config: dict[str, Any]
    row: Row | None
    added: str = ""  # label of the technique this rung adds ("" for the baseline)
    #: peak saving of the same technique applied to the baseline alone (for rungs above the first)
    alone_saving: int | None = None
    loss_delta: float | None = None  # the stored loss verdict's relative regression

    @property
    def measured(self) -> bool:
        return self.row is not None and self.row.status in ("ok", "oom") and self.row.peak_bytes > 0

    @property
    def estimated(self) -> bool:
        return self.row is not None and self.row.predicted


@dataclass
class Ladder:
    baseline: dict[str, Any]
    target: Row | None  # the winner the ladder climbs to
    steps: list[Step]
    budget_bytes: int
    #: configurations still to measure before the next rung can be decided
    missing: list[dict[str, Any]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing and all(s.row is not None for s in self.steps)


class _NotAllowed(Exception):
    pass


def baseline_config(space: SearchSpace, global_batch_size: int) -> dict[str, Any]:
    """Plain training within the space: each dimension's no-technique value where allowed."""

    baseline = TECHNIQUES.baseline()

    def pick(name: str, choices: list[Choice]) -> Choice:
        dim = name.split("|", 1)[0]
        knob = TECHNIQUES.knob(dim)
        if knob is not None and knob.baseline_of is not None:
            return knob.baseline_of(choices, global_batch_size)
        wanted = baseline.get(dim, space.reference.get(dim, choices[0]))
        return wanted if wanted in choices else choices[0]

    return space.sample(pick)


def _technique_dims(space: SearchSpace) -> list[str]:
    return [d.name for d in space.dimensions if not d.when]


def compose(
    space: SearchSpace, baseline: dict[str, Any], target: dict[str, Any], applied: Sequence[str]
) -> dict[str, Any] | None:
    """The baseline with the ``applied`` dimensions set to the target's values, if the rules
    allow it (dependent dimensions follow the target where it has them)."""
    top = set(_technique_dims(space))

    def pick(name: str, choices: list[Choice]) -> Choice:
        dim = name.split("|", 1)[0]
        if dim in top and dim not in applied:
            wanted = baseline.get(dim)
        else:
            wanted = target.get(dim, baseline.get(dim, choices[0]))
        if wanted not in choices:
            raise _NotAllowed
        return wanted  # type: ignore[no-any-return]

    try:
        return space.sample(pick)
    except _NotAllowed:
        return None


def _has_true_peak(row: Row) -> bool:
    return row.status == "ok" or row.role in UNBOUNDED_ROLES or row.predicted


def make_lookup(rows: list[Row]) -> Callable[[dict[str, Any]], Row | None]:
    """config -> the trial that measured it: measured before estimated, original before copy;
    a trial stopped by the budget (its peak is not the true one) does not count."""
    usable = [
        r for r in rows if r.status == "failed" or (r.status != "running" and _has_true_peak(r))
    ]
    usable.sort(key=lambda r: (r.status == "failed", r.predicted, r.duplicate_of is not None))

    def lookup(config: dict[str, Any]) -> Row | None:
        return next((r for r in usable if r.config == config), None)

    return lookup


def _fits(row: Row | None, budget: int) -> bool:
    return row is not None and row.status in ("ok", "oom") and 0 < row.peak_bytes <= budget


def _helps(row: Row | None, current: Row | None, budget: int) -> tuple[float, float, float]:
    """Sort key, larger is better: over budget, the biggest saving; within it, the fastest fit."""
    if row is None or row.status == "failed" or row.peak_bytes <= 0:
        return (0.0, 0.0, 0.0)
    if not _fits(current, budget):
        return (1.0, -float(row.peak_bytes), row.tokens_per_s)
    if _fits(row, budget):
        return (2.0, row.tokens_per_s, -float(row.peak_bytes))
    return (1.0, -float(row.peak_bytes), row.tokens_per_s)


def _label(space: SearchSpace, config: dict[str, Any], dim: str) -> str:
    deps = [d.name for d in space.dimensions if dim in d.when and d.name in config]
    text = describe({k: config[k] for k in (dim, *deps) if k in config})
    return text or f"{dim}={config.get(dim)}"


def build_ladder(
    study: optuna.Study, space: SearchSpace, target: dict[str, Any] | None = None
) -> Ladder:
    """The ladder to ``target`` (default: the current winner) from what the study holds
    (nothing is run here)."""
    settings = settings_of(study)
    budget = settings.budget_bytes
    rows = rows_of(study)
    winner = select(study).winner if target is None else None
    baseline = baseline_config(space, settings.global_batch_size)
    lookup = make_lookup(rows)

    def loss_delta(row: Row | None) -> float | None:
        # the trial's stored verdict (autotune/lossguard.py): per step against the reference
        # for exact rungs, the probe's regression for lossy ones
        return row.loss_regression if row is not None else None

    first = lookup(baseline)
    steps = [Step((), baseline, first, loss_delta=loss_delta(first))]
    # the next round measures the baseline (if needed) and the first undecided rung's candidates
    missing: list[dict[str, Any]] = [] if first is not None else [baseline]
    decided_up_to_here = True
    if target is None and winner is None:
        return Ladder(baseline, None, steps, budget, missing)
    if target is None:
        assert winner is not None
        target = winner.config
    top = lookup(target) if winner is None else winner
    remaining = [d for d in _technique_dims(space) if target.get(d) != baseline.get(d)]
    applied: list[str] = []
    alone: dict[str, Row | None] = {}
    current = first
    while remaining:
        candidates = []
        for dim in remaining:
            config = compose(space, baseline, target, [*applied, dim])
            if config is not None:
                candidates.append((dim, config, lookup(config)))
        if not candidates:  # the rules allow no single step: take the rest at once
            config = dict(target)
            candidates = [("+".join(remaining), config, lookup(config))]
            chosen_dims = list(remaining)
        else:
            chosen_dims = []
        if not applied:
            alone = {dim: row for dim, _, row in candidates}
        unmeasured = [config for _, config, row in candidates if row is None]
        if unmeasured and decided_up_to_here:
            missing.extend(unmeasured)
            decided_up_to_here = False
        dim, config, row = max(candidates, key=lambda c: _helps(c[2], current, budget))
        added = chosen_dims or [dim]
        applied.extend(added)
        for d in added:
            remaining.remove(d)
        alone_row = alone.get(dim) if len(applied) > 1 else None
        saving = None
        if alone_row is not None and first is not None and _has_true_peak(alone_row):
            saving = first.peak_bytes - alone_row.peak_bytes
        steps.append(
            Step(
                tuple(applied),
                config,
                row,
                added=" ".join(_label(space, config, d) for d in added),
                alone_saving=saving,
                loss_delta=loss_delta(row),
            )
        )
        current = row
    if steps[-1].row is None and steps[-1].config not in missing and decided_up_to_here:
        missing.append(steps[-1].config)  # the target itself has not run yet
    return Ladder(baseline, top, steps, budget, missing)


def run_ladder(
    study: optuna.Study,
    space: SearchSpace,
    optimize: Callable[[int], None],
    max_rounds: int = MAX_ROUNDS,
    target: dict[str, Any] | None = None,
) -> Ladder:
    """Measure the rungs the ladder still lacks, one rung's candidates at a time.

    ``optimize(n)`` runs the next ``n`` trials of the study (the enqueued ladder configs).
    The winner may change when a rung is faster than it and fits: the ladder then climbs
    to the new winner, so this repeats until nothing is missing. With ``target`` (a config of
    the space) it climbs to that configuration instead.
    """
    if target is None and select(study).winner is None:
        raise UserError(
            f"study '{study.study_name}' has no trial that fits the budget yet: "
            "no winner to climb to (run more trials first)"
        )
    for _ in range(max_rounds):
        ladder = build_ladder(study, space, target)
        if ladder.complete:
            return ladder
        for config in ladder.missing:
            study.enqueue_trial(space.params_for(config), user_attrs={"role": "ladder"})
        optimize(len(ladder.missing))
    return build_ladder(study, space, target)


def _change(value: float | None, below: float | None, sized: bool = False) -> str:
    """``value`` against the rung below, signed: ``-38.0 MiB (-21%)`` or ``+12%``."""
    if not value or not below:
        return "-"
    pct = f"{(value - below) / below:+.0%}"
    if not sized:
        return pct
    diff = value - below
    return f"{'+' if diff >= 0 else '-'}{format_size(abs(int(diff)))} ({pct})"


def ladder_cells(ladder: Ladder) -> list[dict[str, str]]:
    """The ladder as table cells (shared by the terminal, markdown and HTML tables)."""
    out: list[dict[str, str]] = []
    prev: Step | None = None
    for i, step in enumerate(ladder.steps):
        row = step.row
        ok = step.measured and row is not None
        peak = row.peak_bytes if ok and row is not None else None
        prev_peak = prev.row.peak_bytes if prev is not None and prev.measured and prev.row else None
        tps = row.tokens_per_s if ok and row is not None and row.tokens_per_s > 0 else None
        prev_tps = prev.row.tokens_per_s if prev is not None and prev.measured and prev.row else 0
        if row is None:
            trial = "to measure"
        elif row.status == "failed":
            trial = f"#{row.number} failed"
        else:
            trial = f"#{row.number}" + (" estimated" if row.predicted else "")
        out.append(
            {
                "step": str(i),
                "adds": "baseline" if i == 0 else f"+{step.added}",
                "peak": format_size(peak) if peak else "-",
                "fits": "yes" if peak and peak <= ladder.budget_bytes else ("no" if peak else "-"),
                "peak_change": _change(peak, prev_peak, sized=True),
                "alone": format_size(step.alone_saving) if step.alone_saving is not None else "-",
                "tok/s": f"{tps:,.0f}" if tps else "-",
                "speed_change": _change(tps, prev_tps or None),
                "loss": f"{step.loss_delta * 100:+.2f}%" if step.loss_delta is not None else "-",
                "trial": trial,
            }
        )
        prev = step
    return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pending_note(ladder: Ladder, trial_seconds: Sequence[float], study_name: str) -> str:
    """Which rungs are still to be measured and about how long that takes, from the wall times
    of the study's measured trials (their median); "" when the ladder is complete."""
    todo = [i for i, s in enumerate(ladder.steps) if s.row is None]
    if ladder.target is None or (not todo and not ladder.missing):
        return ""
    last = len(ladder.steps) - 1
    # the next round measures the first undecided rung's candidates; each later rung i has at
    # most one candidate per technique not yet applied (last - i + 1); some may exist already
    later = sum(last - i + 1 for i in todo[1:]) if todo else 0
    at_most = len(ladder.missing) + later
    rungs = ", ".join(str(i) for i in todo) or "none"
    text = f"Rungs still to measure: {rungs}. The next round runs {len(ladder.missing)} trial(s)"
    if trial_seconds:
        each = sorted(trial_seconds)[len(trial_seconds) // 2]
        text += f" (about {_duration(each * len(ladder.missing))} at {_duration(each)} per trial"
        text += f", the median of this study's {len(trial_seconds)} measured trials)"
        if later:
            text += (
                f"; the whole ladder at most {at_most} trials, about {_duration(each * at_most)}"
            )
    elif later:
        text += f"; the whole ladder at most {at_most} trials"
    command = shell_line(["autotune", "resume", "--study", study_name, "--trials", "0", "--ladder"])
    return text + f". Measure them with: {command}"
