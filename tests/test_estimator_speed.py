"""The speed model ranks configurations as GPUs do, against published throughputs; the estimate
backend scores every configuration and answers per fidelity class, fast."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from autotune.estimate_backend import estimate_space, hardware_for
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.exhaustive import best_per_class, headline, score
from autotune.estimator.gpus import GPUS
from autotune.estimator.prediction_runners import EstimateRunner
from autotune.estimator.speed import MODEL_ERROR
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from tests.conftest import cli, tiny_spec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

LLAMA7B = MODELS["llama-7b"].config
BASE = {
    "gradient_checkpointing": "off",
    "precision": "bf16",
    "attention": "flash_attention_2",
    "optimizer": "adamw",
    "micro_batch_size": 4,
}


def tps(gpu: str = "a100-80gb", nproc: int = 1, seq: int = 2048, **extra: object) -> float:
    config = {**BASE, **extra}
    est = AnalyticalEstimator().estimate(
        Workload(
            LLAMA7B, seq_len_tokens=seq, global_batch_sequences=16, processes=nproc, gpu=GPUS[gpu]
        ),
        config,
    )
    return est.tokens_per_s


def test_eager_attention_pays_for_the_score_matrix_and_more_with_longer_sequences() -> None:
    for seq in (2048, 4096):
        flash, sdpa, eager = (
            tps(seq=seq, attention=a) for a in ("flash_attention_2", "sdpa", "eager")
        )
        assert eager < 0.9 * flash and eager < 0.9 * sdpa
    gap = lambda s: tps(seq=s) / tps(seq=s, attention="eager")  # noqa: E731
    assert gap(4096) > gap(2048) > gap(512) > 1.0


def test_fp32_runs_at_the_fp32_rate() -> None:
    # an A100's fp32 peak is 19.5 of its 312 bf16 TFLOPS: a compute-bound step is >10x slower
    assert tps(precision="bf16") > 10 * tps(precision="fp32")
    # an RTX 4090's fp32 rate is half its bf16 rate
    assert (
        1.6
        < tps("rtx4090", precision="bf16", micro_batch_size=1)
        / tps("rtx4090", precision="fp32", micro_batch_size=1)
        < 2.2
    )


def test_fp16_and_bf16_are_a_tie() -> None:
    bf16, fp16 = tps(precision="bf16"), tps(precision="fp16")
    assert fp16 <= bf16 and fp16 > bf16 * (1 - MODEL_ERROR)


def test_checkpointing_adds_its_recompute() -> None:
    # one more forward: about (2 + 4) / (2 + 4 + 2) = 3/4 of the speed for full checkpointing
    ratio = tps(gradient_checkpointing="full") / tps()
    assert 0.70 < ratio < 0.80
    every2 = tps(gradient_checkpointing="selective", checkpoint_every=2) / tps()
    assert ratio < every2 < 1.0


def test_saving_ops_skips_their_recompute() -> None:
    # full checkpointing recomputes the forward (about 3/4 of the speed); saving every matmul
    # leaves only the memory-bound ops to recompute, saving the attention only its kernel
    none = tps(gradient_checkpointing="full")
    attention = tps(gradient_checkpointing="full", checkpoint_save="attention")
    matmuls = tps(gradient_checkpointing="full", checkpoint_save="matmuls")
    assert none < attention < matmuls <= tps()
    assert matmuls > 0.95 * tps()


def test_chunked_cross_entropy_pays_one_more_head_forward() -> None:
    # llama-7b: the head is 32000 x 4096 = 131M of 6.7B parameters, a step 3 passes over all of
    # them: one more head forward is 131M / (3 x 6.7B) = 0.65% more matmul time
    ratio = tps(cross_entropy="chunked") / tps()
    assert 0.990 < ratio < 0.999


def test_offload_costs_pcie_and_the_cpu_step() -> None:
    plain = tps(zero_stage=2)
    offloaded = tps(zero_stage=2, offload_optimizer="cpu")
    assert offloaded < plain
    # parameter offload is prefetched: hidden behind a big micro-batch, exposed at micro-batch 1
    # (13.5 GB of 16-bit weights over PCIe 4 each forward and backward)
    one = {"micro_batch_size": 1}
    both = tps(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", **one)
    assert both < 0.8 * tps(zero_stage=3, offload_optimizer="cpu", **one)


def test_zero3_pays_all_gathers_where_the_link_is_slow() -> None:
    # 8 RTX 4090s over PCIe: ZeRO-3's per-micro-batch gathers cost; over NVLink they hide
    pcie = tps("rtx4090", nproc=8, zero_stage=3, micro_batch_size=1) / tps(
        "rtx4090", nproc=8, zero_stage=2, micro_batch_size=1
    )
    nvlink = tps("h100", nproc=8, zero_stage=3) / tps("h100", nproc=8, zero_stage=2)
    assert pcie < 0.9 and nvlink > pcie


def test_qlora_skips_weight_gradients_and_pays_dequantisation() -> None:
    full = tps(micro_batch_size=1)
    nf4 = tps(micro_batch_size=1, quantization="nf4")
    # no weight gradients: at most 6/4 of the FLOPs saved; dequantisation takes some back
    assert nf4 < 1.5 * full


def test_calibration_against_published_throughputs() -> None:
    """The oracle: published figures (llm-foundry, flash-attention, ZeRO-Offload)."""
    import speed_calibration

    errors = [abs(e) for e in speed_calibration.errors()]
    assert len(errors) >= 10
    assert statistics.median(errors) <= 100 * MODEL_ERROR + 0.5
    assert max(errors) < 40


def test_whole_space_scored_llama70b_on_8_gpus() -> None:
    """Every configuration of the space scored, and each class's best within the model's error
    of it (how fast: ``benchmarks/estimate_speed.py``)."""
    gpu = GPUS["h100"]
    configs = estimate_space().resolve(32, hardware_for(gpu, 8)).grid()
    kw = {"seq_len_tokens": 2048, "global_batch_sequences": 32, "processes": 8, "gpu": gpu}
    model = MODELS["llama-70b"].config
    scored = score(Workload(model, **kw), configs, budget_bytes=80 * 10**9)
    assert len(scored) == len(configs) > 1000
    per_class = best_per_class(scored)
    assert {"exact", "mixed"} <= set(per_class)
    for cb in per_class.values():  # ties are within the model's error of the best
        assert all(
            t.estimate.tokens_per_s >= cb.best.estimate.tokens_per_s * (1 - MODEL_ERROR)
            for t in cb.ties
        )


def test_llama7b_on_a_24gb_card_trains_fully_with_zero_offload() -> None:
    gpu = GPUS["rtx4090"]
    configs = estimate_space().resolve(32, hardware_for(gpu, 1)).grid()
    workload = Workload(LLAMA7B, seq_len_tokens=2048, global_batch_sequences=32, gpu=gpu)
    scored = score(workload, configs, budget_bytes=24 * 10**9)
    head = headline(best_per_class(scored))
    assert head is not None
    # the optimizer states in host memory: ZeRO-Offload or FSDP2's CPU offload
    best = head.best.config
    assert best.get("offload_optimizer") == "cpu" or best.get("fsdp_offload") == "cpu", best
    assert head.best.config.get("quantization", "none") == "none"
    # ... and it needs far more host memory than the card has: ~150-170 GiB under ZeRO-Offload
    # (DeepSpeed's 1.5 buffer factor), ~100 GiB under FSDP2's (16 B/param of fp32 shards,
    # gradients and AdamW states)
    assert head.best.estimate.host_bytes > 90 * 2**30
    # with only 64 GB of host RAM, full training of a 7B model fits one 24GB card in pure bf16
    # (no fp32 masters: 8 B/param of shards, gradients and AdamW states in host memory)
    limited = score(workload, configs, budget_bytes=24 * 10**9, host_budget_bytes=64 * 10**9)
    small = headline(best_per_class(limited))
    assert small is not None and small.cls == "reduced_state"
    assert small.best.config.get("master_weights") == "bf16", small.best.config
    assert small.best.estimate.host_bytes <= 64 * 10**9
    over_host = [
        s for s in limited if s.estimate.host_bytes > 64e9 and s.why_not != "device memory"
    ]
    assert over_host and all(s.why_not == "host memory" and not s.fits for s in over_host)


def test_estimate_cli_prints_the_best_of_each_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache"))
    result = cli("estimate", "--model", "llama-7b", "--budget", "24GB", "--host-memory", "256GB")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "every configuration scored" in out and "host memory 238 GiB" in out
    for cls in ("exact", "mixed", "adapters"):
        assert f" {cls} " in out
    assert "predicted best full training" in out and "host memory" in out


def test_host_memory_over_its_budget_is_an_oom_prediction() -> None:
    spec = tiny_spec({"zero_stage": 2, "offload_optimizer": "cpu", "precision": "bf16"})
    # the device holds DeepSpeed's default gradient bucket (5e8 bf16 elements, 1 GB) in backward
    spec.budget_bytes = 2 * 10**9
    ok = EstimateRunner(AnalyticalEstimator(), GPUS["l4"]).run(spec, "t")
    assert ok.status == "ok" and ok.host_peak_bytes > 16 * MODELS["tiny-llama"].n_params
    spec.host_budget_bytes = ok.host_peak_bytes // 2
    over = EstimateRunner(AnalyticalEstimator(), GPUS["l4"]).run(spec, "t")
    assert over.status == "oom" and "host memory" in over.error
