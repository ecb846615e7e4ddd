"""What a trial may cost, decided before it runs, from the estimator's predicted step time.

A trial at real size on a slow device (a model of tens of millions of parameters on two CPU
cores, everything offloaded, a micro-batch of 1) can take minutes per optimizer step. Its cost
is bounded by design:

* **the loss reference** is the exact configuration predicted to fit the budget with the
  shortest predicted step (``reference_for_cost``), not the one predicted to need the least
  memory, which is often the slowest of all;
* **fewer measured steps** where the step is predicted slow (``measured_steps_for``): as many as
  fit ``MEASURE_BUDGET_S`` of predicted time, at least ``MIN_MEASURED_STEPS`` (tokens/s is the
  median measured step: three keep one slow step from moving it) and at most the study's. The
  warm-up steps stay: the memory is measured on them (the optimizer's state exists from the
  second step on), and the loss verdict compares every step both curves have;
* **the trial's time limit** (``timeout_for``): ``TIMEOUT_FACTOR`` times the predicted time of
  all its steps, at least the floor (``--trial-timeout-floor``: the job's start, imports and
  model build) and at most the ceiling (``--trial-timeout``).

The predicted step time is the estimator's (tokens of one step over its predicted tokens/s),
calibrated to this machine (``Calibration``): by the median ratio of measured to predicted step
time over the study's measured trials once there is one, before that by the device's prior (on
a CPU, a matrix product timed here against the nominal rate the estimator assumes); then per
choice (``Calibration.ratio_for``): the estimator prices choices alike that a device runs very
differently (host offload on a CPU backend, where the "device" and the host are the same cores
and the offloaded step runs a slower path), so each choice the configuration has that earlier
trials had too gets the median ratio of those trials (a trial killed at its time limit counts
with the least ratio its limit implies), and the slowest of them, over the study's median,
scales the step. The slowest choice decides: a step predicted too slow costs a few measured
steps, one predicted too fast costs a killed trial.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.runner import TIMEOUT_ERROR

#: predicted seconds the measured steps of one trial may take before fewer are measured
MEASURE_BUDGET_S = 60.0
#: the fewest measured steps: the median of three is not moved by one slow step
MIN_MEASURED_STEPS = 3
#: a trial's time limit: this many times the predicted time of all its steps ...
TIMEOUT_FACTOR = 4.0
#: ... and at least this many seconds (the job's start: imports, a DeepSpeed op's first build,
#: the model's build, the first step)
TIMEOUT_FLOOR_S = 300.0
#: trial user attrs: what this trial was allowed (its record and the console say so)
PREDICTED_STEP_ATTR = "predicted_step_s"
MEASURED_STEPS_ATTR = "measured_steps"
TIMEOUT_ATTR = "trial_timeout_s"

Config = dict[str, Any]
#: config -> (predicted peak bytes, predicted tokens/s)
Predictor = Callable[[Config], tuple[float, float]]


@dataclass(frozen=True)
class TrialCost:
    """What one trial may spend: its measured steps and its time limit, and why."""

    measured_steps: int
    timeout_s: float
    #: the calibrated predicted seconds of one optimizer step (None: no prediction)
    predicted_step_s: float | None = None

    def attrs(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            MEASURED_STEPS_ATTR: self.measured_steps,
            TIMEOUT_ATTR: self.timeout_s,
        }
        if self.predicted_step_s is not None:
            out[PREDICTED_STEP_ATTR] = round(self.predicted_step_s, 3)
        return out


def measured_steps_for(step_s: float | None, most: int, budget_s: float = MEASURE_BUDGET_S) -> int:
    """Measured steps for a predicted step of ``step_s`` seconds: as many as fit ``budget_s``,
    at least ``MIN_MEASURED_STEPS`` (never more than ``most``, the study's own count)."""
    if step_s is None or step_s <= 0 or not math.isfinite(step_s):
        return most
    fit = int(budget_s // step_s)
    return max(min(MIN_MEASURED_STEPS, most), min(most, fit))


def timeout_for(
    step_s: float | None,
    steps: int,
    ceiling_s: float,
    floor_s: float = TIMEOUT_FLOOR_S,
    factor: float = TIMEOUT_FACTOR,
) -> float:
    """A trial's time limit: ``factor`` times its ``steps`` predicted steps, within
    [``floor_s``, ``ceiling_s``] (without a prediction: the ceiling)."""
    if step_s is None or step_s <= 0 or not math.isfinite(step_s):
        return ceiling_s
    return float(min(ceiling_s, max(floor_s, math.ceil(factor * steps * step_s))))


def reference_for_cost(
    exact: Sequence[Config],
    predict: Predictor,
    budget_bytes: float,
    tokens_per_step: float,
    prefer: dict[str, Any] | None = None,
) -> Config:
    """The loss reference: among the exact configurations predicted to fit ``budget_bytes``,
    the one with the shortest predicted step (ties: the most of ``prefer``'s choices, then the
    least predicted memory, then grid order); if none is predicted to fit, the one predicted to
    need the least memory (if anything exact fits, it does)."""
    prefer = prefer or {}
    rows = []
    for i, config in enumerate(exact):
        peak, tokens_per_s = predict(config)
        step = tokens_per_step / tokens_per_s if tokens_per_s > 0 else math.inf
        liked = sum(config.get(k) == v for k, v in prefer.items())
        rows.append((peak, step, -liked, i))
    if not rows:
        raise ValueError("no exact configuration")
    fitting = [r for r in rows if r[0] <= budget_bytes]
    if fitting:
        best = min(fitting, key=lambda r: (r[1], r[2], r[0], r[3]))
    else:
        best = min(rows, key=lambda r: (r[0], r[2], r[3]))
    return dict(exact[best[3]])


#: the rate (FLOP/s) the analytical estimator assumes for a CPU (strategy.CPU_PSEUDO_GPU_TFLOPS)
def _cpu_nominal_flops() -> float:
    from autotune.strategy import CPU_PSEUDO_GPU_TFLOPS

    return CPU_PSEUDO_GPU_TFLOPS * 1e12


def cpu_matmul_flops(seconds: float = 0.3, n: int = 512) -> float:
    """FLOP/s of an fp32 matrix product on this machine's CPU now (its load included)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # the first product allocates and picks its kernel
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        runs += 1
    return 2.0 * n**3 * runs / max(elapsed, 1e-9)


class Calibration:
    """Predicted step time -> seconds on this machine: the median of measured over predicted
    step time of the study's measured trials; before any, the device's prior."""

    def __init__(
        self,
        predict: Predictor,
        tokens_per_step: float,
        prior: float | Callable[[], float] = 1.0,
        warmup_steps: int = 0,
    ) -> None:
        self.predict = predict
        self.tokens_per_step = tokens_per_step
        self._prior = prior
        #: steps a trial runs besides its measured ones (a killed trial's limit covered them too)
        self.warmup_steps = warmup_steps

    def raw_step_s(self, config: Config) -> float | None:
        try:
            tokens_per_s = self.predict(config)[1]
        except (KeyError, ValueError, NotImplementedError):
            return None  # an architecture or choice the analytical estimator does not know
        return self.tokens_per_step / tokens_per_s if tokens_per_s > 0 else None

    def ratio(self, study: optuna.Study) -> float:
        ratios = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            a = t.user_attrs
            measured = a.get("step_time_s")
            if a.get("status") != "ok" or not isinstance(measured, int | float) or measured <= 0:
                continue
            if not isinstance(a.get("config"), dict) or a.get("duplicate_of") is not None:
                continue
            raw = self.raw_step_s(a["config"])
            if raw:
                ratios.append(float(measured) / raw)
        if ratios:
            return statistics.median(ratios)
        if callable(self._prior):
            self._prior = self._prior()
        return float(self._prior)

    def observed(self, study: optuna.Study) -> list[tuple[Config, float]]:
        """(configuration, measured / predicted step time) of each measured trial, and of each
        trial killed at its time limit the least ratio that limit implies (the limit over the
        predicted time of all the steps it was given)."""
        out = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            a = t.user_attrs
            config = a.get("config")
            if not isinstance(config, dict) or a.get("duplicate_of") is not None:
                continue
            measured = a.get("step_time_s")
            limit, steps = a.get(TIMEOUT_ATTR), a.get(MEASURED_STEPS_ATTR)
            if t.state == TrialState.COMPLETE:
                if a.get("status") != "ok" or not isinstance(measured, int | float):
                    continue
                if measured <= 0:
                    continue
                seconds = float(measured)
            elif (
                str(a.get("error", "")).startswith(TIMEOUT_ERROR)
                and isinstance(limit, int | float)
                and isinstance(steps, int)
                and limit > 0
                and steps > 0
            ):
                seconds = float(limit) / (steps + self.warmup_steps)
            else:
                continue
            raw = self.raw_step_s(config)
            if raw:
                out.append((config, seconds / raw))
        return out

    def ratio_for(self, config: Config, study: optuna.Study) -> float:
        """The study's ratio (``ratio``) scaled by the slowest choice of ``config``: for each of
        its choices that observed trials (``observed``) had too, their median ratio over the
        study's; the largest of these (none: 1)."""
        base = self.ratio(study)
        seen = self.observed(study)
        factors = []
        for key, value in config.items():
            group = [r for c, r in seen if key in c and c[key] == value]
            if group:
                factors.append(statistics.median(group) / base)
        return base * max(factors) if factors else base

    def step_s(self, config: Config, study: optuna.Study) -> float | None:
        raw = self.raw_step_s(config)
        return None if raw is None else raw * self.ratio_for(config, study)


class TrialCosts:
    """Each trial's measured steps and time limit, for a study (``Objective`` asks before each
    trial it runs)."""

    def __init__(
        self,
        calibration: Calibration | None,
        most_steps: int,
        warmup_steps: int,
        ceiling_s: float,
        floor_s: float = TIMEOUT_FLOOR_S,
    ) -> None:
        self.calibration = calibration
        self.most_steps = most_steps
        self.warmup_steps = warmup_steps
        self.ceiling_s = ceiling_s
        self.floor_s = min(floor_s, ceiling_s)

    def for_config(self, config: Config, study: optuna.Study) -> TrialCost:
        step = None if self.calibration is None else self.calibration.step_s(config, study)
        steps = measured_steps_for(step, self.most_steps)
        timeout = timeout_for(step, self.warmup_steps + steps, self.ceiling_s, self.floor_s)
        return TrialCost(steps, timeout, step)


def describe(cost: TrialCost, most_steps: int) -> str:
    """The console's line for a trial whose steps or time limit differ from the study's."""
    step = cost.predicted_step_s
    head = f"predicted step {step:.0f} s" if step is not None else "no predicted step"
    fewer = (
        f"{cost.measured_steps} measured steps instead of {most_steps}"
        if cost.measured_steps < most_steps
        else f"{cost.measured_steps} measured steps"
    )
    return f"{head}: {fewer}, time limit {cost.timeout_s:.0f} s"


def study_costs(s: Any, ceiling_s: float, floor_s: float = TIMEOUT_FLOOR_S) -> TrialCosts:
    """The ``TrialCosts`` of a study from its settings (``study.StudySettings``, which imports
    this module): the analytical estimator for its device
    (on a CPU, calibrated by a timed matrix product until a trial is measured)."""
    calibration = None
    if s.backend != "estimate":
        try:
            calibration = Calibration(
                study_predictor(s),
                s.seq_len * s.global_batch_size * s.nproc,
                (lambda: _cpu_nominal_flops() / cpu_matmul_flops()) if s.backend == "cpu" else 1.0,
                s.warmup_steps,
            )
        except (KeyError, ValueError, NotImplementedError):
            calibration = None
    return TrialCosts(calibration, s.measured_steps, s.warmup_steps, ceiling_s, floor_s)


def study_predictor(s: Any) -> Predictor:
    """The analytical estimator's (peak, tokens/s) for the study's workload: its target GPU,
    else the GPU a CUDA study runs on (a card the table lacks, like a CPU study, gets the
    nominal device)."""
    from autotune.availability import detected_gpu_key
    from autotune.backends import backend_named
    from autotune.estimator.gpus import gpu_spec
    from autotune.estimator.workload import Workload
    from autotune.strategy import analytical_predictor

    gpu_key = s.target_gpu or (detected_gpu_key() if backend_named(s.backend).cuda else None)
    return analytical_predictor(
        Workload(
            model_config=s.model_config,
            seq_len_tokens=s.seq_len,
            global_batch_sequences=s.global_batch_size,
            processes=s.nproc,
            nodes=s.nodes,
            gpu=gpu_spec(gpu_key) if gpu_key else None,
            documents=s.trial_documents(),
        )
    )
