"""Every configuration of a space scored by the analytical estimator, and the best of each
fidelity class (``trials.techniques.FIDELITY_CLASSES``: exact, mixed, reduced_state,
other_optimizer, adapters).

The per-model quantities (parameter shapes, optimizer-state bytes) are computed once per model,
so a configuration costs a few arithmetic operations: llama-70b's whole estimate space on 8 GPUs
(thousands of configurations) is scored in a few seconds. Configurations whose predicted speed
is within the speed model's error of a class's best (``speed.MODEL_ERROR``) are ties: the
estimator cannot tell them apart, and the answer says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import Estimate
from autotune.estimator.gpus import GpuSpec
from autotune.estimator.paging import apply_budget
from autotune.estimator.speed import MODEL_ERROR
from trials.data import Documents
from trials.techniques import FIDELITY_CLASSES, fidelity_class


@dataclass
class Scored:
    config: dict[str, Any]
    estimate: Estimate
    fits: bool
    why_not: str = ""  # over the device budget, over the host memory


@dataclass
class ClassBest:
    cls: str
    best: Scored
    ties: list[Scored] = field(default_factory=list)  # within MODEL_ERROR of the best's speed


def score(
    model_config: dict[str, Any],
    configs: Iterable[dict[str, Any]],
    *,
    seq_len: int,
    global_batch_size: int,
    nproc: int,
    gpu: GpuSpec,
    budget_bytes: int,
    host_budget_bytes: int | None = None,
    documents: Documents | None = None,
) -> list[Scored]:
    """Every configuration with its prediction and whether it fits both memories (a paged
    optimizer's states beyond the budget in host memory, ``autotune.estimator.paging``)."""
    est = AnalyticalEstimator()
    out: list[Scored] = []
    for config in configs:
        e = est.estimate(
            model_config,
            config,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            nproc=nproc,
            gpu=gpu,
            documents=documents,
        )
        apply_budget(e, model_config, config, budget_bytes, gpu)
        why = ""
        if e.peak_bytes > budget_bytes:
            why = "device memory"
        elif host_budget_bytes is not None and e.host_bytes > host_budget_bytes:
            why = "host memory"
        out.append(Scored(config, e, not why, why))
    return out


def best_per_class(scored: list[Scored], tie: float = MODEL_ERROR) -> dict[str, ClassBest]:
    """The fastest fitting configuration of each class (least device memory among equal
    speeds), with the ones within ``tie`` of its speed."""
    out: dict[str, ClassBest] = {}
    for cls in FIDELITY_CLASSES:
        fitting = [s for s in scored if s.fits and fidelity_class(s.config) == cls]
        if not fitting:
            continue
        fitting.sort(key=lambda s: (-s.estimate.tokens_per_s, s.estimate.peak_bytes))
        best = fitting[0]
        floor = best.estimate.tokens_per_s * (1 - tie)
        ties = [s for s in fitting[1:] if s.estimate.tokens_per_s >= floor]
        out[cls] = ClassBest(cls, best, ties)
    return out


def headline(per_class: dict[str, ClassBest]) -> ClassBest | None:
    """The answer to "how do I train this model": the faster of the best exact and the best
    mixed-precision configuration (both train the full model with AdamW's update)."""
    candidates = [per_class[c] for c in ("exact", "mixed") if c in per_class]
    if not candidates:
        return None
    return max(candidates, key=lambda c: c.best.estimate.tokens_per_s)
