"""Finalists re-measured, interleaved, before a winner is declared.

The configurations of a class group within the noise of its fastest (``selector.decide``) are
run again, round-robin (A B C A B C ...), so a slow minute of the machine hits every finalist
alike rather than the one that happened to run during it. Their tokens/s are stored in the
study's ``remeasured`` user attr (trial number -> list) and the selector decides on the median
of each finalist's samples, with their range as its noise.
"""

from __future__ import annotations

import optuna

from autotune.runner import TrialRunner
from autotune.selector import select
from autotune.study import settings_of

#: re-measurement rounds per finalist, and the most finalists re-measured per class group
CONFIRM_ROUNDS = 2
MAX_FINALISTS = 4


def finalists(study: optuna.Study) -> list[list[int]]:
    """Per class group with a tie, the trial numbers not re-measured yet (fastest first)."""
    done = study.user_attrs.get("remeasured") or {}
    out = []
    for result in select(study).classes.values():
        rows = sorted(result.contenders, key=lambda r: -r.speed)[:MAX_FINALISTS]
        if len(rows) > 1 and any(str(r.number) not in done for r in rows):
            out.append([r.number for r in rows])
    return out


def remeasure(study: optuna.Study, runner: TrialRunner, rounds: int = CONFIRM_ROUNDS) -> int:
    """Re-measure every group's finalists, interleaved; returns how many jobs ran."""
    settings = settings_of(study)
    configs = {t.number: t.user_attrs["config"] for t in study.get_trials(deepcopy=False)}
    ran = 0
    for numbers in finalists(study) if rounds > 0 else []:
        samples: dict[str, list[float]] = {str(n): [] for n in numbers}
        for i in range(rounds):
            for n in numbers:
                spec = settings.spec(configs[n], settings.budget_bytes)
                result = runner.run(spec, f"confirm-{n}-{i}")
                ran += 1
                if result.status == "ok":
                    samples[str(n)].append(result.tokens_per_s)
        stored = dict(study.user_attrs.get("remeasured") or {})
        stored.update({n: s for n, s in samples.items() if s})
        study.set_user_attr("remeasured", stored)
    return ran
