"""autotune's own search strategy: estimator-ordered candidates, corrected by what was measured.

Every trial costs GPU minutes, so instead of learning the landscape from scratch (TPE, random,
grid) the sampler starts from what is cheap to know:

1. **Prior.** Every configuration of the (finite) space gets a predicted peak and tokens/s from
   an estimator (the analytical model: instant).
2. **Correction.** After each measured trial the prediction errors, ``log(measured/predicted)``
   for peak and for speed, are modelled by a Gaussian process over the categorical choices
   (``_HammingGP``: a shared scale error, per-choice effects and pairwise interactions), so a
   systematic error (fp16 with no fast kernels on a CPU, an activation term the formula
   misses) moves every configuration that shares the choice. Its spreads are fitted by
   marginal likelihood: the more the measurements disagree with the estimator, the less its
   ranking is trusted.
3. **Monotone pruning.** If a configuration ran out of memory, the same configuration with a
   bigger micro-batch or less checkpointing would too; those are not proposed. An OOM is
   also a lower bound on the peak and enters the correction as such.
4. **Loss and crashes.** The measured loss regressions are fitted on the lossy choices (bf16,
   fp16, other optimizers, quantization) by a ridge without bias; a configuration predicted to
   regress beyond the tolerance is tried last. Exact techniques never regress by construction.
   A crash is blamed on one choice or pair of choices of the crashed configuration not seen in
   one that ran; a candidate holding most of those suspects is tried last, and every
   candidate's acquisition is weighed by its chance to escape every crash's suspects.
5. **Choice.** Propose the untried configuration with the highest expected improvement of log
   tokens/s over the best feasible measurement times its probability to fit the budget
   (constraint-weighted EI), among those with at least a 20% chance to fit; every other
   trial only among the best one's neighbours (at most 2 choices changed: a trust region),
   unless all of them are hopeless. If nothing is likely to fit, the smallest predicted peak
   (to learn where the boundary is).
6. **Stall.** After ``STALL`` trials without a better feasible measurement the hard rules become
   beliefs: what an OOM implies and a crash's likely suspects are weighed by their chance to
   fit and to run instead of waiting last, and candidates down to a 5% chance to fit are
   considered (the optimum of a landscape the models misjudge hides behind them).

It is an Optuna sampler: each trial's whole configuration is planned in ``before_trial`` and
``sample_independent`` answers the space's suggest calls from the plan, so the study, its
storage, enqueued trials and the constraints are the same as with any other sampler.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

from autotune.runner import TIMEOUT_ERROR
from autotune.terminal import printable
from trials.techniques import TECHNIQUES, is_exact

if TYPE_CHECKING:
    from autotune.estimator.workload import Workload

Config = dict[str, Any]
#: config -> (predicted peak bytes, predicted tokens/s)
Predictor = Callable[[Config], tuple[float, float]]


#: ridge strength of the loss-regression fit for a lossy dimension whose knob states no
#: ``loss_prior`` (the prior belief that its choices do not regress the loss)
LOSS_RIDGE_DEFAULT = 0.05
#: the crash model (``_crash_risk``): the share of a crash's suspect choices and pairs
#: above which a candidate is tried last
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
    monotone = TECHNIQUES.memory_orders()
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
    #: other configurations) | failed (deterministic: never proposed again) | running |
    #: timeout (killed at the trial timeout: not proposed again)
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


#: trials without a better feasible measurement after which an OOM no longer rules out what
#: needs no less memory (``trials_since_improvement``): the rule is then one more belief
#: (the corrected peak's chance to fit) and no longer a wall
STALL = 6


def trials_since_improvement(
    history: Sequence[Observation], budget: float, loss_tolerance: float
) -> int:
    """Measured trials (in ``history``'s order) since the best feasible speed last rose."""
    best, since = 0.0, 0
    for o in history:
        if o.status == "running":
            continue
        since += 1
        if (
            o.status == "ok"
            and 0 < o.peak_bytes <= budget
            and o.tokens_per_s > best
            and (o.loss_regression is None or o.loss_regression <= loss_tolerance)
        ):
            best, since = o.tokens_per_s, 0
    return since


def observations(study: optuna.Study) -> list[Observation]:
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        # killed at the trial timeout: the same configuration would take as long again, so
        # it counts as tried (not as a crash: it says nothing of its choices)
        a = t.user_attrs
        if "config" in a and str(a.get("error", "")).startswith(TIMEOUT_ERROR):
            out.append(Observation(a["config"], "timeout", 0.0, 0.0))
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


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * (1.0 + _erf(z / math.sqrt(2.0))))


def _normal_pdf(z: np.ndarray) -> np.ndarray:
    return np.asarray(np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi))


_erf = np.vectorize(math.erf, otypes=[float])


@dataclass(frozen=True)
class Signal:
    """The prior spread of a log-correction of the estimator (peak or speed): ``bias``, the
    variance of a shared scale error (the whole estimator off by a factor); ``additive``, the
    variance of the sum of per-choice effects; ``interaction``, of what choices do together."""

    bias: float
    additive: float
    interaction: float
    #: the multiples of the spreads the marginal likelihood picks from: the speed's never
    #: below the prior's (a GP fitted to clustered measurements is overconfident about the
    #: choices it has not seen, and the optimum hides there), the peak's down to a tenth
    #: (memory is deterministic: once measured, a choice's error is known)
    scales: tuple[float, ...] = (1.0, 2.0, 4.0)


#: the peak estimator is close (its formulas are exact in most terms); the speed's roofline
#: efficiencies are guesses, and its interactions (offload x ZeRO, recompute x micro-batch)
#: are its weakest part
PEAK_SIGNAL = Signal(bias=0.25, additive=0.1, interaction=0.02, scales=(0.1, 0.3, 1.0, 3.0))
SPEED_SIGNAL = Signal(bias=1.0, additive=1.0, interaction=0.3)
#: the grid the marginal likelihood picks the measurement noise's variance from
_NOISES = (1e-3, 1e-2)
#: measurements before the spreads are fitted rather than taken from the prior
_FIT_AFTER = 4
#: differing choices that make a candidate the incumbent's neighbour (the local steps)
LOCAL_RADIUS = 2
#: how much smaller (log) a neighbour's acquisition may be than the best's for a local step
LOCAL_MARGIN = math.log(100.0)
#: an untried candidate predicted within this fraction of the best measured speed could
#: still win (``contenders``, the answer's certainty line)
CONTENDER_WITHIN = 0.10
#: study user attr: what the search has not measured that could still win
CONTENDERS_ATTR = "unmeasured_contenders"
#: a candidate less likely than this to fit the budget is not proposed while another is
MIN_FIT_PROBABILITY = 0.2
#: the same once the search has stalled (``STALL``): the corrected peak can be as wrong as the
#: speed, and a needle the peak model doubts is still weighed by its chance to fit
STALLED_MIN_FIT = 0.05


class _HammingGP:
    """A Gaussian process on the log-correction of the estimator over categorical choices.

    Its kernel is a shared bias, plus a term linear in the number of choices two
    configurations share (per-choice effects that add up, like a ridge on one-hot choices),
    plus one in the number of pairs of choices they share (what two choices do together:
    offload with a ZeRO stage, recomputation with a micro-batch). Its spreads and noise are
    chosen by marginal
    likelihood once there are a few measurements: where measurements disagree with the
    estimator the fitted spreads grow, so the prior's ranking is trusted less and untried
    regions are explored more."""

    def __init__(self, codes: np.ndarray, signal: Signal) -> None:
        self.codes = codes
        self.signal = signal
        self.scale, self.noise = 1.0, 1e-2
        self.rows: np.ndarray = np.zeros(0, dtype=int)
        self._alpha: np.ndarray = np.zeros(0)
        self._chol: np.ndarray = np.zeros((0, 0))

    def _kernel(self, shared: np.ndarray) -> np.ndarray:
        d = self.codes.shape[1]
        s = self.signal
        return (
            s.bias
            + self.scale * s.additive * shared / d
            + self.scale * s.interaction * shared * (shared - 1) / max(1, d * (d - 1))
        )

    def _shared(self, rows: np.ndarray, other: np.ndarray) -> np.ndarray:
        """Choices (absent dimensions included) candidate ``other`` shares with each row."""
        return np.asarray(
            (self.codes[other][:, None, :] == self.codes[rows][None, :, :]).sum(axis=2),
            dtype=float,
        )

    def fit(self, rows: Sequence[int], y: Sequence[float]) -> None:
        self.rows = np.asarray(rows, dtype=int)
        target = np.asarray(y, dtype=float)
        shared = self._shared(self.rows, self.rows)
        if len(self.rows) >= _FIT_AFTER:
            best = -math.inf
            for scale in self.signal.scales:
                for noise in _NOISES:
                    self.scale, self.noise = scale, noise
                    score = self._log_likelihood(shared, target)
                    if score > best:
                        best, choice = score, (scale, noise)
            self.scale, self.noise = choice
        self._factor(shared)
        self.refit_targets(target)

    def _factor(self, shared: np.ndarray) -> None:
        k = self._kernel(shared) + self.noise * np.eye(len(self.rows))
        self._chol = np.linalg.cholesky(k) if len(self.rows) else np.zeros((0, 0))

    def _log_likelihood(self, shared: np.ndarray, y: np.ndarray) -> float:
        self._factor(shared)
        a = np.linalg.solve(self._chol, y)
        return float(-0.5 * a @ a - np.log(np.diag(self._chol)).sum())

    def refit_targets(self, y: Sequence[float] | np.ndarray) -> None:
        """The same kernel on new targets (an OOM's lower bound raised)."""
        if len(self.rows):
            a = np.linalg.solve(self._chol, np.asarray(y, dtype=float))
            self._alpha = np.linalg.solve(self._chol.T, a)

    def mean(self, which: np.ndarray) -> np.ndarray:
        if not len(self.rows):
            return np.zeros(len(which))
        return np.asarray(self._kernel(self._shared(self.rows, which)) @ self._alpha)

    def predict(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and variance of the log-correction of every candidate."""
        n = len(self.codes)
        prior = self._kernel(np.full(1, float(self.codes.shape[1])))[0]
        if not len(self.rows):
            return np.zeros(n), np.full(n, prior)
        mean = np.zeros(n)
        var = np.zeros(n)
        for lo in range(0, n, 4096):
            which = np.arange(lo, min(n, lo + 4096))
            k = self._kernel(self._shared(self.rows, which))
            mean[which] = k @ self._alpha
            v = np.linalg.solve(self._chol, k.T)
            var[which] = np.maximum(prior - (v * v).sum(axis=0), 1e-9)
        return mean, var


@dataclass
class _Model:
    """What ``_assess`` made of the history, per candidate."""

    done: np.ndarray
    log_speed: np.ndarray  # corrected prediction (posterior mean)
    p_fit: np.ndarray
    penalty: np.ndarray  # > 0: predicted to crash or to break the loss guard
    incumbent: float | None  # log tokens/s of the best feasible measurement


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
        optimism: float = 0.1,
        loss_tolerance: float = 0.02,
    ) -> None:
        self.candidates = [dict(c) for c in candidates]
        self.budget = float(budget_bytes)
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
        self._loss_alpha = np.array([_loss_prior(names[j]) for j in self._lossy])
        for i, c in enumerate(self.candidates):
            for k, v in c.items():
                self._x[i, self._feature[(k, repr(v))]] = 1.0
        # per-dimension codes for the monotone OOM rule: NaN where the dimension is absent
        self._dims = sorted({k for c in self.candidates for k in c})
        monotone = TECHNIQUES.memory_orders()
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
        # per-dimension value codes (-1: dimension absent) for the GP's shared-choice counts
        self._hamming = np.full((len(self.candidates), len(self._dims)), -1, dtype=np.int16)
        for j, d in enumerate(self._dims):
            seen: dict[str, int] = {}
            for i, c in enumerate(self.candidates):
                if d in c:
                    self._hamming[i, j] = seen.setdefault(repr(c[d]), len(seen))
        # dimensions with a choice to make: one fixed value (or a value that only comes with
        # another choice, like checkpoint_every with selective checkpointing) blames nothing
        self._varied = np.array(
            [len(set(self._hamming[:, j]) - {-1}) > 1 for j in range(len(self._dims))]
        )
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
        return self._assess(history)[0]

    def contenders(self, history: Sequence[Observation], within: float = CONTENDER_WITHIN) -> int:
        """Untried candidates that could still win: predicted (the estimator corrected by the
        measurements) at least ``1 - within`` of the best feasible measured speed, more likely
        than not to fit, not predicted to crash or break the loss guard."""
        _, model = self._assess(history)
        if model is None or model.incumbent is None:
            return 0
        close = model.log_speed >= model.incumbent + math.log(1.0 - within)
        return int((close & ~model.done & (model.p_fit >= 0.5) & (model.penalty == 0)).sum())

    def _assess(self, history: Sequence[Observation]) -> tuple[Config | None, _Model | None]:
        done = np.zeros(len(self.candidates), dtype=bool)
        peak_rows: list[int] = []
        peak_y: list[float] = []
        speed_rows: list[int] = []
        speed_y: list[float] = []
        oom_rows: list[int] = []
        oom_y: list[float] = []
        loss_rows: list[int] = []
        loss_y: list[float] = []
        implied = np.zeros(len(self.candidates), dtype=bool)
        stalled = trials_since_improvement(history, self.budget, self.loss_tolerance) >= STALL
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
                implied |= self._implied_oom(i)
        # a search stalled that long may be held back by its own assumptions: memory monotone
        # in the micro-batch and checkpointing holds on real hardware, but a measurement's
        # noise at the budget's edge (or a space whose peaks are not) can hide the optimum
        # behind one OOM; the corrected peak's chance to fit still weighs those candidates
        if not stalled:
            done |= implied

        if done.all():
            return None, None
        speed_model = _HammingGP(self._hamming, SPEED_SIGNAL)
        speed_model.fit(speed_rows, speed_y)
        peak_model = _HammingGP(self._hamming, PEAK_SIGNAL)
        peak_model.fit(peak_rows + oom_rows, peak_y + oom_y)
        # Fit the peak model so that every observed OOM is predicted over the budget: raise
        # each OOM's target until the fitted model agrees (a GP smooths single points).
        log_budget = math.log(self.budget)
        for _ in range(20):
            if not oom_rows:
                break
            mean = peak_model.mean(np.array(oom_rows))
            low = [n for n, i in enumerate(oom_rows) if self._log_peak[i] + mean[n] <= log_budget]
            if not low:
                break
            for n in low:
                oom_y[n] += OOM_STEP
            peak_model.refit_targets(peak_y + oom_y)
        peak_mean, peak_var = peak_model.predict()
        log_peak = self._log_peak + peak_mean
        # probability that a candidate fits: the budget against the corrected peak's spread
        p_fit = _normal_cdf((log_budget - log_peak) / np.sqrt(peak_var + peak_model.noise))
        speed_mean, speed_var = speed_model.predict()
        log_speed = self._log_speed + speed_mean
        # constraint-weighted expected improvement (Gardner et al. 2014) in log tokens/s over
        # the fastest measured configuration that fits and passes the loss guard
        feasible = [
            (math.log(o.tokens_per_s), self._index[config_key(o.config)])
            for o in history
            if o.status == "ok"
            and config_key(o.config) in self._index
            and 0 < o.peak_bytes <= self.budget
            and o.tokens_per_s > 0
            and (o.loss_regression is None or o.loss_regression <= self.loss_tolerance)
        ]
        spread = np.sqrt(speed_var + self.optimism**2)
        incumbent = max(feasible)[0] if feasible else float(np.min(log_speed[~done]))
        z = (log_speed - incumbent) / spread
        improvement = spread * (z * _normal_cdf(z) + _normal_pdf(z))
        acquisition = np.log(np.maximum(improvement, 1e-300)) + np.log(np.maximum(p_fit, 1e-300))
        # which lossy choices break the loss guard: a ridge (no bias) on the measured relative
        # regressions, so bf16 is not blamed for what Adafactor did in the same trial
        penalty = np.zeros(len(self.candidates))
        if loss_rows and len(self._lossy):
            x = self._x[loss_rows][:, self._lossy].astype(float)
            y = np.array(loss_y)
            w = np.linalg.solve(x.T @ x + np.diag(self._loss_alpha), x.T @ y)
            predicted = self._x[:, self._lossy] @ w
            penalty = (predicted > self.loss_tolerance).astype(float)
        crash_share, p_crash = self._crash_risk(history)
        if not stalled:  # stalled: a crash's likely suspects weigh, they no longer wait last
            penalty += np.asarray(crash_share > CRASH_THRESHOLD, dtype=float)
        # what a crash costs is a trial with nothing measured: weigh the expected improvement
        # by the chance to run as well as the chance to fit (constraint-weighted EI)
        acquisition += np.log(np.maximum(1.0 - p_crash, 1e-300))
        model = _Model(done, log_speed, p_fit, penalty, max(feasible)[0] if feasible else None)
        candidates = ~done
        if (p_fit[candidates] >= MIN_FIT_PROBABILITY).any():
            candidates &= p_fit >= (STALLED_MIN_FIT if stalled else MIN_FIT_PROBABILITY)
            # every other trial a local step: the best acquisition among the incumbent's
            # neighbours (a trust region, as TuRBO / CASMOPOLITAN do for categorical spaces),
            # so a good configuration is improved choice by choice whatever the model believes
            measured = int(done.sum())
            if feasible and measured % 2 == 0:
                near = (self._hamming != self._hamming[max(feasible)[1]])[:, self._varied].sum(1)
                local = candidates & (near <= LOCAL_RADIUS)
                # unless every neighbour is hopeless next to the best candidate elsewhere
                best_here = acquisition[local].max() if local.any() else -np.inf
                if best_here >= acquisition[candidates].max() - LOCAL_MARGIN:
                    candidates = local
            # fewest loss-breaking or crashing choices first, then the best acquisition
            order = np.lexsort((-acquisition, penalty))
            best = order[candidates[order]][0]
        else:
            best = int(np.argmin(np.where(done, np.inf, log_peak)))
        return self.candidates[int(best)], model

    def _crash_risk(self, history: Sequence[Observation]) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate: the largest share of one crash's suspects it holds, and its chance to
        crash. A crash is blamed on one choice or one pair of choices of the crashed
        configuration (flash-attention with fp32), never on one seen together in a
        configuration that ran (ok or OOM); a candidate's chance to crash like it is the share
        of those suspects it contains (over ``CRASH_THRESHOLD`` it is tried last), and its
        chance to crash at all is one less the chance to escape every crash's cause. So a
        near-copy of a crash waits, a choice many crashes share is avoided, and each run
        narrows the suspects down."""
        ran, crashed = [], []
        for o in history:
            i = self._index.get(config_key(o.config))
            if i is not None and o.status in ("ok", "oom"):
                ran.append(i)
            elif i is not None and o.status == "failed":
                crashed.append(i)
        penalty = np.zeros(len(self.candidates))
        escape = np.ones(len(self.candidates))
        codes = self._hamming
        for f in crashed:
            present = (codes[f] >= 0) & self._varied
            # suspects: the crash's single choices (diagonal) and pairs, less those that ran
            suspect = np.outer(present, present)
            for r in ran:
                same = codes[r] == codes[f]
                suspect &= ~np.outer(same, same)
            total = np.triu(suspect).sum()
            if total == 0:
                continue  # every part of it ran elsewhere: a crash no combination explains
            same = (codes == codes[f]).astype(float)
            upper = np.triu(suspect).astype(float)
            share = np.einsum("ij,jk,ik->i", same, upper, same) / total
            penalty = np.maximum(penalty, share)
            escape *= 1.0 - share
        return penalty, 1.0 - escape

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


def analytical_predictor(workload: Workload) -> Predictor:
    """The analytical estimator's (peak, tokens/s) for the workload's GPU, or, where it names
    none, a nominal CPU."""
    from autotune.estimator.analytical import AnalyticalEstimator
    from autotune.estimator.gpus import GpuSpec, Machine

    if workload.gpu is None:
        cpu = GpuSpec(
            key="cpu",
            name="CPU",
            memory_bytes=0,
            bf16_tflops=CPU_PSEUDO_GPU_TFLOPS,
            fp16_tflops=CPU_PSEUDO_GPU_TFLOPS,
            fp32_tflops=CPU_PSEUDO_GPU_TFLOPS,
            hbm_gbps=50.0,
            nvlink_gbps=0.0,
            sm=(0, 0),
            machine=Machine(name="CPU", pcie_gbps=50.0, internode_gbps=12.5),
        )
        workload = replace(workload, gpu=cpu)
    estimator = AnalyticalEstimator()

    def predict(config: Config) -> tuple[float, float]:
        est = estimator.estimate(workload, config)
        return float(est.peak_bytes), float(est.tokens_per_s)

    return predict


def record_contenders(study: optuna.Study) -> None:
    """Store with the study how many untried configurations could still win (``contenders``),
    when its sampler is autotune's; the console's answer and ``show --json`` read it."""
    sampler = study.sampler
    if not isinstance(sampler, AutotuneSampler):
        return
    count = sampler.contenders(observations(study))
    study.set_user_attr(CONTENDERS_ATTR, {"within": CONTENDER_WITHIN, "count": count})


def _loss_prior(dimension: str) -> float:
    """The loss regression's ridge strength for a dimension's lossy choices."""
    knob = TECHNIQUES.knob(dimension)
    prior = knob.loss_prior if knob is not None else None
    return LOSS_RIDGE_DEFAULT if prior is None else prior
