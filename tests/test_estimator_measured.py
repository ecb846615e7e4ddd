"""The prediction against real DeepSpeed trials on the CPU (tiny-llama, bf16): ZeRO 1-3 x offload
x 1 and 2 processes. The device peak within 5% of the measured one, and the host side (what the
trial's tracker counts as offloaded) within 5% of DeepSpeed's predicted host buffers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import Estimator
from autotune.estimator.states import model_states
from autotune.estimator.traced import TracedEstimator
from tests.conftest import measured_and_predicted, tiny_spec

SMALL_BUCKETS = {"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}
CASES = [
    {"zero_stage": 1},
    {"zero_stage": 1, "offload_optimizer": "cpu"},
    {"zero_stage": 2},
    {"zero_stage": 2, "offload_optimizer": "cpu"},
    {"zero_stage": 3},
    {"zero_stage": 3, "offload_optimizer": "cpu"},
    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
]


def _case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prediction_within_5_percent_of_a_measured_deepspeed_trial(
    case: dict, nproc: int, tmp_path: Path
) -> None:
    spec = tiny_spec(
        {"micro_batch_size": 4, "precision": "bf16", **SMALL_BUCKETS, **case},
        nproc=nproc,
        measured_steps=1,
    )
    measured, predicted = measured_and_predicted(spec, tmp_path / "t")
    assert predicted == pytest.approx(measured.peak_bytes, rel=0.05)
    # the host side: fp32 master partition, its gradients and Adam's moments, DeepSpeed's host
    # staging buffers (and stage 3's offloaded 16-bit partitions), per rank as the tracker
    # counts them
    states = model_states(
        spec.model_config,
        spec.config,
        nproc,
        zero_init=False,
        accumulation=spec.global_batch_size // 4,
        cuda=False,
    )
    assert measured.memory_breakdown["host_offloaded"] == pytest.approx(
        states.host_per_rank, rel=0.05, abs=1
    )
    # and within what the host budget allows for them (DeepSpeed's 1.5 buffer factor)
    assert states.host_per_rank * nproc <= states.host_bytes
    assert measured.host_peak_bytes > 0  # the job's peak resident set, recorded


def zero_1_2_errors(estimator: Estimator) -> list[float]:
    """``estimator``'s peak against each measured ZeRO-1/2 row of the search benchmark's
    measured reality (``benchmarks/realities/measured_mini_llama.json``), relative."""
    from benchmarks.realities.measure import DEFAULT_OUT

    table = json.loads(DEFAULT_OUT.read_text())
    return [
        estimator.estimate(
            table["model_config"],
            row["config"],
            seq_len=table["seq_len"],
            global_batch_size=table["global_batch_size"],
            nproc=1,
        ).peak_bytes
        / row["peak_bytes"]
        - 1
        for row in table["rows"]
        if row["config"].get("zero_stage") in (1, 2)
    ]


def test_zero_1_2_peaks_of_the_measured_table() -> None:
    """The analytical peak against the search benchmark's measured reality (192 real CPU trials of
    a 0.9M-parameter LLaMA): every ZeRO-1/2 row (fp32/bf16, sdpa/eager, checkpointing,
    micro-batch 1-4, optimizer offload) within 10% (reached: 8.9% at most, median |error| 2.4%);
    before the bucket was counted at the first gradient hook, with the kept activations, stage 2
    was 25% under."""
    errors = zero_1_2_errors(AnalyticalEstimator())
    assert len(errors) == 96
    assert max(abs(e) for e in errors) <= 0.10
    assert statistics.median(abs(e) for e in errors) <= 0.04


@pytest.mark.slow
def test_zero_1_2_traced_peaks_of_the_measured_table() -> None:
    """The traced estimator against the same 96 measured ZeRO-1/2 rows (a fake-tensor step each,
    ~50 s): reached median |error| 1.6%, max 10.5% (under); before the trace kept its peak from
    the first gradient hook on, where ZeRO 1-2's bucket joins it, median 7.3%, max 25%."""
    errors = zero_1_2_errors(TracedEstimator(use_cache=False))
    assert len(errors) == 96
    assert max(abs(e) for e in errors) <= 0.12
    assert statistics.median(abs(e) for e in errors) <= 0.03
