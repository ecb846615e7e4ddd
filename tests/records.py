"""Trial records written by hand into a real Optuna study (real SQLite), as the objective
stores them, for the decision tests that read the answer back from raw records."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

MB = 2**20


def add_record(
    study: optuna.Study,
    config: dict[str, Any],
    *,
    fidelity: str,
    status: str = "ok",
    peak: int = 100 * MB,
    tps: float = 1000.0,
    spread: float = 0.01,
    verdict_ok: bool | None = True,
    **attrs: Any,
) -> int:
    """One finished trial; ``status`` ok | oom | failed (a failed one is a FAIL trial with no
    peak and no speed); returns its number."""
    a: dict[str, Any] = {
        "config": config,
        "fidelity": fidelity,
        "status": status,
        "peak_bytes": peak if status != "failed" else 0,
        "tokens_per_s": tps if status != "failed" else 0.0,
        "step_spread": spread,
        **attrs,
    }
    if status == "ok" and verdict_ok is not None:
        a["loss_verdict"] = {"via": "probe", "ok": verdict_ok, "regression": 0.0}
    state = TrialState.FAIL if status == "failed" else TrialState.COMPLETE
    values = [a["tokens_per_s"], a["peak_bytes"] / MB] if state == TrialState.COMPLETE else None
    study.add_trial(optuna.trial.create_trial(state=state, values=values, user_attrs=a))
    return study.trials[-1].number


def memory_study(name: str, budget_bytes: int, allow: str = "adapters") -> optuna.Study:
    """An empty tiny-llama study (no space) in Optuna's in-memory storage: the random-study
    oracle tests make hundreds of them."""
    from autotune.study import StudySettings, create_or_load

    settings = StudySettings(
        model="tiny-llama",
        model_config={},
        budget_bytes=budget_bytes,
        budget_label=f"{budget_bytes // MB}MB",
        backend="cpu",
        seq_len=64,
        global_batch_size=8,
        space={},
        allow=allow,
    )
    return create_or_load(optuna.storages.InMemoryStorage(), name, settings)  # type: ignore[arg-type]
