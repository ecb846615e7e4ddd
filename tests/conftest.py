"""Shared test helpers: real tiny models, real SQLite files, the real CLI."""

from __future__ import annotations

import os

# One compute thread per process, set before torch is imported here or in any trial job (they
# inherit the environment). The suite runs two test processes (pytest-xdist) on CI's two cores and
# many tests run trials of several ranks or workers side by side: with torch's default of one
# thread per core, OpenMP threads spin against each other (measured: a tiny-llama step took 6.6 s
# instead of 1.1 s beside one other busy process).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional
from click.testing import CliRunner, Result

from autotune.cli import main
from autotune.estimator.states import clear_caches
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from autotune.study import StudySettings
from trials.spec import TrialResult, TrialSpec

DATA = Path(__file__).parent / "data"
SMALL_SPACE = DATA / "small_space.yaml"
TINY = MODELS["tiny-llama"].config
#: a tiny-llama study's settings on the CPU (300 MB, seq 64, batch 8), for tests of what is made
#: from a winner without a study (the exports)
TINY_SETTINGS = StudySettings(
    model="tiny-llama",
    model_config=TINY,
    budget_bytes=300 * 10**6,
    budget_label="300MB",
    backend="cpu",
    seq_len=64,
    global_batch_size=8,
    space={},
)

#: tiny-llama at seq 64, global batch 8: about 184 MB at micro-batch 8 without checkpointing,
#: 135-142 MB with micro-batch 1 or checkpointing (measured by the CPU tracker).
SMALL_ARGS = ["--seq-len", "64", "--global-batch-size", "8"]
#: no loss probes and no finalist re-measurements: for tests about other things
NO_PROBES = ["--probe-steps", "0", "--confirm-rounds", "0"]


def tiny_spec(config: dict[str, Any], budget: int | None = None, **kw: Any) -> TrialSpec:
    base = {
        "gradient_checkpointing": "off",
        "precision": "fp32",
        "attention": "sdpa",
        "optimizer": "adamw",
        "micro_batch_size": 8,
    }
    return TrialSpec(
        model_config=TINY,
        config={**base, **config},
        seq_len=kw.pop("seq_len", 64),
        global_batch_size=kw.pop("global_batch_size", 8),
        budget_bytes=budget,
        lr=3e-3,
        **kw,
    )


def measured_and_predicted(spec: TrialSpec, folder: Path) -> tuple[TrialResult, int]:
    """A real trial of ``spec`` (it must succeed) and the analytical estimator's peak for it."""
    from autotune.estimator.analytical import AnalyticalEstimator
    from autotune.runner import SubprocessRunner
    from trials.spec import trial_documents

    result = SubprocessRunner(folder, timeout_s=600).run(spec, folder.name)
    assert result.status == "ok", result.error + result.stderr_tail
    predicted = AnalyticalEstimator().estimate(
        Workload(
            spec.model_config,
            seq_len_tokens=spec.seq_len,
            global_batch_sequences=spec.global_batch_size,
            processes=spec.nproc,
            documents=trial_documents(spec),
        ),
        spec.config,
    )
    return result, predicted.peak_bytes


def tiny_loss_and_grads(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One forward and backward of tiny-llama (seed 5, a fixed 2 x 32 batch) with the
    registry's techniques applied for ``config``: its loss and every parameter's gradient."""
    import torch

    from trials.build import build_model
    from trials.techniques import TECHNIQUES

    model = TECHNIQUES.apply(build_model(TINY, "sdpa", seed=5), config, "cpu")
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def cli(*args: str, cwd: Path | None = None) -> Result:
    """Invoke the real click command in-process (trial jobs still run as subprocesses)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


#: torch's own linear, before any test could run DeepSpeed in this process
TORCH_LINEAR = torch.nn.functional.linear


@pytest.fixture(autouse=True)
def restore_torch_linear() -> Iterator[None]:
    """DeepSpeed's ZeRO-3 engine replaces ``torch.nn.functional.linear`` with its own wrapper for
    the rest of the process (in autotune, a trial job's own process). A test that runs a ZeRO-3
    trial in-process (``run_trial``) left it to the tests after it in the same pytest worker:
    measured, a later bf16 trace of tiny-llama came out 7% lower (159,333,796 B instead of
    170,245,540). Restored after each test."""
    yield
    torch.nn.functional.linear = TORCH_LINEAR


@pytest.fixture(autouse=True)
def fresh_estimator_sums() -> None:
    """Each test computes the estimator's per-model sums itself, not from an earlier test: under
    mutmut, which forks every mutant from a process that already ran the suite, the cached sums
    hid every mutant of the functions that make them (``persistent_params``, ``_lora``: 32
    survivors, none of them real)."""
    clear_caches()


@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh folder, as a user would: the default sqlite:///autotune.db lands here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


#: The test files that take longest (measured with `pytest -n 2 --durations`: minutes each), in
#: that order. The suite runs on two pytest-xdist workers, a file to a worker
#: (`--dist loadfile --no-loadscope-reorder`); starting the longest first lets the two end
#: together, where xdist's own order (by number of tests) left these few-test files to the end
#: and one worker idle for ten minutes. Files not listed follow, in their usual order.
LONGEST_FIRST = [
    "test_estimator_measured.py",
    "test_export_consumers.py",
    "test_search_benchmark.py",
    "test_real_size.py",
    "test_cli.py",
    "test_technique_pure_bf16.py",
    "test_workers.py",
    "test_search_real.py",
    "test_slurm.py",
    "test_resilience.py",
    "test_winner_seeds.py",
    "test_zero.py",
    "test_technique_activation_offload.py",
    "test_report.py",
    "test_estimator_models.py",
    "test_estimator.py",
    "test_technique_checkpoint_save.py",
    "test_multinode.py",
    "test_lossguard.py",
    "test_job.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
