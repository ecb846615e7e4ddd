"""Speeds taken at different moments never name the winner: the fastest feasible configurations
of each class group are re-measured side by side (each round in the reverse order of the one
before) and the selector decides on those samples alone.

The machine is a stand-in here, on purpose: its load is the thing under test and a real load
can't be replayed. ``LoadedMachine`` answers each run with the configuration's true speed (set
in the test) times the machine's speed at that moment (a schedule set in the test); the oracle
is the true speeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.finalists import MAX_FINALISTS, finalists, order, remeasure
from autotune.lossguard import LossVerdict
from autotune.runner import TrialRunner
from autotune.selector import select
from autotune.study import DEFAULT_ALLOW
from tests.studies import records_study
from trials.spec import TrialResult, TrialSpec
from trials.techniques import fidelity_class

MB = 2**20
PLAIN = {"gradient_checkpointing": "off", "precision": "fp32", "optimizer": "adamw"}
#: the reference: everything offloaded, the simplest to name in a tie
REFERENCE = {**PLAIN, "gradient_checkpointing": "full", "zero_stage": 3, "offload_optimizer": "cpu"}
FAST = {**PLAIN, "micro_batch_size": 8}


class LoadedMachine(TrialRunner):
    """Each run's tokens/s: the configuration's true speed times the machine's speed at that
    run (``moments``, one per run, in order)."""

    def __init__(self, true: dict[str, float], moments: list[float]) -> None:
        self.true, self.moments, self.ran = true, moments, []  # type: ignore[var-annotated]

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        key = repr(sorted(spec.config.items()))
        self.ran.append(name)
        factor = self.moments[len(self.ran) - 1]
        return TrialResult(status="ok", tokens_per_s=self.true[key] * factor, losses=[1.0])


def _key(config: dict[str, Any]) -> str:
    return repr(sorted(config.items()))


def _study(tmp_path: Path) -> optuna.Study:
    return records_study(
        f"sqlite:///{tmp_path / 'db.sqlite'}", "s", 200 * MB, "200MB", allow=DEFAULT_ALLOW
    )


def _add(study: optuna.Study, config: dict[str, Any], tps: float) -> int:
    trial = optuna.trial.create_trial(
        values=[tps, 100],
        user_attrs={
            "config": config,
            "fidelity": fidelity_class(config),
            "status": "ok",
            "peak_bytes": 100 * MB,
            "tokens_per_s": tps,
            "step_spread": 0.01,
            "loss_verdict": LossVerdict("reference", True, 1e-6, 1e-3).to_attrs(),
        },
    )
    study.add_trial(trial)
    return study.trials[-1].number


def test_rounds_alternate_their_order() -> None:
    assert order([7, 3, 5], 3) == [
        (0, 7), (0, 3), (0, 5), (1, 5), (1, 3), (1, 7), (2, 7), (2, 3), (2, 5),
    ]  # fmt: skip


def test_a_trial_timed_in_a_quiet_minute_does_not_win(tmp_path: Path) -> None:
    """The reference ran while the machine was idle and measured 4.78x the speed of the trial
    that ran under load; side by side the other configuration is 8% faster (true speeds), and
    the re-measurement's drift (2% slower each run) favours neither."""
    study = _study(tmp_path)
    ref = _add(study, REFERENCE, 4780.0)
    fast = _add(study, FAST, 1000.0)
    assert select(study).winner.number == ref  # type: ignore[union-attr]  # before: the moment
    assert finalists(study) == [[ref, fast]]  # not within the noise, re-measured all the same
    machine = LoadedMachine({_key(REFERENCE): 1000.0, _key(FAST): 1080.0}, [1.0, 0.98, 0.96, 0.94])
    assert remeasure(study, machine, rounds=2) == 4
    assert machine.ran == [f"confirm-{ref}-0", f"confirm-{fast}-0", f"confirm-{fast}-1",
                           f"confirm-{ref}-1"]  # fmt: skip
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == fast and not sel.ties
    # each speed is the median of its own re-measurements (hand computed), not of its trial
    by_number = {r.number: r for r in sel.rows}
    assert by_number[fast].speed == pytest.approx((1080 * 0.98 + 1080 * 0.96) / 2)
    assert by_number[ref].speed == pytest.approx((1000 * 1.0 + 1000 * 0.94) / 2)
    assert finalists(study) == []  # nothing left to re-measure


def test_only_the_fastest_are_finalists_and_stale_samples_go(tmp_path: Path) -> None:
    """The ``MAX_FINALISTS`` fastest by their own measurement; a later re-measurement of the
    group replaces every earlier sample of it (taken at another moment)."""
    study = _study(tmp_path)
    numbers = [_add(study, {**PLAIN, "micro_batch_size": mb}, 1000.0 + mb) for mb in range(6)]
    (top,) = finalists(study)
    assert top == sorted(numbers, reverse=True)[:MAX_FINALISTS]
    study.set_user_attr("remeasured", {str(numbers[0]): [5.0]})  # an older session's sample
    true = {_key({**PLAIN, "micro_batch_size": mb}): 100.0 * (mb + 1) for mb in range(6)}
    remeasure(study, LoadedMachine(true, [1.0] * 8), rounds=2)
    stored = study.user_attrs["remeasured"]
    assert sorted(stored) == sorted(str(n) for n in top)
    assert all(len(v) == 2 for v in stored.values())
    sel = select(study)  # decided among the re-measured: the truly fastest of them
    assert sel.winner is not None and sel.winner.number == numbers[5]


def test_a_single_feasible_configuration_is_not_re_measured(tmp_path: Path) -> None:
    study = _study(tmp_path)
    _add(study, REFERENCE, 1000.0)
    assert finalists(study) == []
    assert remeasure(study, LoadedMachine({}, []), rounds=2) == 0


def test_one_round_keeps_the_first_measurement_as_the_noise(tmp_path: Path) -> None:
    """One round gives one sample per finalist: no spread of its own. The speed is still the
    side-by-side sample (1080 against 1000: 8%, beyond the 5% floor), but the noise is the range
    over the trial's own measurement and it (4780 against 1000: 378%), so the answer is a tie,
    said as one, never a winner named on a single sample of a loaded machine."""
    study = _study(tmp_path)
    ref = _add(study, REFERENCE, 4780.0)
    fast = _add(study, FAST, 1000.0)
    remeasure(study, LoadedMachine({_key(REFERENCE): 1000.0, _key(FAST): 1080.0}, [1.0, 1.0]), 1)
    sel = select(study)
    result = sel.classes["full"]
    assert {r.number for r in result.contenders} == {ref, fast}
    assert result.margin == pytest.approx(3.78)
