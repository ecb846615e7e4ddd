"""Making a real autotune study directly (no trials yet), for tests that then drive it."""

from __future__ import annotations

from pathlib import Path

import optuna

from autotune.availability import Hardware
from autotune.models import resolve_model
from autotune.space import SearchSpace
from autotune.storage import open_storage
from autotune.study import StudySettings, create_or_load
from autotune.units import budget_label, parse_size


def make_study(
    storage_url: str, name: str, space: Path, budget: str = "150MB", backend: str = "cpu"
) -> optuna.Study:
    """What ``autotune run`` creates for tiny-llama at seq 64, batch 8 (on the CPU)."""
    entry = resolve_model("tiny-llama")
    resolved = SearchSpace.load(space).resolve(8, Hardware.detect("cpu"))
    settings = StudySettings(
        model=entry.name,
        model_config=entry.config,
        budget_bytes=parse_size(budget),
        budget_label=budget_label(budget),
        backend=backend,
        seq_len=64,
        global_batch_size=8,
        space=resolved.as_dict(),
        probe_steps=0,  # tests about storage and workers: no loss probes, no re-measurements
        confirm_rounds=0,
    )
    return create_or_load(open_storage(storage_url), name, settings)


def records_study(
    storage_url: str, name: str, budget_bytes: int, budget_label: str, allow: str = "adapters"
) -> optuna.Study:
    """An empty tiny-llama study (no space, no model config) for tests that write trial records
    by hand and read decisions back."""
    settings = StudySettings(
        model="tiny-llama",
        model_config={},
        budget_bytes=budget_bytes,
        budget_label=budget_label,
        backend="cpu",
        seq_len=64,
        global_batch_size=8,
        space={},
        allow=allow,
    )
    return create_or_load(open_storage(storage_url), name, settings)
