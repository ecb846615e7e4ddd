"""Shared test helpers: real tiny models, real SQLite files, the real CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from autotune.cli import main
from autotune.models import REGISTRY
from autotune.study import StudySettings
from trials.spec import TrialResult, TrialSpec

DATA = Path(__file__).parent / "data"
SMALL_SPACE = DATA / "small_space.yaml"
TINY = REGISTRY["tiny-llama"].config
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

    result = SubprocessRunner(folder, timeout_s=600).run(spec, folder.name)
    assert result.status == "ok", result.error + result.stderr_tail
    predicted = AnalyticalEstimator().estimate(
        spec.model_config,
        spec.config,
        seq_len=spec.seq_len,
        global_batch_size=spec.global_batch_size,
        nproc=spec.nproc,
    )
    return result, predicted.peak_bytes


def tiny_loss_and_grads(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """One forward and backward of tiny-llama (seed 5, a fixed 2 x 32 batch) with the
    registry's techniques applied for ``config``: its loss and every parameter's gradient."""
    import torch

    from trials.build import build_model
    from trials.techniques import REGISTRY as TECHNIQUES

    model = TECHNIQUES.apply(build_model(TINY, "sdpa", seed=5), config, "cpu")
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def cli(*args: str, cwd: Path | None = None) -> Result:
    """Invoke the real click command in-process (trial jobs still run as subprocesses)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh folder, as a user would: the default sqlite:///autotune.db lands here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
