"""Real training steps of a tiny LLaMA: memory is honest, exact techniques keep the loss."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_spec
from trials.job import run_trial


def _run(budget: int | None = None, **config: object):  # type: ignore[no-untyped-def]
    result = run_trial(tiny_spec(dict(config), budget))
    assert result.status in ("ok", "oom"), result.error
    return result


@pytest.fixture(scope="module")
def baseline():  # type: ignore[no-untyped-def]
    return _run()


def test_checkpointing_lowers_the_measured_peak(baseline) -> None:  # type: ignore[no-untyped-def]
    full = _run(gradient_checkpointing="full")
    selective = _run(gradient_checkpointing="selective", checkpoint_every=2)
    assert full.peak_bytes < selective.peak_bytes < baseline.peak_bytes


def test_bigger_micro_batch_raises_the_peak(baseline) -> None:  # type: ignore[no-untyped-def]
    small = _run(micro_batch_size=2)
    assert small.peak_bytes < baseline.peak_bytes


@pytest.mark.parametrize(
    "change",
    [
        {"gradient_checkpointing": "full"},
        {"gradient_checkpointing": "selective", "checkpoint_every": 2},
        {"attention": "eager"},
        {"micro_batch_size": 2},
    ],
    ids=["ckpt-full", "ckpt-selective", "eager", "grad-accum"],
)
def test_exact_techniques_keep_the_loss(baseline, change) -> None:  # type: ignore[no-untyped-def]
    other = _run(**change)
    assert len(other.losses) == len(baseline.losses) == 4
    assert other.losses == pytest.approx(baseline.losses, rel=1e-5)
    assert baseline.losses[-1] < baseline.losses[0] - 0.5  # the data is learnable


def test_lossy_techniques_change_the_loss(baseline) -> None:  # type: ignore[no-untyped-def]
    bf16 = _run(precision="bf16")
    assert bf16.losses != pytest.approx(baseline.losses, rel=1e-6)
    assert bf16.losses == pytest.approx(baseline.losses, rel=1e-2)


def test_fp16_uses_dynamic_loss_scaling() -> None:
    fp16 = run_trial(tiny_spec({"precision": "fp16", "micro_batch_size": 8}, seq_len=32))
    assert fp16.status == "ok", fp16.error
    assert all(loss == loss for loss in fp16.losses)  # finite, scaler kept it stable


def test_over_budget_is_an_oom_result(baseline) -> None:  # type: ignore[no-untyped-def]
    result = _run(budget=baseline.peak_bytes // 2)
    assert result.status == "oom"
    assert "out of memory" in result.error
    assert result.peak_bytes >= baseline.peak_bytes // 2


def test_budget_at_the_peak_fits(baseline) -> None:  # type: ignore[no-untyped-def]
    assert _run(budget=baseline.peak_bytes).status == "ok"


def test_breakdown_adds_up(baseline) -> None:  # type: ignore[no-untyped-def]
    b = baseline.memory_breakdown
    assert b["parameters"] == 4 * 7_358_720
    assert b["optimizer_states"] >= 2 * b["parameters"]  # AdamW: two fp32 moments
    assert sum(b.values()) == baseline.peak_bytes


def test_fp16_overflow_step_is_skipped_and_the_scale_lowered() -> None:
    """Dynamic loss scaling, observed: a step whose scaled gradients overflow fp16 changes no
    weight, and the scale is halved (GradScaler's backoff); the next finite step trains."""
    from trials.engines import TorchEngine
    from trials.job import build_model, rank_batches
    from trials.memory import make_monitor

    spec = tiny_spec({"precision": "fp16", "micro_batch_size": 4}, seq_len=16)
    model = build_model(spec.model_config, "sdpa", spec.seed)
    model.train()
    engine = TorchEngine(model, spec, torch.device("cpu"), make_monitor("cpu", None))
    assert engine.scaler is not None, "fp16 must train under dynamic loss scaling"
    engine.step(rank_batches(spec, 0, 0, 1))  # the scaler's scale exists after its first step
    engine.scaler.update(new_scale=2.0**100)  # any fp16 gradient overflows at this scale
    before = [p.detach().clone() for p in model.parameters()]
    engine.step(rank_batches(spec, 1, 0, 1))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert engine.scaler.get_scale() == 2.0**99
    engine.scaler.update(new_scale=2.0**8)
    engine.step(rank_batches(spec, 2, 0, 1))
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
