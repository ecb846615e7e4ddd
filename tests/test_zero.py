"""ZeRO through the real DeepSpeed engine (one CPU process, gloo; two processes via torchrun)."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.export import UserSettings, deepspeed_config, export
from autotune.runner import SubprocessRunner
from autotune.study import StudySettings
from tests.conftest import TINY, tiny_spec
from trials.deepspeed_engine import ensure_distributed
from trials.engines import DeepSpeedEngine
from trials.job import build_model, run_trial
from trials.memory import CpuMemoryMonitor
from trials.spec import TrialResult

#: small buckets: DeepSpeed's default 5e8-element bucket is a 2 GB buffer
SMALL_BUCKETS = {"reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000}
#: DeepSpeedCPUAdam (offload) vs torch.optim.AdamW: same update, other float order (measured
#: ~1e-6 relative over 4 steps); without offload DeepSpeed runs torch's AdamW: bit-identical.
OFFLOAD_RTOL = 1e-5


def _spec(config: dict[str, Any], **kw: Any):  # type: ignore[no-untyped-def]
    return tiny_spec({"micro_batch_size": 4, **config}, seq_len=32, **kw)


def _settings(nproc: int = 1) -> StudySettings:
    return StudySettings(
        model="tiny-llama",
        model_config=TINY,
        budget_bytes=10**9,
        budget_label="1GB",
        backend="cpu",
        seq_len=32,
        global_batch_size=8,
        space={},
        lr=3e-3,
        nproc=nproc,
    )


@pytest.fixture(scope="module")
def plain() -> TrialResult:
    result = run_trial(_spec({}))
    assert result.status == "ok", result.error
    return result


@pytest.fixture(scope="module")
def zero2() -> TrialResult:
    result = run_trial(_spec({"zero_stage": 2, **SMALL_BUCKETS}))
    assert result.status == "ok", result.error
    return result


@pytest.fixture(scope="module")
def zero2_offload() -> TrialResult:
    result = run_trial(_spec({"zero_stage": 2, "offload_optimizer": "cpu", **SMALL_BUCKETS}))
    assert result.status == "ok", result.error
    return result


def test_zero2_is_exact(plain: TrialResult, zero2: TrialResult) -> None:
    assert zero2.losses == plain.losses  # DeepSpeed runs torch's AdamW here (torch_adam)


def test_offload_matches_within_cpu_adam_tolerance(
    plain: TrialResult, zero2_offload: TrialResult
) -> None:
    assert zero2_offload.losses == pytest.approx(plain.losses, rel=OFFLOAD_RTOL)
    assert plain.losses[-1] < plain.losses[0] - 0.5  # it trains


def test_offloaded_states_leave_the_device_peak(
    zero2: TrialResult, zero2_offload: TrialResult
) -> None:
    n_params = 7_358_720
    host = zero2_offload.memory_breakdown["host_offloaded"]
    # fp32 master partition + its gradient + two Adam moments, all on the host
    assert host >= 16 * n_params
    assert zero2.memory_breakdown["host_offloaded"] == 0


def test_zero_breakdown_is_by_role_and_adds_up(
    zero2: TrialResult, zero2_offload: TrialResult
) -> None:
    """DeepSpeed's buffers by role: the device parts sum to the device peak; without offload the
    fp32 master partition and both Adam moments (12 B/param) are optimizer states on the device,
    with offload they are on the host and the device keeps none of them."""
    n_params = 7_358_720
    for result in (zero2, zero2_offload):
        device = {k: v for k, v in result.memory_breakdown.items() if k != "host_offloaded"}
        assert sum(device.values()) == result.peak_bytes
        assert device["parameters"] >= 4 * n_params  # the fp32 flat parameter group
    assert zero2.memory_breakdown["optimizer_states"] >= 12 * n_params
    assert zero2_offload.memory_breakdown["optimizer_states"] < n_params
    assert zero2.peak_bytes - zero2_offload.peak_bytes >= 8 * n_params


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        {"zero_stage": 0},
        {"zero_stage": 1},
        {"zero_stage": 1, "offload_optimizer": "cpu"},
        {"zero_stage": 3},
        {"zero_stage": 3, "offload_optimizer": "cpu"},
        {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        {"zero_stage": 3, "gradient_checkpointing": "full"},
    ],
)
def test_every_stage_matches_plain_torch(plain: TrialResult, config: dict[str, Any]) -> None:
    result = run_trial(_spec({**config, **SMALL_BUCKETS}))
    assert result.status == "ok", result.error
    assert result.losses == pytest.approx(plain.losses, rel=OFFLOAD_RTOL)


@pytest.mark.slow
def test_bf16_zero_within_bf16_tolerance(plain: TrialResult) -> None:
    result = run_trial(_spec({"zero_stage": 3, "precision": "bf16", **SMALL_BUCKETS}))
    assert result.status == "ok", result.error
    assert result.losses == pytest.approx(plain.losses, rel=1e-2)
    assert result.losses != pytest.approx(plain.losses, rel=1e-6)


def test_trial_runs_exactly_the_exported_config(tmp_path: Path) -> None:
    config = {
        "zero_stage": 2,
        "offload_optimizer": "cpu",
        "overlap_comm": True,
        "contiguous_gradients": False,
        "precision": "bf16",
        **SMALL_BUCKETS,
    }
    spec = _spec(config)
    monitor = CpuMemoryMonitor(None)
    with monitor:
        engine = DeepSpeedEngine(build_model(TINY, "sdpa", 0), spec, torch.device("cpu"), monitor)
    # with the trial's learning rate and weight decay given as the user's, the export is what
    # the trial ran, less AdamW's default betas/eps (left to the optimizer's defaults)
    user = UserSettings(lr=spec.lr, weight_decay=0.0)
    out = export("deepspeed", spec.config, _settings(), tmp_path / "ds.json", user)
    exported = json.loads(out.read_text())
    ran = copy.deepcopy(engine.ds_config)
    params = ran["optimizer"]["params"]
    assert (params.pop("betas"), params.pop("eps")) == ([0.9, 0.999], 1e-8)
    assert inspect.signature(torch.optim.AdamW).parameters["betas"].default == (0.9, 0.999)
    assert exported == ran
    assert engine.engine.zero_optimization_stage() == 2
    assert engine.engine.bfloat16_enabled()
    assert type(engine.engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"


@pytest.mark.parametrize(
    "config",
    [
        {"zero_stage": 0, "precision": "fp16"},
        {"zero_stage": 1, "offload_optimizer": "cpu", **SMALL_BUCKETS},
        {"zero_stage": 2, "overlap_comm": False, "contiguous_gradients": True, **SMALL_BUCKETS},
        {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "precision": "bf16"},
        {"zero_stage": 2, "optimizer": "lion"},
    ],
)
def test_exported_json_parses_in_deepspeed(tmp_path: Path, config: dict[str, Any]) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    ensure_distributed("cpu", deepspeed_comm=True)
    ds = deepspeed_config({**config, "micro_batch_size": 2}, _settings())
    parsed = DeepSpeedConfig(ds)
    assert parsed.zero_optimization_stage == config["zero_stage"]
    assert parsed.train_micro_batch_size_per_gpu == 2
    assert parsed.gradient_accumulation_steps == 4
    assert parsed.float16_config.enabled == (config.get("precision") == "fp16")
    assert parsed.bfloat16_config.enabled == (config.get("precision") == "bf16")
    offload = parsed.zero_config.offload_optimizer
    assert (offload is not None and str(offload.device) == "cpu") == (
        config.get("offload_optimizer") == "cpu"
    )
    if "reduce_bucket_size" in config:
        assert parsed.zero_config.reduce_bucket_size == config["reduce_bucket_size"]
    hf = json.loads(
        export(
            "hf", {**config, "micro_batch_size": 2}, _settings(), tmp_path / "a.json"
        ).read_text()
    )
    if config["zero_stage"] > 0:
        assert json.loads(Path(hf["deepspeed"]).read_text()) == ds


def test_two_ranks_zero3_lowers_the_per_rank_peak(tmp_path: Path) -> None:
    """torchrun, 2 CPU processes: ZeRO-2 and ZeRO-3 lower each rank's peak below ZeRO-0."""
    runner = SubprocessRunner(tmp_path, timeout_s=300)
    peaks = {}
    for stage in (0, 2, 3):
        spec = tiny_spec(
            {"micro_batch_size": 4, "zero_stage": stage, **SMALL_BUCKETS},
            seq_len=16,
            global_batch_size=4,
            measured_steps=1,
            nproc=2,
        )
        result = runner.run(spec, f"zero{stage}")
        assert result.status == "ok", result.error + result.stderr_tail
        assert len(result.rank_peaks) == 2 and result.peak_bytes == max(result.rank_peaks)
        assert result.tokens_per_s > 0 and len(result.losses) == 3
        peaks[stage] = result.peak_bytes
    assert peaks[2] < peaks[0] and peaks[3] < peaks[0]
    # Measured here (fp32, 2 ranks): ZeRO-3 is within 2% of ZeRO-2, not below it. At N=2 it saves
    # only ~2 B/param of model states over ZeRO-2 and pays for gathered layers and its gradient
    # partition buffer (see README).
    assert abs(peaks[3] - peaks[2]) <= 0.05 * peaks[0]
