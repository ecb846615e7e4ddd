"""A local CPU study trains its loss probes in the controller's own process: the curve must be
the one a job process trains (the oracle: ``python -m trials.job`` through the real
``SubprocessRunner``), so the probe cache holds the same numbers whichever trained them."""

from __future__ import annotations

from pathlib import Path

from autotune.lossguard import PROXY_BATCH, PROXY_SEQ, proxy_config
from autotune.models import resolve_model
from autotune.runner import InProcessRunner, SubprocessRunner
from trials.spec import TrialSpec


def _probe_spec(precision: str) -> TrialSpec:
    return TrialSpec(
        model_config=proxy_config(resolve_model("tiny-llama").config),
        config={"precision": precision, "attention": "sdpa", "micro_batch_size": PROXY_BATCH},
        seq_len=PROXY_SEQ,
        global_batch_size=PROXY_BATCH,
        budget_bytes=None,
        backend="cpu",
        warmup_steps=0,
        measured_steps=12,
        seed=1,
        lr=3e-3,
    )


def test_the_in_process_curve_is_the_job_process_curve(tmp_path: Path) -> None:
    spec = _probe_spec("bf16")
    job = SubprocessRunner(tmp_path).run(spec, "probe")
    here = InProcessRunner().run(spec, "probe")
    assert job.status == here.status == "ok", (job.error, job.stderr_tail, here.error)
    assert len(here.losses) == 12
    assert here.losses == job.losses


def test_a_job_that_raises_is_a_failed_result() -> None:
    spec = _probe_spec("bf16")
    spec.config["attention"] = "no_such_attention"
    result = InProcessRunner().run(spec, "probe")
    assert result.status == "failed" and result.error
