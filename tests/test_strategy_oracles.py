"""The sampler's rules against oracles from outside it: tiny candidate sets whose right plan is
obvious by hand, the ridge corrections recomputed here by least squares on the augmented system,
real Optuna studies for the sampler interface, and the analytical estimator given the GPU spec
explicitly for the predictor."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.samplers import RandomSampler
from optuna.trial import TrialState

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GpuSpec, Machine, gpu_spec
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from autotune.strategy import AutotuneSampler, Observation, analytical_predictor, observations

Config = dict[str, Any]

# Four configurations of two made-up dimensions: neither is a technique the registry knows, so
# both are exact (no loss model) and not monotone in memory (an OOM implies only itself).
A = {"a": "x", "b": "u"}
B = {"a": "x", "b": "v"}
T = {"a": "y", "b": "v"}
Q = {"a": "y", "b": "u"}
FEATURES = [("a", "x"), ("a", "y"), ("b", "u"), ("b", "v")]


def sampler_of(
    rows: list[tuple[Config, float, float]], budget: float, **kw: Any
) -> AutotuneSampler:
    """A sampler over ``rows`` (config, predicted peak, predicted tokens/s), in that order."""
    table = {tuple(sorted(c.items())): (peak, speed) for c, peak, speed in rows}
    return AutotuneSampler(
        [c for c, _, _ in rows], lambda c: table[tuple(sorted(c.items()))], budget, **kw
    )


def onehot(c: Config, features: list[tuple[str, str]] = FEATURES) -> np.ndarray:
    return np.array([1.0 if c.get(k) == v else 0.0 for k, v in features])


#: the sampler's prior spreads (bias, additive, interaction), restated: peak and speed
PEAK = (0.25, 0.1, 0.02)
SPEED = (1.0, 1.0, 0.3)
NOISE = 1e-2  # the measurement noise's variance before the spreads are fitted
Z_FIT = NormalDist().inv_cdf(0.2)  # a candidate is proposed while P(fit) >= 0.2


def features(c: Config, spreads: tuple[float, float, float]) -> np.ndarray:
    """Weight-space features whose inner products are the sampler's kernel: a bias, each
    choice scaled by sqrt(additive / D), each ordered pair of choices by
    sqrt(interaction / (D (D - 1))), with D = 2 dimensions here."""
    bias, additive, interaction = spreads
    d = 2
    x = onehot(c)
    pairs = [
        x[i] * x[j]
        for i in range(len(x))
        for j in range(len(x))
        if FEATURES[i][0] != FEATURES[j][0]
    ]
    return np.concatenate(
        [
            [math.sqrt(bias)],
            x * math.sqrt(additive / d),
            np.array(pairs) * math.sqrt(interaction / (d * (d - 1))),
        ]
    )


def posterior(
    rows: list[Config], y: list[float], c: Config, spreads: tuple[float, float, float]
) -> tuple[float, float]:
    """Bayesian linear regression on ``features`` (weights ~ N(0, I), noise NOISE): the mean
    and variance of the log-correction at ``c``, the weight-space twin of the sampler's GP."""
    phi = np.array([features(r, spreads) for r in rows]).reshape(len(rows), -1)
    f = features(c, spreads)
    if not rows:
        return 0.0, float(f @ f)
    a = phi.T @ phi / NOISE + np.eye(len(f))
    cov = np.linalg.inv(a)
    mean = float(f @ cov @ phi.T @ np.asarray(y) / NOISE)
    return mean, float(f @ cov @ f)


# --- the peak and speed corrections ------------------------------------------------------------


def test_a_candidate_is_proposed_while_it_fits_with_probability_one_in_five() -> None:
    """The fast untried T is proposed while P(its corrected log peak <= log budget) >= 0.2,
    under the GP's posterior on log(measured/prior) after A and B (recomputed here in weight
    space): with the budget a hair above that boundary T is proposed, a hair below the slow
    small Q is."""
    measured = [(A, 100e6, 150e6), (B, 120e6, 144e6)]  # (config, prior peak, measured peak)
    y = [math.log(m / p) for _, p, m in measured]
    mean, var = posterior([A, B], y, T, PEAK)
    boundary = math.exp(math.log(150e6) + mean + Z_FIT * math.sqrt(var + NOISE))
    history = [Observation(c, "ok", m, 1000.0) for c, _, m in measured]
    for scale, expected in ((1 + 1e-7, T), (1 - 1e-7, Q)):
        rows = [(A, 100e6, 1000.0), (B, 120e6, 1000.0), (T, 150e6, 5000.0), (Q, 1e6, 10.0)]
        assert sampler_of(rows, boundary * scale).plan(history) == expected, scale


def expected_improvement(mean: float, var: float, incumbent: float) -> float:
    sd = math.sqrt(var + 0.1**2)  # the default optimism: a floor on the spread
    z = (mean - incumbent) / sd
    return sd * (z * NormalDist().cdf(z) + NormalDist().pdf(z))


def test_the_next_candidate_is_the_best_expected_improvement_in_log_speed() -> None:
    """Among candidates that surely fit, the one with the highest expected improvement of log
    tokens/s over the fastest measured one is proposed, under the GP's posterior on
    log(measured/prior) (recomputed here in weight space): Q's prior speed set a hair above or
    below the speed at which Q and T tie (bisection on the formula), Q or T is."""
    measured = [(A, 1000.0, 500.0), (B, 2000.0, 1600.0)]
    y = [math.log(m / p) for _, p, m in measured]
    incumbent = math.log(1600.0)
    t_mean, t_var = posterior([A, B], y, T, SPEED)
    q_mean, q_var = posterior([A, B], y, Q, SPEED)
    target = expected_improvement(math.log(1000.0) + t_mean, t_var, incumbent)
    lo, hi = 1e-3, 1e9
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if expected_improvement(math.log(mid) + q_mean, q_var, incumbent) < target:
            lo = mid
        else:
            hi = mid
    history = [Observation(c, "ok", 1e6, m) for c, _, m in measured]
    for scale, expected in ((1 + 1e-6, Q), (1 - 1e-6, T)):
        rows = [(A, 1e6, 1000.0), (B, 1e6, 2000.0), (T, 1e6, 1000.0), (Q, 1e6, lo * scale)]
        assert sampler_of(rows, 1e9).plan(history) == expected, scale


def test_contenders_are_untried_candidates_predicted_within_ten_percent_of_the_best() -> None:
    """``contenders``: untried candidates whose corrected speed (prior x exp(GP mean), the
    posterior recomputed here in weight space) is at least 90% of the best measured one's,
    that surely fit: with Q's prior a hair above or below the speed that puts it at 90%, Q
    counts or does not; T counts as the oracle says."""
    measured = [(A, 1000.0, 500.0), (B, 2000.0, 1600.0)]
    y = [math.log(m / p) for _, p, m in measured]
    threshold = math.log(0.9 * 1600.0)
    t_mean, _ = posterior([A, B], y, T, SPEED)
    q_mean, _ = posterior([A, B], y, Q, SPEED)
    t_counts = int(math.log(1000.0) + t_mean >= threshold)
    q_prior = math.exp(threshold - q_mean)
    history = [Observation(c, "ok", 1e6, m) for c, _, m in measured]
    for scale, q_counts in ((1 + 1e-6, 1), (1 - 1e-6, 0)):
        rows = [(A, 1e6, 1000.0), (B, 1e6, 2000.0), (T, 1e6, 1000.0), (Q, 1e6, q_prior * scale)]
        assert sampler_of(rows, 1e9).contenders(history) == t_counts + q_counts, scale
    # nothing feasible measured yet: nothing to compare with
    assert sampler_of(rows, 1e9).contenders([]) == 0


def test_an_oom_is_a_lower_bound_raised_until_predicted_over_the_budget() -> None:
    """An OOM's peak is a lower bound, raised by 10% steps until the GP predicts the OOM over
    the budget; B, sharing the OOM's choice ``a`` (prior: 3/4 of the budget), then fits with
    a probability (recomputed here) under 0.2 and the slow small Q is proposed, though with
    the bound taken as measured B would still be (P >= 0.2)."""
    budget = 1e8
    rows = [(A, budget / 2, 1000.0), (B, 0.75 * budget, 9000.0), (Q, budget / 100, 10.0)]
    target = math.log(2.0)
    while posterior([A], [target], A, PEAK)[0] + math.log(budget / 2) <= math.log(budget):
        target += math.log(1.1)

    def p_fit(t: float) -> float:
        mean, var = posterior([A], [t], B, PEAK)
        return NormalDist().cdf((math.log(1 / 0.75) - mean) / math.sqrt(var + NOISE))

    assert p_fit(target) < 0.2 <= p_fit(math.log(2.0))
    for peak in (budget, 0.0):  # the peak it reached, or none recorded: the budget is the bound
        assert sampler_of(rows, budget).plan([Observation(A, "oom", peak, 0.0)]) == Q


def test_unmeasured_peak_or_speed_moves_no_model() -> None:
    """An observation whose peak is 0 (not measured) does not move the peak model, and tokens/s
    of 0 does not move the speed model (the logs of 0 are not taken): the priors still rank."""
    rows = [(A, 1e6, 1000.0), (B, 1e6, 1000.0), (T, 1e6, 5000.0), (Q, 1e6, 10.0)]
    sampler = sampler_of(rows, 1e8)
    history = [Observation(A, "ok", 0.0, 1000.0), Observation(B, "ok", 1e6, 0.0)]
    assert sampler.plan(history) == T


def test_a_tiny_positive_measurement_is_a_measurement() -> None:
    """Any positive peak or speed, however small (1 byte, 1 token/s), enters its model: a
    configuration measured at 1 byte against a 1 MB prior makes one predicted at twice the
    budget fit; one measured at 1 token/s against 10^9 makes the configuration sharing its
    choice ``a`` rank behind one 1% slower in prior that shares nothing."""
    peaks = [(A, 1e6, 1000.0), (T, 2e8, 5000.0), (Q, 1e3, 10.0)]
    assert sampler_of(peaks, 1e8).plan([Observation(A, "ok", 1.0, 1000.0)]) == T
    speeds = [(A, 1e6, 1e9), (B, 1e6, 1.01e9), (T, 1e6, 1e9)]
    assert sampler_of(speeds, 1e8).plan([Observation(A, "ok", 1e6, 1.0)]) == T
    # without the measurement the 1% faster prior wins (the bonus is alike for all)
    assert sampler_of(speeds, 1e8).plan([Observation(A, "predicted_oom", 0.0, 0.0)]) == B


def test_priors_are_compared_as_given_down_to_one_byte_and_below_one_token() -> None:
    """The prior peak is floored at 1 byte and the prior speed at 1e-12 tokens/s only: a 3-byte
    peak does not fit a 1.2-byte budget (with nothing measured its chance is
    Phi(log(1.2/3) / sqrt(0.37 + 0.01)) = 0.07 < 0.2: the 1-byte one is proposed), and 0.5
    tokens/s ranks above 0.25 tokens/s."""
    peaks = [(A, 3.0, 10.0), (B, 1.0, 1.0)]
    assert sampler_of(peaks, 1.2).plan([]) == B
    speeds = [(A, 1e6, 0.25), (B, 1e6, 0.5)]
    assert sampler_of(speeds, 1e8).plan([]) == B


def test_a_candidate_predicted_exactly_at_the_budget_fits() -> None:
    """Fitting is peak <= budget: with nothing measured (no correction) two candidates whose
    prior is exactly the budget both fit and the faster is proposed (1 byte: log 1 = 0 exactly,
    so the tie is exact)."""
    rows = [(A, 1.0, 1.0), (B, 1.0, 2.0)]
    assert sampler_of(rows, 1.0).plan([]) == B


def test_when_nothing_fits_the_smallest_untried_peak_is_proposed() -> None:
    """When nothing is predicted to fit, the smallest predicted peak among the untried is
    proposed (to learn where the boundary is), not a tried one and not the fastest."""
    rows = [(A, 2e8, 1000.0), (B, 3e8, 1000.0), (T, 4e8, 9000.0), (Q, 5e8, 1000.0)]
    sampler = sampler_of(rows, 1e8)
    assert sampler.plan([Observation(A, "predicted_oom", 0.0, 0.0)]) == B
    assert sampler.plan([Observation(c, "predicted_oom", 0.0, 0.0) for c in (A, B)]) == T


def test_a_record_of_a_configuration_outside_the_space_is_skipped_not_the_end() -> None:
    """History entries whose configuration is not a candidate are skipped one by one: a
    candidate recorded after one still counts as tried (and the crash model ignores the foreign
    record)."""
    rows = [(A, 1e6, 1000.0), (B, 1e6, 2000.0), (T, 1e6, 5000.0), (Q, 1e6, 10.0)]
    sampler = sampler_of(rows, 1e8)
    foreign = Observation({"a": "z", "b": "w"}, "ok", 1e6, 1000.0)
    history = [
        foreign,
        Observation(T, "predicted_oom", 0.0, 0.0),
        Observation(Q, "failed", 0.0, 0.0),
    ]
    assert sampler.plan(history) == B


# --- the loss and crash models -------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "adafactor")


def _lossy(precision: str, optimizer: str, a: str) -> Config:
    return {"precision": precision, "optimizer": optimizer, "a": a}


def test_a_regressing_choice_is_tried_after_all_others() -> None:
    """The loss penalty with the default 2% tolerance: Adafactor measured 10% worse (ridge 0.05:
    predicted 0.1/1.05) puts every Adafactor configuration behind the exact ones, even the
    fastest untried."""
    speeds = {("fp32", "adamw"): 1000.0, ("fp32", "adafactor"): 3000.0}
    rows = [
        (_lossy(p, o, a), 1e6, speeds[p, o]) for p in ("fp32",) for o in OPTIMIZERS for a in "xy"
    ]
    sampler = sampler_of(rows, 1e8)
    history = [Observation(_lossy("fp32", "adafactor", "x"), "ok", 1e6, 3000.0, 0.1)]
    plan = sampler.plan(history)
    assert plan is not None and plan["optimizer"] == "adamw"
    # a regression within the tolerance (0.015/1.05) does not
    history = [Observation(_lossy("fp32", "adafactor", "x"), "ok", 1e6, 3000.0, 0.015)]
    assert sampler.plan(history) == _lossy("fp32", "adafactor", "y")


def test_precision_is_blamed_reluctantly() -> None:
    """Mixed precision gets the strong loss ridge (1.0) and other lossy choices the weak one
    (0.05): one bf16 trial 3% worse predicts bf16 at 0.03/2 (within 2%: bf16 stays first), one
    Adafactor trial 3% worse predicts Adafactor at 0.03/1.05 (over: it goes last)."""
    rows = [
        (_lossy(p, "adamw", a), 1e6, 3000.0 if p == "bf16" else 1000.0)
        for p in PRECISIONS
        for a in "xy"
    ]
    history = [Observation(_lossy("bf16", "adamw", "x"), "ok", 1e6, 3000.0, 0.03)]
    assert sampler_of(rows, 1e8).plan(history) == _lossy("bf16", "adamw", "y")
    rows = [
        (_lossy("fp32", o, a), 1e6, 3000.0 if o == "adafactor" else 1000.0)
        for o in OPTIMIZERS
        for a in "xy"
    ]
    history = [Observation(_lossy("fp32", "adafactor", "x"), "ok", 1e6, 3000.0, 0.03)]
    plan = sampler_of(rows, 1e8).plan(history)
    assert plan is not None and plan["optimizer"] == "adamw"


def test_only_a_regression_beyond_the_tolerance_is_penalised() -> None:
    """With a tolerance of 0, a choice predicted not to regress at all (exact fp32: its
    prediction is exactly 0) is not penalised; bf16 measured better than the reference does not
    jump the queue: the fastest, fp32 on y, is proposed."""
    rows = [
        (_lossy(p, "adamw", a), 1e6, 3000.0 if p == "fp32" else 1000.0)
        for p in PRECISIONS
        for a in "xy"
    ]
    sampler = sampler_of(rows, 1e8, loss_tolerance=0.0)
    history = [Observation(_lossy("bf16", "adamw", "x"), "ok", 1e6, 1000.0, -0.01)]
    assert sampler.plan(history) == _lossy("fp32", "adamw", "y")


def test_the_crash_model_counts_oom_trials_as_ran() -> None:
    """A crash of (w0, x0, y0, z0) is blamed on one of its 4 choices or 6 pairs; a candidate
    sharing more than half of those suspects waits. (w0, x0, y0, z1) contains 3 choices and 3
    pairs: 6/10 > 1/2, it waits. An OOM of (w0, x0, y1, z1) ran, clearing w0, x0 and (w0, x0):
    the candidate then contains y0, (w0, y0), (x0, y0), 3 of the 7 left (< 1/2), and as the
    fastest it is proposed. Counted by hand here."""

    def cfg(w: str, x: str, y: str, z: str) -> Config:
        return {"w": w, "x": x, "y": y, "z": z}

    crashed, oom, target = cfg("0", "0", "0", "0"), cfg("0", "0", "1", "1"), cfg("0", "0", "0", "1")
    grid = [cfg(a, b, c, d) for a in "01" for b in "01" for c in "01" for d in "01"]
    budget = 1e8
    rows = [
        (c, 0.9 * budget if c == oom else 0.3 * budget, 5000.0 if c == target else 1000.0)
        for c in grid
    ]
    crash = Observation(crashed, "failed", 0.0, 0.0)
    assert sampler_of(rows, budget).plan([crash]) != target
    history = [crash, Observation(oom, "oom", budget, 0.0)]
    assert sampler_of(rows, budget).plan(history) == target


# --- the Optuna sampler interface ----------------------------------------------------------------

ROWS = [(A, 1e6, 1000.0), (B, 1e6, 2000.0), (T, 1e6, 5000.0), (Q, 1e6, 10.0)]


def _study(sampler: AutotuneSampler) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=sampler)


def test_a_choice_the_plan_cannot_answer_comes_from_the_seeded_random_sampler() -> None:
    """A choice not in the distribution, a distribution without choices and a name the plan
    lacks fall back to the seeded RandomSampler: the same values, in order, as
    ``RandomSampler(seed)`` itself draws."""
    study = _study(sampler_of(ROWS, 1e8, seed=11))
    trial = study.ask()
    assert (
        trial.suggest_categorical("a", ["x", "y"]),
        trial.suggest_categorical("b", ["u", "v"]),
    ) == ("y", "v")
    asks = [
        ("a|other", CategoricalDistribution(["p", "q", "r", "s"])),  # the plan's "y" not a choice
        ("b|size", FloatDistribution(0.0, 1.0)),  # the plan has b, the distribution no choices
        ("lr", FloatDistribution(1e-5, 1e-1, log=True)),  # not in the plan
    ]
    got = [
        trial.suggest_categorical("a|other", ["p", "q", "r", "s"]),
        trial.suggest_float("b|size", 0.0, 1.0),
        trial.suggest_float("lr", 1e-5, 1e-1, log=True),
    ]
    reference = RandomSampler(seed=11)
    frozen = study.trials[-1]
    assert got == [reference.sample_independent(study, frozen, n, d) for n, d in asks]


def test_a_param_name_with_a_suffix_answers_from_the_plans_dimension() -> None:
    """A param name 'dim|suffix' (even 'dim|x|y') answers from the plan's dim."""
    study = _study(sampler_of(ROWS, 1e8, seed=3))
    trial = study.ask()
    choices = [f"w{i}" for i in range(10)] + ["u", "v"]
    assert trial.suggest_categorical("b|x|y", choices) == "v"
    assert trial.suggest_categorical("a|z", ["q", "x", "y"]) == "y"


def test_an_enqueued_trial_is_answered_by_the_random_sampler() -> None:
    """An enqueued trial is not planned: what it does not fix comes from the seeded
    RandomSampler (the same value as ``RandomSampler(seed)`` draws)."""
    study = _study(sampler_of(ROWS, 1e8, seed=5))
    study.enqueue_trial({"a": "x"})
    trial = study.ask()
    choices = [f"w{i}" for i in range(10)] + ["u", "v"]
    dist = CategoricalDistribution(choices)
    got = trial.suggest_categorical("b", choices)
    assert got == RandomSampler(seed=5).sample_independent(study, study.trials[-1], "b", dist)
    assert trial.suggest_categorical("a", ["x", "y"]) == "x"


def test_a_finished_trials_plan_is_forgotten() -> None:
    """After a trial finishes its plan is dropped: a sampler reused for a second study answers
    that study's enqueued trial number 0 from the random fallback, not from the first study's
    trial 0's plan."""
    sampler = sampler_of(ROWS, 1e8, seed=9)
    first = _study(sampler)
    trial = first.ask()
    assert trial.suggest_categorical("b", ["u", "v"]) == "v"
    first.tell(trial, 1.0)
    second = _study(sampler)
    second.enqueue_trial({"a": "x"})
    again = second.ask()
    assert again.number == 0
    choices = ["v"] + [f"w{i}" for i in range(10)]
    dist = CategoricalDistribution(choices)
    expected = RandomSampler(seed=9).sample_independent(second, second.trials[-1], "b", dist)
    assert expected != "v"
    assert again.suggest_categorical("b", choices) == expected


def test_a_trial_that_failed_in_optuna_is_planned_again() -> None:
    """Only trials other workers are RUNNING count as tried: a trial Optuna marked FAIL (its
    worker died before measuring anything) does not, so its configuration is planned again."""
    study = _study(sampler_of(ROWS, 1e8))
    trial = study.ask()
    planned = {
        d: trial.suggest_categorical(d, c) for d, c in (("a", ["x", "y"]), ("b", ["u", "v"]))
    }
    assert planned == T
    study.tell(trial, state=TrialState.FAIL)
    retry = study.ask()
    assert {
        d: retry.suggest_categorical(d, c) for d, c in (("a", ["x", "y"]), ("b", ["u", "v"]))
    } == T
    # while it runs, the next worker gets the next one
    other = study.ask()
    assert {
        d: other.suggest_categorical(d, c) for d, c in (("a", ["x", "y"]), ("b", ["u", "v"]))
    } == B


def test_a_record_without_a_configuration_does_not_end_the_observations() -> None:
    """A completed trial without a stored configuration is skipped; the records after it are
    still read."""
    study = _study(sampler_of(ROWS, 1e8))
    for attrs in (
        {"status": "ok"},
        {"config": T, "status": "ok", "peak_bytes": 5, "tokens_per_s": 2},
    ):
        study.add_trial(
            optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)
        )
    got = observations(study)
    assert [(o.config, o.status, o.peak_bytes, o.tokens_per_s) for o in got] == [
        (T, "ok", 5.0, 2.0)
    ]


# --- the analytical predictor --------------------------------------------------------------------

TINY = MODELS["tiny-llama"].config
CONFIGS = [
    {"precision": "bf16", "micro_batch_size": 1, "zero_stage": 1},
    {"precision": "fp16", "micro_batch_size": 2, "zero_stage": 1},
    {"precision": "fp32", "micro_batch_size": 1, "zero_stage": 2, "offload_optimizer": "cpu"},
]


def _estimated(config: Config, gpu: GpuSpec, nproc: int) -> tuple[float, float]:
    est = AnalyticalEstimator().estimate(
        Workload(TINY, seq_len_tokens=64, global_batch_sequences=4, processes=nproc, gpu=gpu),
        config,
    )
    return float(est.peak_bytes), float(est.tokens_per_s)


def test_the_predictor_is_the_estimator_for_the_named_gpu() -> None:
    """The workload's GPU is the one the estimator prices, and the ranks are passed on; without
    nodes the ranks share one node (no spanning)."""
    for nproc in (1, 2):
        predict = analytical_predictor(Workload(TINY, 64, 4, nproc, gpu=gpu_spec("h100")))
        for config in CONFIGS:
            assert predict(config) == _estimated(config, gpu_spec("h100"), nproc)
            assert predict(config)[1] > 0


def test_nodes_price_the_gpu_spanning_them() -> None:
    """nodes>1 prices the GPU spanning the nodes, nproc // nodes on each (compare with the
    estimator given ``gpu_spec(key).spanning(nodes, nproc // nodes)``)."""
    for nproc, nodes in ((4, 2), (6, 4)):
        predict = analytical_predictor(
            Workload(TINY, 64, 4, nproc, nodes=nodes, gpu=gpu_spec("a100-80gb"))
        )
        spec = gpu_spec("a100-80gb").spanning(nodes, nproc // nodes)
        for config in CONFIGS:
            assert predict(config) == _estimated(config, spec, nproc)
        assert predict(CONFIGS[0]) != _estimated(CONFIGS[0], gpu_spec("a100-80gb"), nproc)


def test_the_cpu_prior_gives_every_precision_one_nominal_rate() -> None:
    """The CPU prior (a workload without a GPU) is a nominal device: 1 TFLOPS in every precision,
    50 GB/s of memory and host link, no NVLink (the estimator given that spec explicitly)."""
    cpu = GpuSpec(
        key="nominal",
        name="a CPU",
        memory_bytes=0,
        bf16_tflops=1.0,
        fp16_tflops=1.0,
        fp32_tflops=1.0,
        hbm_gbps=50.0,
        nvlink_gbps=0.0,
        sm=(0, 0),
        machine=Machine(name="a CPU's", pcie_gbps=50.0, internode_gbps=12.5),
    )
    for nproc in (1, 2):
        predict = analytical_predictor(Workload(TINY, 64, 4, nproc))
        for config in CONFIGS:
            assert predict(config) == _estimated(config, cpu, nproc)
