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
4. **Loss and crashes.** The measured loss regressions are fitted on the lossy choices (bf16,
   fp16, other optimizers, quantization) by a ridge without bias; a configuration predicted to
   regress beyond the tolerance is tried last. Exact techniques never regress by construction.
   Crashed trials (never proposed again) are fitted the same way on every choice (crashed 1,
   ran 0), so the other configurations sharing a crashing combination are tried last too.
5. **Choice.** Propose the untried configuration with the highest corrected speed, plus a small
   bonus for technique choices not measured yet (LinUCB: the ridge's posterior spread), among
   those whose corrected peak fits the budget; if none is predicted to fit, the smallest
   predicted peak (to learn where the boundary is).

It is an Optuna sampler: each trial's whole configuration is planned in ``before_trial`` and
``sample_independent`` answers the space's suggest calls from the plan, so the study, its
storage, enqueued trials and the constraints are the same as with any other sampler.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

from autotune.terminal import printable
from trials.data import Documents
from trials.techniques import REGISTRY, is_exact

Config = dict[str, Any]
#: config -> (predicted peak bytes, predicted tokens/s)
Predictor = Callable[[Config], tuple[float, float]]


#: ridge strength per lossy dimension for the loss-regression fit: the prior belief that a
#: choice does not regress. bf16/fp16 mixed precision with fp32 master weights tracks the fp32
#: loss closely (Micikevicius et al. 2018), so a regression seen together with another
#: optimizer or quantization is blamed on that first.
LOSS_RIDGE_ALPHA: dict[str, float] = {"precision": 1.0}
LOSS_RIDGE_DEFAULT = 0.05
#: the crash model (``_crash_penalty``): ridge strength, and the predicted crash score above
#: which a candidate is tried last
CRASH_RIDGE_ALPHA = 0.5
CRASH_THRESHOLD = 0.5
#: system attr holding a running trial's planned configuration (seen by other workers)
PLAN_ATTR = "autotune:plan"
#: log-step by which an OOM's lower bound is raised until the model predicts it over budget
OOM_STEP = math.log(1.1)


def config_key(config: Config) -> tuple[tuple[str, str], ...]:
    """A hashable identity of a configuration (values by repr: 5e6 and 5000000.0 differ)."""
    return tuple(sorted((k, repr(v)) for k, v in config.items()))


def needs_no_less_memory(candidate: Config, known_oom: Config) -> bool:
    """True when ``candidate`` equals ``known_oom`` except in monotone dimensions, where it is
    at least as memory-hungry: then it would run out of memory too. The memory order of a
    dimension is its technique's (``Knob.memory_order``)."""
    if set(candidate) != set(known_oom):
        return False
    monotone = REGISTRY.memory_orders()
    for dim, value in candidate.items():
        other = known_oom[dim]
        if dim in monotone:
            order = monotone[dim]
            if order(value) < order(other):
                return False
        elif value != other:
            return False
    return True


@dataclass
class Observation:
    config: Config
    #: ok | oom (measured) | predicted_oom (the pre-screen's: never run, implies nothing about
    #: other configurations) | failed (deterministic: never proposed again) | running
    status: str
    peak_bytes: float
    tokens_per_s: float
    #: relative loss regression against the reference (None: not measured)
    loss_regression: float | None = None


#: numbers every trial record of autotune holds as int or float (finite)
NUMBER_ATTRS = (
    "peak_bytes",
    "tokens_per_s",
    "host_peak_bytes",
    "step_spread",
    "load_per_core",
    "construction_peak_bytes",
    "training_peak_bytes",
)
#: a trial's record another tool wrote in another shape: shown as a failed trial saying so
FOREIGN = "its record is not autotune's (written by another tool?): "


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def foreign_record(a: dict[str, Any]) -> str:
    """What in a trial's user attrs is not of the shape autotune writes ('' when all is)."""
    for key in NUMBER_ATTRS:
        if a.get(key) is not None and not _number(a[key]):
            return f"{key} is {printable(repr(a[key]))[:60]}"
    for key in ("config", "memory_breakdown", "loss_verdict"):
        if a.get(key) is not None and not isinstance(a[key], dict):
            return f"{key} is not a mapping"
    breakdown = a.get("memory_breakdown") or {}
    if not all(_number(v) for v in breakdown.values()):
        return "memory_breakdown holds a value that is not a number of bytes"
    for key in ("rank_peaks", "losses"):
        if a.get(key) is not None and not isinstance(a[key], list):
            return f"{key} is not a list"
    for key in ("status", "error", "role", "stderr_tail", "fidelity"):
        if a.get(key) is not None and not isinstance(a[key], str):
            return f"{key} is not text"
    return ""


def observations(study: optuna.Study) -> list[Observation]:
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if "config" not in a or a.get("status") not in ("ok", "oom", "failed"):
            continue
        if foreign_record(a):  # written by another tool in another shape: nothing to learn
            continue
        status = a["status"]
        if status == "oom" and a.get("pruned_by_estimate"):
            status = "predicted_oom"
        regression = a.get("loss_regression")
        out.append(
            Observation(
                a["config"],
                status,
                float(a.get("peak_bytes") or 0.0),
                float(a.get("tokens_per_s") or 0.0),
                float(regression) if regression is not None else None,
            )
        )
    return out


class _Ridge:
    """log-residual model on one-hot (dimension, value) features, shrunk towards zero.

    The last column of the design matrix is a shared bias: a global scale error of the
    estimator (e.g. its GPU runs faster than the roofline's efficiency), cheap to learn."""

    def __init__(self, n_features: int, alpha: float = 1.0) -> None:
        self.alpha = alpha
        self.w = np.zeros(n_features)

        self.a_inv = np.eye(n_features) / alpha

    def fit(self, x: np.ndarray, y: Sequence[float]) -> None:
        penalty = self.alpha * np.eye(x.shape[1])
        penalty[-1, -1] = 1e-3
        self.a_inv = np.linalg.inv(x.T @ x + penalty)
        if len(y):
            self.w = self.a_inv @ (x.T @ np.asarray(y))

    def uncertainty(self, x: np.ndarray) -> np.ndarray:
        """Posterior spread of the correction, in units of the residual noise (LinUCB)."""
        return np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", x, self.a_inv, x), 0.0))


class AutotuneSampler(BaseSampler):
    """Plans each trial's configuration from predictions corrected by measurements.

    Candidates are held as arrays (one-hot features, per-dimension codes, prior predictions) so
    planning over a grid of ~10^5 configurations takes milliseconds."""

    def __init__(
        self,
        candidates: Sequence[Config],
        predict: Predictor,
        budget_bytes: float,
        *,
        seed: int | None = None,
        ridge_alpha: float = 1.0,
        optimism: float = 0.1,
        loss_tolerance: float = 0.02,
    ) -> None:
        self.candidates = [dict(c) for c in candidates]
        self.budget = float(budget_bytes)
        self.ridge_alpha = ridge_alpha
        self.optimism = optimism
        self.loss_tolerance = loss_tolerance
        self._index = {config_key(c): i for i, c in enumerate(self.candidates)}
        prior = np.array([predict(c) for c in self.candidates], dtype=float).reshape(-1, 2)
        self._log_peak = np.log(np.maximum(prior[:, 0], 1.0))
        self._log_speed = np.log(np.maximum(prior[:, 1], 1e-12))
        features = sorted({(k, repr(v)) for c in self.candidates for k, v in c.items()})
        self._feature = {f: j for j, f in enumerate(features)}
        self._x = np.zeros((len(self.candidates), len(features) + 1), dtype=np.float32)
        self._x[:, -1] = 1.0
        # columns of the lossy choices (bf16, other optimizers, quantization): only they can
        # move the loss; exact techniques are the reference's numbers by construction
        self._lossy = np.array(
            [j for (k, v), j in self._feature.items() if not is_exact({k: ast.literal_eval(v)})],
            dtype=int,
        )
        names = {j: k for (k, _), j in self._feature.items()}
        self._loss_alpha = np.array(
            [LOSS_RIDGE_ALPHA.get(names[j], LOSS_RIDGE_DEFAULT) for j in self._lossy]
        )
        for i, c in enumerate(self.candidates):
            for k, v in c.items():
                self._x[i, self._feature[(k, repr(v))]] = 1.0
        # per-dimension codes for the monotone OOM rule: NaN where the dimension is absent
        self._dims = sorted({k for c in self.candidates for k in c})
        monotone = REGISTRY.memory_orders()
        values: dict[str, dict[str, int]] = {}
        codes = np.full((len(self.candidates), len(self._dims)), np.nan)
        for i, c in enumerate(self.candidates):
            for j, d in enumerate(self._dims):
                if d in c:
                    v = c[d]
                    codes[i, j] = (
                        monotone[d](v)
                        if d in monotone
                        else values.setdefault(d, {}).setdefault(repr(v), len(values[d]))
                    )
        self._codes = codes
        self._monotone = np.array([d in monotone for d in self._dims])
        self._plans: dict[int, Config] = {}
        self._fallback = RandomSampler(seed=seed)

    # --- planning ------------------------------------------------------------------------------

    def _implied_oom(self, i: int) -> np.ndarray:
        """Candidates that need no less memory than candidate ``i`` (see needs_no_less_memory)."""
        c, o = self._codes, self._codes[i]
        absent, o_absent = np.isnan(c), np.isnan(o)
        same_presence = (absent == o_absent).all(axis=1)
        equal = (c == o) | (absent & o_absent)
        at_least = (c >= o) | (absent & o_absent)
        ok = np.where(self._monotone, at_least, equal)
        return np.asarray(same_presence & ok.all(axis=1))

    def plan(self, history: Sequence[Observation]) -> Config | None:
        """The next configuration to measure, or None when every candidate is known."""
        done = np.zeros(len(self.candidates), dtype=bool)
        peak_rows: list[int] = []
        peak_y: list[float] = []
        speed_rows: list[int] = []
        speed_y: list[float] = []
        oom_rows: list[int] = []
        oom_y: list[float] = []
        loss_rows: list[int] = []
        loss_y: list[float] = []
        for o in history:
            i = self._index.get(config_key(o.config))
            if i is None:
                continue
            done[i] = True
            if o.loss_regression is not None:
                loss_rows.append(i)
                loss_y.append(o.loss_regression)
            if o.status == "ok" and o.peak_bytes > 0:
                peak_rows.append(i)
                peak_y.append(math.log(o.peak_bytes) - self._log_peak[i])
                if o.tokens_per_s > 0:
                    speed_rows.append(i)
                    speed_y.append(math.log(o.tokens_per_s) - self._log_speed[i])
            elif o.status == "oom":
                # a lower bound: the peak was at least the live bytes when it ran out
                oom_rows.append(i)
                oom_y.append(math.log(max(o.peak_bytes, self.budget)) - self._log_peak[i])
                done |= self._implied_oom(i)

        speed_model = _Ridge(self._x.shape[1], self.ridge_alpha)
        speed_model.fit(self._x[speed_rows], speed_y)
        # Fit the peak model so that every observed OOM is predicted over the budget: raise
        # each OOM's target until the fitted model agrees (the ridge shrinks single points).
        peak_model = _Ridge(self._x.shape[1], self.ridge_alpha)
        log_budget = math.log(self.budget)
        for _ in range(20):
            peak_model.fit(self._x[peak_rows + oom_rows], peak_y + oom_y)
            low = [
                n
                for n, i in enumerate(oom_rows)
                if self._log_peak[i] + self._x[i] @ peak_model.w <= log_budget
            ]
            if not low:
                break
            for n in low:
                oom_y[n] += OOM_STEP

        if done.all():
            return None
        log_peak = self._log_peak + self._x @ peak_model.w
        # optimism in the face of uncertainty (LinUCB): among candidates the estimator ranks
        # alike, prefer choices not yet measured, whose speed correction is still unknown
        log_speed = (
            self._log_speed
            + self._x @ speed_model.w
            + self.optimism * speed_model.uncertainty(self._x)
        )
        # which lossy choices break the loss guard: a ridge (no bias) on the measured relative
        # regressions, so bf16 is not blamed for what Adafactor did in the same trial
        penalty = np.zeros(len(self.candidates))
        if loss_rows and len(self._lossy):
            x = self._x[loss_rows][:, self._lossy].astype(float)
            y = np.array(loss_y)
            w = np.linalg.solve(x.T @ x + np.diag(self._loss_alpha), x.T @ y)
            predicted = self._x[:, self._lossy] @ w
            penalty = (predicted > self.loss_tolerance).astype(float)
        penalty += self._crash_penalty(history)
        fits = (log_peak <= log_budget) & ~done
        if fits.any():
            # fewest loss-breaking or crashing choices first, then the fastest
            order = np.lexsort((-log_speed, penalty))
            best = order[fits[order]][0]
        else:
            best = int(np.argmin(np.where(done, np.inf, log_peak)))
        return self.candidates[int(best)]

    def _crash_penalty(self, history: Sequence[Observation]) -> np.ndarray:
        """1 for candidates predicted to crash: a ridge (no bias) of crashed (1) / ran (0) on
        the choices, so a combination that crashed (flash-attention in fp32) is tried last
        while each of its choices, seen running elsewhere, is not blamed alone."""
        rows, y = [], []
        for o in history:
            i = self._index.get(config_key(o.config))
            if i is not None and o.status in ("ok", "oom", "failed"):
                rows.append(i)
                y.append(1.0 if o.status == "failed" else 0.0)
        if not any(y):
            return np.zeros(len(self.candidates))
        x = self._x[rows][:, :-1].astype(float)
        w = np.linalg.solve(x.T @ x + CRASH_RIDGE_ALPHA * np.eye(x.shape[1]), x.T @ np.array(y))
        return np.asarray(self._x[:, :-1] @ w > CRASH_THRESHOLD, dtype=float)

    # --- the Optuna sampler interface ------------------------------------------------------------

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if trial.system_attrs.get("fixed_params"):
            return  # an enqueued trial (the reference, a ladder step) is already decided
        # trials other workers are running count as tried: never plan the same config twice
        running = [
            Observation(t.system_attrs[PLAN_ATTR], "running", 0.0, 0.0)
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if PLAN_ATTR in t.system_attrs
        ]
        plan = self.plan([*observations(study), *running])
        if plan is not None:
            self._plans[trial.number] = plan
            # Optuna offers a sampler no public setter for a trial's system attrs; its own
            # samplers (optuna/samplers/_grid.py) write through the storage like this
            study._storage.set_trial_system_attr(trial._trial_id, PLAN_ATTR, plan)

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


#: What a CPU "device" is to the speed prior: no published peak to trust, so every precision
#: gets the same nominal rate and the correction learns the rest (e.g. no fast fp16 kernels).
CPU_PSEUDO_GPU_TFLOPS = 1.0


def analytical_predictor(
    model_config: dict[str, Any],
    *,
    seq_len: int,
    global_batch_size: int,
    nproc: int,
    gpu_key: str | None,
    nodes: int = 1,
    documents: Documents | None = None,
) -> Predictor:
    """The analytical estimator's (peak, tokens/s) for a target GPU, or a nominal CPU."""
    from autotune.estimator.analytical import AnalyticalEstimator
    from autotune.estimator.gpus import GpuSpec, gpu_spec

    gpu = (
        gpu_spec(gpu_key)
        if gpu_key
        else GpuSpec(
            "cpu",
            "CPU",
            0,
            CPU_PSEUDO_GPU_TFLOPS,
            CPU_PSEUDO_GPU_TFLOPS,
            CPU_PSEUDO_GPU_TFLOPS,
            50.0,
            50.0,
            0.0,
            (0, 0),
        )
    )
    if nodes > 1:
        gpu = gpu.spanning(nodes, nproc // nodes)
    estimator = AnalyticalEstimator()

    def predict(config: Config) -> tuple[float, float]:
        est = estimator.estimate(
            model_config,
            config,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            nproc=nproc,
            gpu=gpu,
            documents=documents,
        )
        return float(est.peak_bytes), float(est.tokens_per_s)

    return predict
