"""The estimate backend: what ``run --backend estimate`` and the GPU pre-screen need of the
estimator (the target GPU and its machine, the estimate space, the runner that predicts instead of
training, every configuration scored and each fidelity class's best queued as a trial). The
``autotune estimate`` command and what the console prints are in ``autotune/estimate_cli.py``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import optuna
from rich.console import Console

from autotune.availability import Hardware
from autotune.backends import backend_named
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.exhaustive import (
    ClassBest,
    HostStep,
    Scored,
    best_per_class,
    host_frontier,
    score,
)
from autotune.estimator.gpus import GpuSpec, default_gpu, gpu_spec
from autotune.estimator.prediction_runners import EstimateRunner, PrescreenRunner
from autotune.estimator.workload import Workload
from autotune.runner import TrialRunner
from autotune.space import SearchSpace
from autotune.study import StudySettings
from autotune.units import parse_size
from autotune.yaml_limits import parse_yaml

ESTIMATE_SPACE = "estimate.yaml"


PRESCREEN_MARGIN = 0.25


def target_gpu(name: str | None, budget_bytes: int) -> GpuSpec:
    return gpu_spec(name) if name else default_gpu(budget_bytes)


def hardware_for(gpu: GpuSpec, nproc: int = 1) -> Hardware:
    """The target GPU's machine, with its CUDA packages (and DeepSpeed) assumed installed."""
    facts: dict[str, Any] = {
        "backend": "cuda",
        "cuda_capability": gpu.sm,
        "gpu_count": nproc,
        **{f.name: True for f in fields(Hardware) if f.name.startswith("has_")},
    }
    return Hardware(**{k: v for k, v in facts.items() if k in {f.name for f in fields(Hardware)}})


def estimate_space() -> SearchSpace:
    from importlib import resources

    text = resources.files("search_spaces").joinpath(ESTIMATE_SPACE).read_text()
    return SearchSpace.from_dict(parse_yaml(text, ESTIMATE_SPACE), ESTIMATE_SPACE)


def runner_for(settings: StudySettings, real: TrialRunner) -> TrialRunner:
    """Predictions for ``estimate``; on a GPU, real trials behind the estimator's pre-screen."""
    backend = backend_named(settings.backend)
    if not backend.measures:
        return EstimateRunner(AnalyticalEstimator(), gpu_spec(settings.target_gpu or "rtx4090"))
    if backend.cuda:
        return PrescreenRunner(real, AnalyticalEstimator(), PRESCREEN_MARGIN)
    return real


def host_budget(value: str | None, backend: str, gpu: GpuSpec | None = None) -> int | None:
    """``--host-memory``: a size; default on trial backends what this machine has, on the
    estimate backend the host memory of ``gpu``'s machine (its ``Machine`` row), unlimited
    (None) where that is not known."""
    if value:
        return parse_size(value)
    if not backend_named(backend).measures:
        return gpu.host_memory_bytes if gpu is not None else None
    return machine_memory()


def machine_memory() -> int:
    """Physical memory of this machine in bytes."""
    import os

    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def study_workload(settings: StudySettings) -> Workload:
    """What an estimate study trains, on the GPU it plans for."""
    return Workload(
        model_config=settings.model_config,
        seq_len_tokens=settings.seq_len,
        global_batch_sequences=settings.global_batch_size,
        processes=settings.nproc,
        nodes=settings.nodes,
        gpu=gpu_spec(settings.target_gpu),
        documents=settings.trial_documents(),
    )


def study_gpu(settings: StudySettings) -> GpuSpec:
    """The GPU an estimate study plans for; over several nodes ZeRO's collectives (and the
    host memory, per node) are priced on the nodes' network and hosts."""
    gpu = study_workload(settings).device
    assert gpu is not None  # a study's target GPU is named
    return gpu


def class_scores(settings: StudySettings) -> dict[str, ClassBest]:
    """Every configuration of the study's space scored; the best of each fidelity class."""
    return best_per_class(space_scores(settings))


def space_scores(settings: StudySettings) -> list[Scored]:
    """Every configuration of the study's space scored."""
    space = SearchSpace.from_dict(settings.space, "study")
    return score(
        study_workload(settings),
        space.grid(),
        budget_bytes=settings.budget_bytes,
        host_budget_bytes=settings.host_budget_bytes or None,
    )


#: the study attribute holding the host-memory frontier (``frontier_json``)
HOST_FRONTIER = "host_frontier"


def frontier_json(steps: list[HostStep]) -> list[dict[str, Any]]:
    """The frontier as ``show --json`` prints it (and the study stores it)."""
    from trials.techniques import fidelity_class

    return [
        {
            "host_size_gb": step.host_size_gb,
            "host_bytes": step.best.estimate.host_bytes,
            "class": fidelity_class(step.best.config),
            "config": step.best.config,
            "peak_bytes": step.best.estimate.peak_bytes,
            "tokens_per_s": step.best.estimate.tokens_per_s,
        }
        for step in steps
    ]


def queue_class_bests(study: optuna.Study, console: Console) -> tuple[dict[str, ClassBest], int]:
    """Score the whole space and queue each class's best (not yet in the study) as a trial, so
    that ``show``, ``report`` and ``export`` see them; returns the classes and how many."""
    import time

    from autotune.study import settings_of

    t0 = time.perf_counter()
    settings = settings_of(study)
    scored = space_scores(settings)
    per_class = best_per_class(scored)
    study.set_user_attr(HOST_FRONTIER, frontier_json(host_frontier(scored)))
    space = SearchSpace.from_dict(settings.space, "study")
    done = [t.user_attrs.get("config") for t in study.get_trials(deepcopy=False)]
    queued = 0
    for cb in per_class.values():
        if cb.best.config not in done:
            study.enqueue_trial(space.params_for(cb.best.config), user_attrs={"role": "class-best"})
            queued += 1
    n = len(space.grid())
    console.print(
        f"every configuration of the space scored ({n:,}, {time.perf_counter() - t0:.1f} s): "
        f"the best of each of {len(per_class)} fidelity classes is recorded"
    )
    return per_class, queued
