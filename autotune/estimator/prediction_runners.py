"""Trial runners built on the estimators.

* ``EstimateRunner``: the whole study on predictions for a target GPU (``--backend estimate``):
  a trial's result is the predicted peak and tokens/s; over the budget it is an ``oom``.
* ``PrescreenRunner``: wraps a real runner on a GPU and skips, without launching, a
  configuration predicted over the budget by more than ``margin``; the skipped trial is an
  ``oom`` with the predicted peak, so the sampler still learns from it.
"""

from __future__ import annotations

from typing import Any

from autotune.estimator.base import Estimate, Estimator
from autotune.estimator.gpus import GpuSpec
from autotune.estimator.workload import Workload
from autotune.runner import TrialAttrs, TrialRunner
from autotune.units import format_size
from trials.spec import TrialResult, TrialSpec, trial_documents

PRUNED = "pruned by estimate"


def workload_of(spec: TrialSpec, gpu: GpuSpec | None) -> Workload:
    """What a trial trains, on ``gpu`` (None: on the CPU trial backend)."""
    return Workload(
        model_config=spec.model_config,
        seq_len_tokens=spec.seq_len,
        global_batch_sequences=spec.global_batch_size,
        processes=spec.nproc,
        nodes=spec.nodes,
        gpu=gpu,
        documents=trial_documents(spec, "cuda" if gpu else None),
    )


def _estimate(estimator: Estimator, spec: TrialSpec, gpu: GpuSpec | None) -> Estimate:
    return estimator.estimate(workload_of(spec, gpu), spec.config)


def _over(est: Estimate, spec: TrialSpec, margin: float = 0.0) -> str:
    """Why the prediction does not fit (device budget, then host memory), or ""."""
    if spec.budget_bytes is not None and est.peak_bytes > spec.budget_bytes * (1 + margin):
        return (
            f"predicted peak {format_size(est.peak_bytes)} is over the budget "
            f"{format_size(spec.budget_bytes)}"
        )
    host = spec.host_budget_bytes
    if host is not None and est.host_bytes > host * (1 + margin):
        return (
            f"predicted host memory {format_size(est.host_bytes)} is over --host-memory "
            f"{format_size(host)}"
        )
    return ""


class EstimateRunner(TrialRunner):
    def __init__(self, estimator: Estimator, gpu: GpuSpec) -> None:
        self.estimator = estimator
        self.gpu = gpu

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        est = _estimate(self.estimator, spec, self.gpu)
        error = _over(est, spec)
        return TrialResult(
            status="oom" if error else "ok",
            peak_bytes=est.peak_bytes,
            tokens_per_s=0.0 if error else est.tokens_per_s,
            memory_breakdown=est.breakdown,
            host_peak_bytes=est.host_bytes,
            error=error,
        )

    def attrs_for(self, result: TrialResult) -> dict[str, Any]:
        return {"predicted": True, "predicted_for": self.gpu.name, "estimator": self.estimator.name}


class PrescreenRunner(TrialRunner):
    def __init__(self, inner: TrialRunner, estimator: Estimator, margin: float = 0.25) -> None:
        self.inner = inner
        self.estimator = estimator
        self.margin = margin

    def screen(self, spec: TrialSpec) -> TrialResult | None:
        """The ``oom`` result of a configuration predicted far over the GPU or host budget,
        else None."""
        if spec.budget_bytes is not None or spec.host_budget_bytes is not None:
            est = _estimate(self.estimator, spec, None)
            why = _over(est, spec, self.margin)
            if why:
                return TrialResult(
                    status="oom",
                    peak_bytes=est.peak_bytes,
                    memory_breakdown=est.breakdown,
                    host_peak_bytes=est.host_bytes,
                    error=f"{PRUNED}: {why} + {self.margin:.0%}",
                )
        return None

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        return self.screen(spec) or self.inner.run(spec, name)

    def run_for(self, trial: TrialAttrs, spec: TrialSpec, name: str) -> TrialResult:
        return self.screen(spec) or self.inner.run_for(trial, spec, name)

    def attrs_for(self, result: TrialResult) -> dict[str, Any]:
        if result.error.startswith(PRUNED):
            return {"pruned_by_estimate": True, "predicted": True}
        return self.inner.attrs_for(result)
