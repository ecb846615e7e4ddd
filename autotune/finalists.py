"""Finalists re-measured side by side before a winner is declared.

A trial's own tokens/s was taken at its own moment; on a machine whose load varies, a trial
that ran during a quiet minute looks several times faster than one that ran during a busy one.
So the speeds that name a winner are never taken at different moments: in each class group the
``MAX_FINALISTS`` fastest feasible configurations (by their own measurement) are run again,
interleaved, each round in the opposite order of the one before (A B C C B A ...), so a slow
minute of the machine, or a drift over the whole re-measurement, hits every finalist alike.
Their tokens/s are stored in the study's ``remeasured`` user attr (trial number -> list) and the
selector (``autotune/selector.py``) decides among the re-measured configurations on these
samples alone, with their range as the noise.

Each re-measurement is bounded like a trial (``autotune.trial_cost``), from the finalist's own
measured step rather than a prediction: as many measured steps as fit a minute of it (at least
three, at most the trial's own), and a time limit of four times all its steps (within the
study's floor and the trial's own limit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna

from autotune.runner import TrialRunner
from autotune.selector import GROUPS, rows_of
from autotune.study import settings_of
from autotune.trial_cost import (
    MEASURED_STEPS_ATTR,
    TIMEOUT_ATTR,
    measured_steps_for,
    timeout_for,
)

#: re-measurement rounds per finalist, and the most finalists re-measured per class group
CONFIRM_ROUNDS = 2
MAX_FINALISTS = 3


def finalists(study: optuna.Study) -> list[list[int]]:
    """Per class group with two or more feasible configurations, the ``MAX_FINALISTS`` fastest
    by their own measurement (fastest first), where they were not re-measured together yet."""
    done = study.user_attrs.get("remeasured") or {}
    rows = [r for r in rows_of(study) if r.duplicate_of is None and not r.predicted]
    out = []
    for members in GROUPS.values():
        feasible = [r for r in rows if r.fidelity in members and r.feasible]
        top = sorted(feasible, key=lambda r: (-r.tokens_per_s, r.number))[:MAX_FINALISTS]
        if len(top) > 1 and any(str(r.number) not in done for r in top):
            out.append([r.number for r in top])
    return out


def _group_of(study: optuna.Study, numbers: list[int]) -> set[str]:
    """Every trial number (as stored) of the class group these finalists belong to."""
    rows = rows_of(study)
    fidelity = next(r.fidelity for r in rows if r.number == numbers[0])
    members = next(m for m in GROUPS.values() if fidelity in m)
    return {str(r.number) for r in rows if r.fidelity in members}


def order(numbers: list[int], rounds: int) -> list[tuple[int, int]]:
    """(round, trial number) in run order: each round the reverse of the one before."""
    out = []
    for i in range(rounds):
        for n in numbers if i % 2 == 0 else reversed(numbers):
            out.append((i, n))
    return out


def confirm_cost(
    attrs: dict[str, Any],
    most_steps: int,
    warmup_steps: int,
    ceiling_s: float | None,
    floor_s: float,
) -> tuple[int, float | None]:
    """(measured steps, time limit) of one re-measurement of the trial whose user attrs are
    ``attrs``: from its measured step (``step_time_s``) as ``trial_cost`` bounds a trial from a
    predicted one, within its own steps (else ``most_steps``) and its own limit (else
    ``ceiling_s``; None: the runner's)."""
    own = attrs.get(MEASURED_STEPS_ATTR)
    most = int(own) if isinstance(own, int) and own > 0 else most_steps
    limit = attrs.get(TIMEOUT_ATTR)
    ceiling = float(limit) if isinstance(limit, int | float) and limit > 0 else ceiling_s
    step = attrs.get("step_time_s")
    if not isinstance(step, int | float) or step <= 0:
        return most, ceiling
    steps = measured_steps_for(float(step), most)
    if ceiling is None:
        return steps, None
    return steps, timeout_for(float(step), warmup_steps + steps, ceiling, min(floor_s, ceiling))


def remeasure(
    study: optuna.Study,
    runner: TrialRunner,
    rounds: int = CONFIRM_ROUNDS,
    say: Callable[[str], None] | None = None,
) -> int:
    """Re-measure every group's finalists, interleaved; returns how many jobs ran. ``say`` hears
    a line before each job (what is being re-measured, and which run of how many)."""
    settings = settings_of(study)
    trials = {t.number: t.user_attrs for t in study.get_trials(deepcopy=False)}
    ran = 0
    for numbers in finalists(study) if rounds > 0 else []:
        samples: dict[str, list[float]] = {str(n): [] for n in numbers}
        runs = order(numbers, rounds)
        for k, (i, n) in enumerate(runs, 1):
            if say is not None:
                say(f"re-measuring the finalists side by side: #{n} ({k}/{len(runs)})")
            spec = settings.spec(trials[n]["config"], settings.budget_bytes)
            spec.measured_steps, spec.timeout_s = confirm_cost(
                trials[n],
                settings.measured_steps,
                settings.warmup_steps,
                getattr(runner, "timeout_s", None),
                settings.trial_timeout_floor_s,
            )
            result = runner.run(spec, f"confirm-{n}-{i}")
            ran += 1
            if result.status == "ok":
                samples[str(n)].append(result.tokens_per_s)
        # samples of one session only: a group's earlier re-measurements (another moment) go
        stale = _group_of(study, numbers)
        stored = {
            k: v for k, v in (study.user_attrs.get("remeasured") or {}).items() if k not in stale
        }
        stored.update({n: s for n, s in samples.items() if s})
        study.set_user_attr("remeasured", stored)
    return ran
