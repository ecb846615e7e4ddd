"""What the selector reads off a trial record, against the values written here (real SQLite,
real Optuna): every field of a row is the stored attribute or its documented default, the state
rules (a running trial is shown, a waiting one is not, a FAIL is ``failed`` whatever it stored,
a FAIL without a reason is a stopped controller) and the budget boundary (a peak equal to the
budget fits, one byte more does not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.selector import STALE, Row, rows_of
from tests.studies import records_study

BUDGET = 100_000_000
#: every attribute the trial job and the controller store, with values unlike any default
FULL: dict[str, Any] = {
    "config": {"precision": "bf16", "zero_stage": 2, "micro_batch_size": 2},
    "status": "ok",
    "peak_bytes": 81_234_567,
    "tokens_per_s": 1234.5,
    "loss_verdict": {"via": "reference", "ok": True, "regression": 3e-4, "tolerance": 1e-3},
    "memory_breakdown": {"parameters": 40_000_000, "host_offloaded": 7_000_000},
    "role": "finalist",
    "duplicate_of": 3,
    "predicted": True,
    "stderr_tail": "last words",
    "rank_peaks": [81_234_567, 80_000_001],
    "host_peak_bytes": 555_000_000,
    "fidelity": "mixed",
    "step_spread": 0.031,
    "load_per_core": 0.7,
    "construction_peak_bytes": 12_345,
    "training_peak_bytes": 81_000_000,
    "oom_rank": 1,
    "capped": True,
    "pruned_by_estimate": True,
    "error": "a stored reason",
}


def _study(tmp_path: Path, remeasured: dict[str, list[float]] | None = None) -> optuna.Study:
    study = records_study(f"sqlite:///{tmp_path / 'db.sqlite'}", "rows", BUDGET, "100MB")
    if remeasured is not None:
        study.set_user_attr("remeasured", remeasured)
    return study


def _add(study: optuna.Study, state: TrialState, attrs: dict[str, Any], **system: Any) -> int:
    values = [1.0, 1.0] if state == TrialState.COMPLETE else None
    trial = optuna.trial.create_trial(
        state=state, values=values, user_attrs=attrs, system_attrs=system
    )
    study.add_trial(trial)
    return study.trials[-1].number


def _row(study: optuna.Study, number: int) -> Row:
    (row,) = [r for r in rows_of(study) if r.number == number]
    return row


def test_every_field_is_the_stored_attribute(tmp_path: Path) -> None:
    study = _study(tmp_path, remeasured={"0": [1100.0, 1300.0]})
    n = _add(study, TrialState.COMPLETE, FULL, retry_history=[7, 9])
    row = _row(study, n)
    assert row.config == FULL["config"]
    assert row.status == "ok"
    assert row.peak_bytes == 81_234_567
    assert row.tokens_per_s == 1234.5
    assert row.loss_regression == 3e-4 and row.loss_tolerance == 1e-3
    assert row.loss_ok is True
    assert row.verdict is not None and row.verdict.via == "reference"
    assert row.fits is True
    assert row.role == "finalist"
    assert row.error == "a stored reason"
    assert row.duplicate_of == 3
    assert row.memory_breakdown == FULL["memory_breakdown"]
    assert row.predicted is True
    assert row.stderr_tail == "last words"
    assert row.retry_of == 9  # the last controller that died before this one
    assert row.rank_peaks == [81_234_567, 80_000_001]
    assert row.host_peak_bytes == 555_000_000
    assert row.fidelity == "mixed"
    assert row.step_spread == 0.031
    assert row.load_per_core == 0.7
    assert row.remeasured == [1100.0, 1300.0]
    assert row.speed == 1200.0  # the median of the re-measurements 1100 and 1300 alone
    assert row.construction_peak_bytes == 12_345
    assert row.training_peak_bytes == 81_000_000
    assert row.oom_rank == 1
    assert row.capped is True
    assert row.pruned_by_estimate is True


def test_defaults_of_a_bare_record(tmp_path: Path) -> None:
    study = _study(tmp_path)
    verdict = {"via": "probe", "ok": True, "regression": 0.0}  # stored, but the trial did not end
    n = _add(
        study,
        TrialState.COMPLETE,
        {"status": "oom", "config": {"precision": "fp32"}, "loss_verdict": verdict},
    )
    row = _row(study, n)
    assert row.status == "oom"
    assert (row.peak_bytes, row.tokens_per_s) == (0, 0.0)
    # no verdict is read for a trial that did not run to the end
    assert row.verdict is None and row.loss_ok is None
    assert row.loss_regression is None and row.loss_tolerance is None
    assert row.fits is False  # out of memory never fits, whatever its peak
    assert (row.role, row.error, row.stderr_tail) == ("", "", "")
    assert row.duplicate_of is None and row.memory_breakdown is None and row.rank_peaks is None
    assert row.retry_of is None and row.oom_rank is None
    assert row.predicted is False and row.capped is False and row.pruned_by_estimate is False
    assert (row.host_peak_bytes, row.construction_peak_bytes, row.training_peak_bytes) == (0, 0, 0)
    assert (row.step_spread, row.load_per_core, row.remeasured) == (0.0, 0.0, [])
    assert row.fidelity == "exact"  # computed from the configuration when not stored
    bf16 = _add(study, TrialState.COMPLETE, {"status": "ok", "config": {"precision": "bf16"}})
    assert _row(study, bf16).fidelity == "mixed"
    assert _row(study, bf16).verdict is None  # ran, but no verdict stored


def test_states_and_the_stopped_controller(tmp_path: Path) -> None:
    study = _study(tmp_path)
    running = _add(study, TrialState.RUNNING, {"status": "ok"})
    waiting = _add(study, TrialState.WAITING, {"status": "ok"})
    stored_ok = _add(study, TrialState.FAIL, {"status": "ok", "peak_bytes": 10})
    reason = _add(study, TrialState.FAIL, {"status": "failed", "error": "CUDA error"})
    pruned = _add(study, TrialState.PRUNED, {"status": "pruned"})
    nothing = _add(study, TrialState.COMPLETE, {})
    numbers = [r.number for r in rows_of(study)]
    assert waiting not in numbers
    assert numbers == [running, stored_ok, reason, pruned, nothing]
    assert _row(study, running).status == "running"
    assert _row(study, running).error == ""
    assert _row(study, stored_ok).status == "failed"
    assert _row(study, stored_ok).error == STALE
    assert _row(study, stored_ok).fits is False
    assert _row(study, reason).error == "CUDA error"
    assert _row(study, pruned).status == "pruned"
    assert _row(study, pruned).error == ""
    assert _row(study, nothing).status == "failed"  # no status stored: not a success


@pytest.mark.parametrize(("peak", "fits"), [(BUDGET, True), (BUDGET + 1, False), (0, True)])
def test_fits_is_peak_within_the_study_budget(tmp_path: Path, peak: int, fits: bool) -> None:
    study = _study(tmp_path)
    n = _add(study, TrialState.COMPLETE, {"status": "ok", "peak_bytes": peak})
    assert _row(study, n).fits is fits


def test_host_memory_falls_back_to_the_offloaded_bytes(tmp_path: Path) -> None:
    study = _study(tmp_path)
    breakdown = {"parameters": 1, "host_offloaded": 4321}
    old = _add(study, TrialState.COMPLETE, {"status": "ok", "memory_breakdown": breakdown})
    assert _row(study, old).host_peak_bytes == 4321
    measured = _add(
        study,
        TrialState.COMPLETE,
        {"status": "ok", "host_peak_bytes": 99, "memory_breakdown": {"host_offloaded": 4321}},
    )
    assert _row(study, measured).host_peak_bytes == 99


def test_remeasurements_are_matched_by_trial_number(tmp_path: Path) -> None:
    study = _study(tmp_path, remeasured={"1": [10.0, 30.0]})
    first = _add(study, TrialState.COMPLETE, {"status": "ok", "tokens_per_s": 20.0})
    second = _add(study, TrialState.COMPLETE, {"status": "ok", "tokens_per_s": 50.0})
    assert _row(study, first).remeasured == []
    assert _row(study, second).remeasured == [10.0, 30.0]
    assert _row(study, second).speed == 20.0  # the re-measurements' median, not its own 50
    rejected = _add(
        study,
        TrialState.COMPLETE,
        {"status": "ok", "loss_verdict": {"via": "probe", "ok": False, "regression": 0.2}},
    )
    assert _row(study, rejected).loss_ok is False
    assert _row(study, rejected).loss_regression == 0.2
    assert _row(study, rejected).feasible is False
