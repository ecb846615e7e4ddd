"""Each sampler rule alone, on a real Optuna study (no training): trials other workers are
running are not planned again, an enqueued trial reserves nothing, a failed configuration is
never proposed again, and an identical proposal reuses the earlier result instead of running."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.availability import Hardware
from autotune.runner import TrialRunner
from autotune.space import SearchSpace
from autotune.strategy import AutotuneSampler, Observation, observations
from autotune.study import Objective
from tests.studies import make_study
from tests.test_strategy import BUDGET, GRID, SPACE, prior
from trials.spec import TrialResult, TrialSpec


def _study(sampler: AutotuneSampler) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)


def _config(study: optuna.Study, trial: optuna.Trial) -> dict:
    return SPACE.sample(trial.suggest_categorical)  # type: ignore[arg-type]


def test_trials_running_elsewhere_are_not_planned_again() -> None:
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    study = _study(sampler)
    first, second = study.ask(), study.ask()  # two workers ask before either tells
    a, b = _config(study, first), _config(study, second)
    assert a == sampler.plan([])  # the best-looking candidate
    assert b == sampler.plan([Observation(a, "running", 0.0, 0.0)])  # the next one
    assert a != b


def test_an_enqueued_trial_reserves_nothing() -> None:
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    study = _study(sampler)
    reference = SPACE.reference_config()
    assert reference != sampler.plan([])
    study.enqueue_trial(SPACE.params_for(reference))
    queued = study.ask()
    assert _config(study, queued) == reference
    # the next worker still gets the best-looking candidate: the enqueued trial did not plan
    assert _config(study, study.ask()) == sampler.plan([])


def test_a_failed_configuration_is_never_proposed_again() -> None:
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    best = sampler.plan([])
    failed = Observation(best, "failed", 0.0, 0.0)
    history = [failed]
    for _ in range(30):
        plan = sampler.plan(history)
        assert plan is not None and plan != best
        history.append(Observation(plan, "ok", *prior(plan)))


def test_an_oom_is_learned_and_a_predicted_oom_is_not() -> None:
    """A measured OOM rules out the configurations needing no less memory; an OOM the
    pre-screen predicted (never run) rules out only itself."""
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    best = sampler.plan([])
    bigger = {**best, "micro_batch_size": 16} if best["micro_batch_size"] < 16 else None
    measured = sampler.plan([Observation(best, "oom", BUDGET, 0.0)])
    predicted = sampler.plan([Observation(best, "predicted_oom", 0.0, 0.0)])
    assert measured != best and predicted != best
    if bigger is not None and bigger in GRID:
        implied = [Observation(best, "oom", BUDGET, 0.0)]
        for _ in range(len(GRID) // 2):
            plan = sampler.plan(implied)
            assert plan != bigger
            implied.append(Observation(plan, "ok", *prior(plan)))


class CountingRunner(TrialRunner):
    """A finished trial's numbers for any spec, counting the runs."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        self.runs += 1
        return TrialResult(
            status="ok", peak_bytes=50 * 2**20, tokens_per_s=1234.0, losses=[2.0, 1.9]
        )


def test_an_identical_proposal_reuses_the_earlier_result(tmp_path: Path) -> None:
    space_file = tmp_path / "space.yaml"
    space_file.write_text(
        "dimensions:\n  gradient_checkpointing: {choices: [full]}\n"
        "  micro_batch_size: {choices: [1, 2]}\n"
        "reference: {gradient_checkpointing: full, micro_batch_size: 1}\n"
    )
    study = make_study(f"sqlite:///{tmp_path / 'db.sqlite'}", "dup", space_file)
    space = SearchSpace.load(space_file).resolve(8, Hardware(backend="cpu"))
    runner = CountingRunner()
    objective = Objective(study, space, runner)
    config = {"gradient_checkpointing": "full", "micro_batch_size": 2}
    for _ in range(2):
        study.enqueue_trial(space.params_for(config))
    study.optimize(objective, n_trials=2)
    first, second = study.trials
    assert runner.runs == 1
    assert second.user_attrs["duplicate_of"] == first.number
    assert second.state == TrialState.COMPLETE
    assert second.user_attrs["tokens_per_s"] == first.user_attrs["tokens_per_s"] == 1234.0
    assert second.user_attrs["peak_bytes"] == first.user_attrs["peak_bytes"]


def test_observations_are_the_finished_records() -> None:
    """What the sampler learns from: completed trials with a configuration and a measured
    status, each field as stored; an estimator-pruned OOM is a ``predicted_oom`` (it implies
    nothing about other configurations)."""
    study = _study(AutotuneSampler(GRID, prior, BUDGET))
    cfg = {"precision": "bf16", "micro_batch_size": 2}

    def add(state: TrialState, attrs: dict) -> None:
        values = [1.0, 1.0] if state == TrialState.COMPLETE else None
        study.add_trial(optuna.trial.create_trial(state=state, values=values, user_attrs=attrs))

    add(
        TrialState.COMPLETE,
        {
            "config": cfg,
            "status": "ok",
            "peak_bytes": 123,
            "tokens_per_s": 4.5,
            "loss_regression": 0.25,
        },
    )
    add(TrialState.COMPLETE, {"config": cfg, "status": "oom", "peak_bytes": 77})
    add(TrialState.COMPLETE, {"config": cfg, "status": "oom", "pruned_by_estimate": True})
    add(TrialState.COMPLETE, {"config": cfg, "status": "failed"})
    add(TrialState.COMPLETE, {"config": cfg, "status": "pruned"})  # not a measurement
    add(TrialState.COMPLETE, {"status": "ok", "peak_bytes": 1})  # no configuration stored
    add(TrialState.FAIL, {"config": cfg, "status": "ok", "peak_bytes": 1})  # controller died
    add(TrialState.RUNNING, {"config": cfg, "status": "ok"})
    got = observations(study)
    assert [o.status for o in got] == ["ok", "oom", "predicted_oom", "failed"]
    assert all(o.config == cfg for o in got)
    assert (got[0].peak_bytes, got[0].tokens_per_s, got[0].loss_regression) == (123.0, 4.5, 0.25)
    assert (got[1].peak_bytes, got[1].tokens_per_s, got[1].loss_regression) == (77.0, 0.0, None)
    assert got[2].peak_bytes == 0.0


def test_a_configuration_killed_at_the_trial_timeout_is_not_planned_again() -> None:
    """A trial the runner killed at its timeout (Optuna FAIL, the runner's error) counts as
    tried: the next plan is the one after it, as if it had been measured running; a trial
    that failed otherwise in Optuna (its worker died) is planned again."""
    sampler = AutotuneSampler(GRID, prior, BUDGET)
    study = _study(sampler)
    first = sampler.plan([])
    trial = study.ask()
    assert _config(study, trial) == first
    trial.set_user_attr("config", first)
    trial.set_user_attr("status", "failed")
    trial.set_user_attr("error", "timed out after 600s")
    study.tell(trial, state=TrialState.FAIL)
    assert [o.status for o in observations(study)] == ["timeout"]
    expected = sampler.plan([Observation(first, "running", 0.0, 0.0)])
    assert expected != first
    assert _config(study, study.ask()) == expected
