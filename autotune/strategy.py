"""autotune's own search strategy: estimator-ordered candidates, corrected by what was measured.

Every trial costs GPU minutes, so instead of learning the landscape from scratch (TPE, random,
grid) the sampler starts from what is cheap to know:

1. **Prior.** Every configuration of the (finite) space gets a predicted peak and tokens/s from
   an estimator (the analytical model: instant).
2. **Correction.** After each measured trial the prediction errors, ``log(measured/predicted)``
   for peak and for speed, are fitted by a small ridge regression on the configuration's
   one-hot technique choices, so a systematic error (fp16 with no fast kernels on a CPU, an
   activation term the formula misses) moves every configuration that shares the technique.
3. **Monotone pruning.** If a configuration ran out of memory, the same configuration with a
   bigger micro-batch or less checkpointing would too; those are never proposed. An OOM is
   also a lower bound on the peak and enters the correction as such.
4. **Loss.** A lossy choice whose every measured trial broke the loss guard is tried last.
5. **Choice.** Propose the untried configuration with the highest corrected speed among those
   whose corrected peak fits the budget; if none is predicted to fit, the smallest predicted
   peak (to learn where the boundary is).

It is an Optuna sampler: each trial's whole configuration is planned in ``before_trial`` and
``sample_independent`` answers the space's suggest calls from the plan, so the study, its
storage, enqueued trials and the constraints are the same as with any other sampler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

Config = dict[str, Any]
#: config -> (predicted peak bytes, predicted tokens/s)
Predictor = Callable[[Config], tuple[float, float]]

#: memory order of exact, monotone dimensions: a later value never needs less memory
MONOTONE_MEMORY: dict[str, Callable[[Any], float]] = {
    "micro_batch_size": float,
    "gradient_checkpointing": lambda v: {"full": 0.0, "selective": 1.0, "off": 2.0}[v],
    "offload_optimizer": lambda v: {"cpu": 0.0, "none": 1.0}[v],
    "offload_param": lambda v: {"cpu": 0.0, "none": 1.0}[v],
}


#: log-step by which an OOM's lower bound is raised until the model predicts it over budget
OOM_STEP = math.log(1.1)


def _key(config: Config) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in config.items()))


def needs_no_less_memory(candidate: Config, known_oom: Config) -> bool:
    """True when ``candidate`` equals ``known_oom`` except in monotone dimensions, where it is
    at least as memory-hungry: then it would run out of memory too."""
    if set(candidate) != set(known_oom):
        return False
    for dim, value in candidate.items():
        other = known_oom[dim]
        if dim in MONOTONE_MEMORY:
            order = MONOTONE_MEMORY[dim]
            if order(value) < order(other):
                return False
        elif value != other:
            return False
    return True


@dataclass
class Observation:
    config: Config
    status: str  # ok | oom
    peak_bytes: float
    tokens_per_s: float
    loss_ok: bool


def observations(study: optuna.Study) -> list[Observation]:
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if "config" not in a or a.get("status") not in ("ok", "oom"):
            continue
        loss_ok = t.constraints.get("loss", 0.0) <= 0 if t.constraints else True
        out.append(
            Observation(
                a["config"],
                a["status"],
                float(a.get("peak_bytes") or 0.0),
                float(a.get("tokens_per_s") or 0.0),
                loss_ok,
            )
        )
    return out


class _Ridge:
    """log-residual model on one-hot (dimension, value) features, shrunk towards zero."""

    def __init__(self, features: list[tuple[str, str]], alpha: float = 1.0) -> None:
        self.index = {f: i for i, f in enumerate(features)}
        self.alpha = alpha
        self.w = np.zeros(len(features) + 1)

    def _x(self, config: Config) -> np.ndarray:
        x = np.zeros(len(self.index) + 1)
        x[-1] = 1.0  # shared bias: a global scale error of the estimator
        for k, v in config.items():
            i = self.index.get((k, repr(v)))
            if i is not None:
                x[i] = 1.0
        return x

    def fit(self, configs: Sequence[Config], residuals: Sequence[float]) -> None:
        if not configs:
            return
        x = np.stack([self._x(c) for c in configs])
        y = np.asarray(residuals)
        penalty = self.alpha * np.eye(x.shape[1])
        penalty[-1, -1] = 1e-3  # the bias is cheap to learn from few points
        self.w = np.linalg.solve(x.T @ x + penalty, x.T @ y)

    def __call__(self, config: Config) -> float:
        return float(self._x(config) @ self.w)


class AutotuneSampler(BaseSampler):
    """Plans each trial's configuration from predictions corrected by measurements."""

    def __init__(
        self,
        candidates: Sequence[Config],
        predict: Predictor,
        budget_bytes: float,
        *,
        seed: int | None = None,
        ridge_alpha: float = 1.0,
    ) -> None:
        self.candidates = [dict(c) for c in candidates]
        self.budget = float(budget_bytes)
        self.prior = [predict(c) for c in self.candidates]
        features = sorted({(k, repr(v)) for c in self.candidates for k, v in c.items()})
        self.ridge_alpha = ridge_alpha
        self._features = features
        self._plans: dict[int, Config] = {}
        self._fallback = RandomSampler(seed=seed)

    # --- planning ------------------------------------------------------------------------------

    def plan(self, history: Sequence[Observation]) -> Config | None:
        """The next configuration to measure, or None when every candidate is known."""
        tried = {_key(o.config) for o in history}
        prior = {_key(c): p for c, p in zip(self.candidates, self.prior, strict=True)}
        peak_model, speed_model = (
            _Ridge(self._features, self.ridge_alpha),
            _Ridge(self._features, self.ridge_alpha),
        )
        peak_x: list[Config] = []
        peak_y: list[float] = []
        speed_x: list[Config] = []
        speed_y: list[float] = []
        oom_x: list[Config] = []
        oom_y: list[float] = []
        for o in history:
            p = prior.get(_key(o.config))
            if p is None or p[0] <= 0 or p[1] <= 0:
                continue
            if o.status == "ok" and o.peak_bytes > 0:
                peak_x.append(o.config)
                peak_y.append(math.log(o.peak_bytes / p[0]))
                if o.tokens_per_s > 0:
                    speed_x.append(o.config)
                    speed_y.append(math.log(o.tokens_per_s / p[1]))
            elif o.status == "oom":
                # a lower bound: the peak was at least the live bytes when it ran out
                oom_x.append(o.config)
                oom_y.append(math.log(max(o.peak_bytes, self.budget) / p[0]))
        speed_model.fit(speed_x, speed_y)
        # Fit the peak model so that every observed OOM is predicted over the budget: raise
        # each OOM's target until the fitted model agrees (the ridge shrinks single points).
        for _ in range(20):
            peak_model.fit(peak_x + oom_x, peak_y + oom_y)
            low = [
                i
                for i, c in enumerate(oom_x)
                if prior[_key(c)][0] * math.exp(peak_model(c)) <= self.budget
            ]
            if not low:
                break
            for i in low:
                oom_y[i] += OOM_STEP

        ooms = [o.config for o in history if o.status == "oom"]
        bad_loss = _always_bad_loss(history)
        fitting: list[tuple[tuple[int, float], Config]] = []
        boundary: list[tuple[float, Config]] = []
        for config, (peak, speed) in zip(self.candidates, self.prior, strict=True):
            if _key(config) in tried or any(needs_no_less_memory(config, o) for o in ooms):
                continue
            corrected_peak = peak * math.exp(peak_model(config))
            corrected_speed = speed * math.exp(speed_model(config))
            lossy_penalty = sum((k, repr(v)) in bad_loss for k, v in config.items())
            if corrected_peak <= self.budget:
                fitting.append(((-lossy_penalty, corrected_speed), config))
            else:
                boundary.append((corrected_peak, config))
        if fitting:
            return max(fitting, key=lambda item: item[0])[1]
        if boundary:
            return min(boundary, key=lambda item: item[0])[1]
        return None

    # --- the Optuna sampler interface ------------------------------------------------------------

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.system_attrs.get("fixed_params"):
            return  # an enqueued trial (the reference, a ladder step) is already decided
        plan = self.plan(observations(study))
        if plan is not None:
            self._plans[trial.number] = plan

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return {}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        plan = self._plans.get(trial.number, {})
        dim = param_name.split("|", 1)[0]
        choices = getattr(param_distribution, "choices", ())
        if dim in plan and plan[dim] in choices:
            return plan[dim]
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._plans.pop(trial.number, None)


def _always_bad_loss(history: Sequence[Observation]) -> set[tuple[str, str]]:
    """(dimension, value) pairs all of whose measured trials broke the loss guard."""
    seen: dict[tuple[str, str], list[bool]] = {}
    for o in history:
        if o.status != "ok":
            continue
        for k, v in o.config.items():
            seen.setdefault((k, repr(v)), []).append(o.loss_ok)
    return {f for f, oks in seen.items() if not any(oks)}
