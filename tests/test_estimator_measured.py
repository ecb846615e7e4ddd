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
from autotune.estimator.workload import Workload
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


#: the trials of ``test_prediction_within_5_percent_of_a_measured_deepspeed_trial`` (slow), as
#: as measured: case-ranks -> (training peak, host bytes the tracker counted as
#: offloaded, the peak agreement allowed: twice the analytical estimator's reached, at least
#: 0.05%). Reached: peaks -0.002% to +1.5% (stage 3 on two ranks the most), host bytes exact but
#: ZeRO-2 with offload on two ranks (-0.17%)
MEASURED_TINY = {
    "zero_stage=1-offload_optimizer=cpu-n1": (81_293_204, 136_651_264, 0.0053),
    "zero_stage=2-offload_optimizer=cpu-n1": (56_575_764, 151_368_704, 0.0076),
    "zero_stage=3-offload_optimizer=cpu-n1": (62_381_461, 132_456_960, 0.0069),
    "zero_stage=3-offload_optimizer=cpu-offload_param=cpu-n1": (47_664_020, 147_174_401, 0.0091),
    "zero_stage=1-offload_optimizer=cpu-n2": (81_297_300, 70_422_784, 0.0052),
    "zero_stage=2-offload_optimizer=cpu-n2": (56_579_860, 77_912_320, 0.0075),
    "zero_stage=3-offload_optimizer=cpu-n2": (69_039_765, 66_228_480, 0.0265),
    "zero_stage=3-offload_optimizer=cpu-offload_param=cpu-n2": (61_681_044, 73_587_201, 0.0297),
    "zero_stage=1-n2": (121_255_320, 0, 0.0035),
    "zero_stage=2-n2": (104_027_416, 0, 0.0016),
    "zero_stage=3-n2": (120_550_813, 0, 0.0152),
    "zero_stage=1-n1": (191_331_092, 0, 0.0005),
    "zero_stage=2-n1": (191_331_092, 0, 0.0005),
    "zero_stage=3-n1": (216_048_553, 0, 0.0005),
}


def _measured_case(key: str) -> tuple[dict, int]:
    *pairs, ranks = key.split("-")
    case = {}
    for pair in pairs:
        name, value = pair.split("=")
        case[name] = int(value) if value.isdigit() else value
    return case, int(ranks[1:])


@pytest.mark.parametrize("key", MEASURED_TINY)
def test_deepspeed_trials_as_measured(key: str) -> None:
    """The fast twin of the slow test above: its measured peaks and host bytes (ZeRO 1-3, with
    and without optimizer and parameter offload, one and two ranks), pinned, against the
    analytical peak and ``host_per_rank``."""
    case, nproc = _measured_case(key)
    peak, host, rel = MEASURED_TINY[key]
    spec = tiny_spec(
        {"micro_batch_size": 4, "precision": "bf16", **SMALL_BUCKETS, **case},
        nproc=nproc,
        measured_steps=1,
    )
    predicted = AnalyticalEstimator().estimate(
        Workload(
            spec.model_config,
            seq_len_tokens=spec.seq_len,
            global_batch_sequences=spec.global_batch_size,
            processes=nproc,
        ),
        spec.config,
    )
    assert predicted.peak_bytes == pytest.approx(peak, rel=rel)
    states = model_states(
        spec.model_config,
        spec.config,
        nproc,
        zero_init=False,
        accumulation=spec.global_batch_size // 4,
        cuda=False,
    )
    assert states.host_per_rank == pytest.approx(host, rel=0.004)


def measured_table_errors(estimator: Estimator, stages: tuple[int, ...]) -> list[float]:
    """``estimator``'s peak against each measured row of the search benchmark's measured
    reality (``benchmarks/realities/measured_mini_llama.json``) at these ZeRO stages,
    relative."""
    from benchmarks.realities.measure import DEFAULT_OUT

    table = json.loads(DEFAULT_OUT.read_text())
    return [
        estimator.estimate(
            Workload(
                table["model_config"],
                seq_len_tokens=table["seq_len"],
                global_batch_sequences=table["global_batch_size"],
                processes=1,
            ),
            row["config"],
        ).peak_bytes
        / row["peak_bytes"]
        - 1
        for row in table["rows"]
        if row["config"].get("zero_stage") in stages
    ]


def test_zero_1_2_peaks_of_the_measured_table() -> None:
    """The analytical peak against the search benchmark's measured reality (192 real CPU trials of
    a 0.9M-parameter LLaMA): every ZeRO-1/2 row (fp32/bf16, sdpa/eager, checkpointing,
    micro-batch 1-4, optimizer offload) within 10% (reached: 8.0% at most, median |error|
    0.34%); before the bucket was counted at the first gradient hook, with the kept activations,
    stage 2 was 25% under; before the gradient firing that hook and the fp64 norm copies were
    counted, median 2.4%, max 8.9%."""
    errors = measured_table_errors(AnalyticalEstimator(), (1, 2))
    assert len(errors) == 96
    assert max(abs(e) for e in errors) <= 0.10
    assert statistics.median(abs(e) for e in errors) <= 0.007


@pytest.mark.slow
def test_zero_1_2_traced_peaks_of_the_measured_table() -> None:
    """The traced estimator against the same 96 measured ZeRO-1/2 rows (a fake-tensor step each,
    ~50 s): reached median |error| 0.17%, max 6.1%; before the trace kept its peak from the
    first gradient hook on, where ZeRO 1-2's bucket joins it, median 7.3%, max 25%; before the
    instant of that hook was kept apart (the gradient firing it, the norm copies counted),
    median 1.6%, max 10.5%."""
    errors = measured_table_errors(TracedEstimator(use_cache=False), (1, 2))
    assert len(errors) == 96
    assert max(abs(e) for e in errors) <= 0.08
    assert statistics.median(abs(e) for e in errors) <= 0.004


def test_zero_0_peaks_of_the_measured_table() -> None:
    """The analytical peak against the 24 measured rows that run DeepSpeed's engine without
    ZeRO (fp32/bf16, sdpa/eager, checkpointing, micro-batch 1-4): reached median |error| 0.01%,
    max 1.0%. Before they were priced as DeepSpeed (fp32 master copies beside the bf16 model,
    fp32 gradient copies at the step, the all-reduce's flat buffer) rather than as plain
    training: median 3.5%, 14.7% under."""
    errors = measured_table_errors(AnalyticalEstimator(), (0,))
    assert len(errors) == 24
    assert max(abs(e) for e in errors) <= 0.02
    assert statistics.median(abs(e) for e in errors) <= 0.001


@pytest.mark.slow
def test_zero_0_traced_peaks_of_the_measured_table() -> None:
    """The traced estimator against the same 24 rows: reached median |error| 0.014%, max
    0.56%."""
    errors = measured_table_errors(TracedEstimator(use_cache=False), (0,))
    assert len(errors) == 24
    assert max(abs(e) for e in errors) <= 0.01
    assert statistics.median(abs(e) for e in errors) <= 0.001


def test_zero_3_peaks_of_the_measured_table() -> None:
    """The analytical peak against the 72 measured ZeRO-3 rows of the same table (parameter
    and optimizer offload, fp32/bf16, checkpointing, micro-batch 1-4): reached median |error|
    0.01%, max 0.73%. Before the epilogue's reduction counted its concatenated gradients (and
    gloo's copy of them), fp32 with offload was 19% under (median 0.55%)."""
    errors = measured_table_errors(AnalyticalEstimator(), (3,))
    assert len(errors) == 72
    assert max(abs(e) for e in errors) <= 0.015
    assert statistics.median(abs(e) for e in errors) <= 0.001


@pytest.mark.slow
def test_zero_3_traced_peaks_of_the_measured_table() -> None:
    """The traced estimator against the same 72 ZeRO-3 rows (~40 s): reached median |error|
    0.007%, max 0.41%."""
    errors = measured_table_errors(TracedEstimator(use_cache=False), (3,))
    assert len(errors) == 72
    assert max(abs(e) for e in errors) <= 0.01
    assert statistics.median(abs(e) for e in errors) <= 0.001


#: the scale replica (a 91M-parameter llama: vocab 32,000 x hidden 1,024), bf16, micro-batch 4 x
#: seq 64, the optimizer offloaded: its embedding and head are 72% of the parameters, so
#: DeepSpeed's per-gradient buffers (the largest gradient's fp64 norm copy) decide the peak
REPLICA_OFFLOAD = {
    "gradient_checkpointing": "off",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 4,
    "precision": "bf16",
    "offload_optimizer": "cpu",
}


#: (the ZeRO config, the agreement allowed: about twice the one reached). Measured training
#: peak, analytical / traced: ZeRO-1 702,607,512 B, -0.00% / -0.00%; ZeRO-2 611,427,484 B,
#: +0.16% / +0.10%; ZeRO-2 with a 5e7 bucket 626,178,844 B, -0.43% / -0.46%; ZeRO-3 545,891,485
#: B, +0.18% / +0.11%; ZeRO-3 + parameter offload 363,429,020 B, +0.27% / +0.16%; the same with
#: a 5e7 bucket 475,179,892 B, -1.78% / -1.82% (the bucket also takes the next layer's MLP
#: down-projection, 2.9M elements, which the estimator's walk, a layer at a time, leaves out)
REPLICA_CASES = {
    "zero1": ({"zero_stage": 1, "reduce_bucket_size": 5_000_000}, 0.001),
    "zero2-head-over-bucket": ({"zero_stage": 2, "reduce_bucket_size": 5_000_000}, 0.004),
    "zero2-overflow-after-a-layer": ({"zero_stage": 2, "reduce_bucket_size": 50_000_000}, 0.01),
    "zero3": ({"zero_stage": 3, "reduce_bucket_size": 5_000_000}, 0.004),
    "zero3-param-offload": (
        {"zero_stage": 3, "offload_param": "cpu", "reduce_bucket_size": 5_000_000},
        0.006,
    ),
    "zero3-param-offload-overflow-after-a-layer": (
        {"zero_stage": 3, "offload_param": "cpu", "reduce_bucket_size": 50_000_000},
        0.04,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", REPLICA_CASES)
def test_replica_zero_offload_peaks_as_measured(case: str) -> None:
    """Both estimators against a real ZeRO + optimizer offload trial of the scale replica (one
    rank, run unbounded in this process). DeepSpeed takes each gradient's norm from an fp64
    copy (8 B/element): stage 1 as the boundary's reduction copies the gradients to the host,
    beside every 16-bit gradient; stages 2-3 at the first reduction in backward: the head's
    gradient, over a 5e6 bucket, alone (every activation held), or, with a 5e7 bucket, when the
    last layer's gradients overflow it (half the layers' activations held; stage 3 beside the
    reduce-scatter's flat output). Reached: ``REPLICA_CASES``. Before these buffers were
    counted: -37% and -39% (stages 1 and 2, analytical) and -95% (stage 3 with both offloads,
    at seq 16 and micro-batch 1)."""
    from tests.test_real_size import REPLICA
    from trials.job import run_trial
    from trials.spec import TrialSpec

    extra, tolerance = REPLICA_CASES[case]
    config = {**REPLICA_OFFLOAD, **extra}
    # the estimates first: a ZeRO-3 trial leaves this process's modules patched
    predicted = [
        estimator.estimate(
            Workload(REPLICA, seq_len_tokens=64, global_batch_sequences=4), config
        ).peak_bytes
        for estimator in (AnalyticalEstimator(), TracedEstimator(use_cache=False))
    ]
    spec = TrialSpec(
        model_config=REPLICA,
        config=config,
        seq_len=64,
        global_batch_size=4,
        budget_bytes=None,
        warmup_steps=2,
        measured_steps=1,
        lr=3e-3,
    )
    measured = run_trial(spec)
    assert measured.status == "ok", measured.error
    for peak in predicted:
        assert peak == pytest.approx(measured.training_peak_bytes, rel=tolerance)


#: one bf16 row per ZeRO stage of the measured table (sdpa, no checkpointing, micro-batch 4):
#: stage -> the traced estimator's agreement allowed (reached +0.29%, -1.39%, +0.25%, -0.006%)
TRACED_ROWS = {0: 0.006, 1: 0.028, 2: 0.005, 3: 0.0005}


@pytest.mark.parametrize("stage", TRACED_ROWS)
def test_traced_peak_of_one_measured_row_per_stage(stage: int) -> None:
    """A fast sample of the slow traced tests above: the traced estimator (the trial's own step
    on fake tensors, DeepSpeed's states marked for it) against one measured bf16 row a stage."""
    from benchmarks.realities.measure import DEFAULT_OUT

    table = json.loads(DEFAULT_OUT.read_text())
    (row,) = [
        row
        for row in table["rows"]
        if row["config"].get("zero_stage") == stage
        and row["config"]["precision"] == "bf16"
        and row["config"]["micro_batch_size"] == 4
        and row["config"]["gradient_checkpointing"] == "off"
        and row["config"]["attention"] == "sdpa"
        and row["config"].get("offload_optimizer", "none") == "none"
        and row["config"].get("offload_param", "none") == "none"
    ]
    predicted = TracedEstimator(use_cache=False).estimate(
        Workload(
            table["model_config"],
            seq_len_tokens=table["seq_len"],
            global_batch_sequences=table["global_batch_size"],
            processes=1,
        ),
        row["config"],
    )
    assert predicted.peak_bytes == pytest.approx(row["peak_bytes"], rel=TRACED_ROWS[stage])
