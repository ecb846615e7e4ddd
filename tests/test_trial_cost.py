"""A trial's cost bounded by design, each decision against a hand computation: which loss
reference (the exact configuration predicted to fit with the shortest step), how many measured
steps (as many as fit a minute of predicted time, at least three), which time limit (4x the
predicted time of all its steps, within the floor and the ceiling), the calibration of the
predicted step by the study's own measurements; and a real CLI study whose derived time limit
is hit and recorded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from autotune.finalists import confirm_cost
from autotune.trial_cost import (
    Calibration,
    TrialCosts,
    measured_steps_for,
    reference_for_cost,
    timeout_for,
)
from tests.conftest import DATA
from tests.studies import make_study

ROOT = Path(__file__).resolve().parent.parent


def test_fewer_measured_steps_where_the_step_is_predicted_slow() -> None:
    # a minute of predicted time: 60 // 5 = 12 -> the study's 6; 60 // 15 = 4; 60 // 25 = 2,
    # below the least of 3; a 100 s step: 3; no prediction: the study's count
    assert measured_steps_for(5.0, 6) == 6
    assert measured_steps_for(15.0, 6) == 4
    assert measured_steps_for(25.0, 6) == 3
    assert measured_steps_for(100.0, 6) == 3
    assert measured_steps_for(None, 6) == 6
    assert measured_steps_for(100.0, 2) == 2  # a study that measures 2 never measures more


def test_the_time_limit_is_four_times_the_predicted_steps_within_floor_and_ceiling() -> None:
    # 4 x 8 steps x 10 s = 320 s; 4 x 8 x 5 s = 160 s -> the default floor, 300; 4 x 5 x 100 s =
    # 2000 s -> the ceiling, 600; no prediction: the ceiling
    assert timeout_for(10.0, 8, 600.0) == 320.0
    assert timeout_for(5.0, 8, 600.0) == 300.0
    assert timeout_for(5.0, 8, 600.0, floor_s=120.0) == 160.0
    assert timeout_for(100.0, 5, 600.0) == 600.0
    assert timeout_for(None, 8, 600.0) == 600.0
    assert timeout_for(0.01, 8, 600.0, floor_s=1.0) == 1.0  # ceil(0.32) = 1


#: (predicted peak, predicted tokens/s) per configuration, 100 tokens a step, budget 100
PREDICTED = {
    "least-memory": (50.0, 1.0),  # a 100 s step
    "fits-fast": (90.0, 5.0),  # a 20 s step
    "fits-fast-preferred": (90.0, 5.0),  # the same, with the space's preferred choice
    "over-budget": (120.0, 50.0),  # a 2 s step, predicted over the budget
}


def _configs(*names: str) -> list[dict[str, object]]:
    return [
        {"name": n, "gradient_checkpointing": "full" if n.endswith("preferred") else "off"}
        for n in names
    ]


def _predict(config: dict[str, object]) -> tuple[float, float]:
    return PREDICTED[str(config["name"])]


def test_the_reference_is_the_fitting_exact_configuration_with_the_shortest_step() -> None:
    exact = _configs("least-memory", "fits-fast", "over-budget")
    chosen = reference_for_cost(exact, _predict, 100.0, 100.0)
    assert chosen["name"] == "fits-fast"  # 20 s, not the least memory's 100 s nor over budget
    # equal steps: the space's reference preferences decide
    exact = _configs("least-memory", "fits-fast", "fits-fast-preferred")
    prefer = {"gradient_checkpointing": "full"}
    assert reference_for_cost(exact, _predict, 100.0, 100.0, prefer)["name"] == (
        "fits-fast-preferred"
    )
    # nothing predicted to fit a budget of 40: the least memory
    exact = _configs("fits-fast", "least-memory", "over-budget")
    assert reference_for_cost(exact, _predict, 40.0, 100.0)["name"] == "least-memory"


def _measured(config: dict[str, object], step_time_s: float) -> optuna.trial.FrozenTrial:
    return create_trial(
        state=TrialState.COMPLETE,
        values=[1.0, 1.0],
        params={"name": config["name"]},
        distributions={"name": CategoricalDistribution(list(PREDICTED))},
        user_attrs={"config": config, "status": "ok", "step_time_s": step_time_s},
    )


def test_the_predicted_step_is_calibrated_by_the_study_s_measurements() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"])
    least, fast, over = _configs("least-memory", "fits-fast", "over-budget")
    calibration = Calibration(_predict, 100.0, prior=1.5)
    costs = TrialCosts(calibration, most_steps=6, warmup_steps=2, ceiling_s=600.0, floor_s=120.0)
    # nothing measured: the prior, 1.5 x the 20 s step = 30 s -> 60 // 30 = 2, so 3 steps, and
    # 4 x 5 x 30 = 600 s
    cost = costs.for_config(fast, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (30.0, 3, 600.0)
    # measured / predicted: 300 / 100 = 3, 40 / 20 = 2, 20 / 2 = 10: the median is 3
    for config, seconds in ((least, 300.0), (fast, 40.0), (over, 20.0)):
        study.add_trial(_measured(config, seconds))
    assert calibration.ratio(study) == 3.0
    # a configuration's own choice was measured at 10 (its median over the study's 3): 10 x 2 s
    # = 20 s, 60 // 20 = 3 steps; 4 x 5 x 20 = 400 s
    cost = costs.for_config(over, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (20.0, 3, 400.0)
    # 3 x 100 s = 300 s: 3 steps; 4 x 5 x 300 = 6000 s -> the ceiling
    cost = costs.for_config(least, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (300.0, 3, 600.0)
    assert cost.attrs() == {
        "measured_steps": 3,
        "trial_timeout_s": 600.0,
        "predicted_step_s": 300.0,
    }


def _engine_predict(config: dict[str, object]) -> tuple[float, float]:
    return (1.0, 10.0)  # every configuration priced alike: a 10 s step of 100 tokens


def _engine_trial(
    engine: str, mb: int, step_time_s: float | None, **attrs: object
) -> optuna.trial.FrozenTrial:
    """A measured trial (``step_time_s``), or one killed at its time limit (None)."""
    config = {"engine": engine, "mb": mb}
    distributions = {
        "engine": CategoricalDistribution(["ddp", "offload"]),
        "mb": CategoricalDistribution([1, 2]),
    }
    if step_time_s is None:
        return create_trial(
            state=TrialState.FAIL,
            params=config,
            distributions=distributions,
            user_attrs={"config": config, "status": "failed", **attrs},
        )
    return create_trial(
        state=TrialState.COMPLETE,
        values=[1.0, 1.0],
        params=config,
        distributions=distributions,
        user_attrs={"config": config, "status": "ok", "step_time_s": step_time_s, **attrs},
    )


def test_each_choice_s_measured_ratio_scales_the_step_and_the_slowest_choice_decides() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"])
    calibration = Calibration(_engine_predict, 100.0, prior=1.5, warmup_steps=2)
    costs = TrialCosts(calibration, most_steps=6, warmup_steps=2, ceiling_s=600.0, floor_s=120.0)
    # measured / predicted: ddp mb 1: 20 / 10 = 2; ddp mb 2: 30 / 10 = 3; offload mb 1: 200 / 10
    # = 20; the study's median: 3
    for engine, mb, seconds in (("ddp", 1, 20.0), ("ddp", 2, 30.0), ("offload", 1, 200.0)):
        study.add_trial(_engine_trial(engine, mb, seconds))
    assert calibration.ratio(study) == 3.0
    # offload mb 2: offload's median 20 over 3, mb 2's 3 over 3 = 1: the slowest, 20/3 -> a
    # ratio of 20, a 200 s step: 3 steps, 4 x 5 x 200 = 4000 s -> the ceiling
    cost = costs.for_config({"engine": "offload", "mb": 2}, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (200.0, 3, 600.0)
    # ddp mb 2: ddp's median (2 + 3) / 2 = 2.5, mb 2's 3: the slowest is 3 -> 30 s, 60 // 30 =
    # 2 -> 3 steps; 4 x 5 x 30 = 600 s
    cost = costs.for_config({"engine": "ddp", "mb": 2}, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (30.0, 3, 600.0)
    # ddp mb 1: mb 1's median (2 + 20) / 2 = 11 is the slowest (ddp: 2.5): 110 s; a choice no
    # trial had says nothing (ddp mb 3 sees ddp's 2.5 only: 25 s, 60 // 25 = 2 -> 3 steps)
    assert calibration.ratio_for({"engine": "ddp", "mb": 1}, study) == 11.0
    assert calibration.step_s({"engine": "ddp", "mb": 3}, study) == 25.0


def test_a_trial_killed_at_its_limit_counts_with_the_least_ratio_its_limit_implies() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"])
    calibration = Calibration(_engine_predict, 100.0, prior=1.5, warmup_steps=2)
    costs = TrialCosts(calibration, most_steps=6, warmup_steps=2, ceiling_s=600.0, floor_s=120.0)
    # offload mb 1 killed at 600 s with 2 warm-up and 3 measured steps: at least 600 / 5 = 120 s
    # a step, 12 x the predicted 10 s; nothing measured: the study's ratio is the prior, 1.5
    killed = {"error": "timed out after 600s", "trial_timeout_s": 600.0, "measured_steps": 3}
    study.add_trial(_engine_trial("offload", 1, None, **killed))
    # a failure that is not a timeout says nothing of the step
    study.add_trial(_engine_trial("ddp", 2, None, error="exit code 1", measured_steps=3))
    assert calibration.ratio(study) == 1.5
    # offload mb 2: offload's 12 over 1.5 -> 12 x 10 s = 120 s: 3 steps, the ceiling
    cost = costs.for_config({"engine": "offload", "mb": 2}, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (120.0, 3, 600.0)
    # ddp mb 2 shares nothing with the killed trial: 1.5 x 10 s = 15 s, 60 // 15 = 4 steps,
    # 4 x 6 x 15 = 360 s
    cost = costs.for_config({"engine": "ddp", "mb": 2}, study)
    assert (cost.predicted_step_s, cost.measured_steps, cost.timeout_s) == (15.0, 4, 360.0)


def test_a_finalist_s_re_measurement_is_bounded_by_its_own_measured_step() -> None:
    own = {"measured_steps": 6, "trial_timeout_s": 600.0}
    # a 25 s step: 60 // 25 = 2 -> 3 steps; 4 x (2 + 3) x 25 = 500 s
    assert confirm_cost({**own, "step_time_s": 25.0}, 6, 2, None, 300.0) == (3, 500.0)
    # a 5 s step: the trial's 6 steps; 4 x 8 x 5 = 160 s -> the floor, 300 s
    assert confirm_cost({**own, "step_time_s": 5.0}, 6, 2, None, 300.0) == (6, 300.0)
    # a 100 s step: 3 steps, 4 x 5 x 100 = 2000 s -> the trial's own limit, 600 s
    assert confirm_cost({**own, "step_time_s": 100.0}, 6, 2, None, 300.0) == (3, 600.0)
    # a trial limited to 200 s, below the floor: the limit wins (4 x 8 x 5 = 160 -> 200)
    tight = {"measured_steps": 6, "trial_timeout_s": 200.0, "step_time_s": 5.0}
    assert confirm_cost(tight, 6, 2, None, 300.0) == (6, 200.0)
    # no own limit: the runner's ceiling (4 x 5 x 100 = 2000 -> 900); no runner ceiling: none
    assert confirm_cost({"step_time_s": 100.0}, 6, 2, 900.0, 300.0) == (3, 900.0)
    assert confirm_cost({"step_time_s": 100.0}, 6, 2, None, 300.0) == (3, None)
    # no measured step: the trial's own steps and limit
    assert confirm_cost(own, 8, 2, None, 300.0) == (6, 600.0)


@pytest.mark.parametrize(
    ("ratio", "args", "limit", "steps", "line"),
    [
        # a step in a millionth of the predicted time: the study's 6 steps, 4 x 8 x ~0 s -> the
        # floor, 1 s; nothing to say
        (1e-6, (), 1.0, 6, None),
        # a million times the predicted time: 3 steps, said, and the ceiling, which the trial's
        # 2 warm-up and 3 measured steps finish within
        (
            1e6,
            ("--trial-timeout", "300"),
            300.0,
            3,
            "3 measured steps instead of 6, time limit 300 s",
        ),
    ],
)
def test_a_derived_time_limit_is_hit_and_recorded_through_the_cli(
    tmp_path: Path,
    ratio: float,
    args: tuple[str, ...],
    limit: float,
    steps: int,
    line: str | None,
) -> None:
    """A tiny-llama study whose one measured trial (the reference) calibrates this machine's
    step against the prediction by ``ratio``: the next trial's limit and steps follow, its job
    is killed at the limit, and the trial records the limit, its steps and its timeout."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = make_study(url, "cost", DATA / "tiny_space.yaml", budget="1GB")
    settings = dict(study.user_attrs["settings"])
    settings["trial_timeout_floor_s"] = 1.0
    study.set_user_attr("settings", settings)
    from autotune.space import SearchSpace
    from autotune.study import reference_for, settings_of
    from autotune.trial_cost import study_predictor

    space = SearchSpace.from_dict(settings["space"], "study")
    reference = reference_for(space, settings_of(study))
    predict = study_predictor(settings_of(study))
    predicted_step = 64 * 8 / predict(reference)[1]
    study.enqueue_trial(space.params_for(reference))
    first = study.ask()
    assert space.sample(first.suggest_categorical) == reference  # type: ignore[arg-type]
    for key, value in {
        "config": reference,
        "role": "reference",
        "status": "ok",
        "step_time_s": predicted_step * ratio,
        "losses": [5.0, 4.9],
        "peak_bytes": 1,
    }.items():
        first.set_user_attr(key, value)
    study.tell(first, [1.0, 1.0])
    study.set_user_attr("reference_losses", [5.0, 4.9])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "resume",
            "--study",
            "cost",
            "--trials",
            "1",
            *args,
            "--storage",
            url,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout
    trial = study.get_trials(deepcopy=False)[1]
    assert trial.user_attrs["trial_timeout_s"] == limit
    assert trial.user_attrs["measured_steps"] == steps
    if line is None:  # killed at the floor
        assert trial.user_attrs["error"] == f"timed out after {limit:g}s"
        assert trial.state == TrialState.FAIL  # a timeout stays a timeout: tried, not planned
    else:  # the job ran the fewer steps: a loss per warm-up and measured step
        assert trial.user_attrs["status"] == "ok", trial.user_attrs.get("error")
        assert len(trial.user_attrs["losses"]) == 2 + steps
    said = [x for x in proc.stdout.splitlines() if x.startswith("trial #1: predicted step")]
    assert [x.split(": ", 2)[2] for x in said] == ([line] if line else []), proc.stdout


def test_a_choice_of_a_trial_killed_at_its_limit_slows_the_next_trial_s_prediction_in_the_cli(
    tmp_path: Path,
) -> None:
    """A tiny-llama study: the reference measured at its predicted step (a ratio of 1), and
    (full, bf16) killed at a limit that implies a step of 600,000 s. The next trial, (off,
    bf16), shares bf16 with the killed one: predicted slow by bf16's ratio, it measures 3 steps
    within the ceiling, and says so (priced by the study's ratio alone it would measure the
    study's 6 in a moment)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = make_study(url, "choice", DATA / "tiny_space.yaml", budget="1GB")
    from autotune.space import SearchSpace
    from autotune.study import reference_for, settings_of
    from autotune.trial_cost import study_predictor

    settings = settings_of(study)
    space = SearchSpace.from_dict(study.user_attrs["settings"]["space"], "study")
    reference = reference_for(space, settings)
    assert (reference["gradient_checkpointing"], reference["precision"]) == ("off", "fp32")
    predict = study_predictor(settings)
    killed = {**reference, "gradient_checkpointing": "full", "precision": "bf16"}
    for config, attrs, state in (
        (
            reference,
            {
                "role": "reference",
                "status": "ok",
                "step_time_s": 64 * 8 / predict(reference)[1],
                "losses": [5.0, 4.9],
                "peak_bytes": 1,
            },
            TrialState.COMPLETE,
        ),
        (
            killed,
            {
                "status": "failed",
                "error": "timed out after 3000000s",
                "trial_timeout_s": 3e6,
                "measured_steps": 3,
            },
            TrialState.FAIL,
        ),
    ):
        study.enqueue_trial(space.params_for(config))
        trial = study.ask()
        assert space.sample(trial.suggest_categorical) == config  # type: ignore[arg-type]
        for key, value in {"config": config, **attrs}.items():
            trial.set_user_attr(key, value)
        if state == TrialState.COMPLETE:
            study.tell(trial, [1.0, 1.0])
        else:
            study.tell(trial, state=state)
    study.set_user_attr("reference_losses", [5.0, 4.9])
    nxt = {**reference, "precision": "bf16"}
    study.enqueue_trial(space.params_for(nxt))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "resume", "--study", "choice", "--trials", "1",
         "--trial-timeout", "300", "--storage", url],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    trial = study.get_trials(deepcopy=False)[2]
    assert trial.user_attrs["config"] == nxt
    assert trial.user_attrs["status"] == "ok", trial.user_attrs.get("error")
    assert (trial.user_attrs["measured_steps"], trial.user_attrs["trial_timeout_s"]) == (3, 300.0)
    assert len(trial.user_attrs["losses"]) == 2 + 3
    said = [x for x in proc.stdout.splitlines() if x.startswith("trial #2: predicted step")]
    assert [x.split(": ", 2)[2] for x in said] == [
        "3 measured steps instead of 6, time limit 300 s"
    ], proc.stdout
