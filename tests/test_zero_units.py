"""The ZeRO / quantization pieces that need no DeepSpeed engine: space, hardware, merging, LoRA,
host-memory accounting."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotune.availability import Hardware, unavailable_reason
from autotune.errors import UserError
from autotune.runner import merge_ranks
from autotune.space import SearchSpace
from tests.conftest import TINY, tiny_spec
from trials.engines import TorchEngine
from trials.job import build_model, rank_batches
from trials.memory import CpuMemoryMonitor
from trials.spec import TrialResult
from trials.techniques.quantization import QUANTIZATION, add_lora

CPU = Hardware("cpu", has_deepspeed=True, has_cxx=True)
A100 = Hardware(
    "cuda",
    cuda_capability=(8, 0),
    gpu_count=1,
    has_flash_attn=True,
    has_bitsandbytes=True,
    has_peft=True,
    has_deepspeed=True,
    has_cxx=True,
)
T4 = Hardware("cuda", cuda_capability=(7, 5), gpu_count=1, has_bitsandbytes=True, has_peft=True)


def test_default_space_never_samples_meaningless_zero_combinations() -> None:
    everything = SearchSpace.load().resolve(16, CPU).grid()
    # the configurations without DeepSpeed are FSDP2's, the optimizer step in backward's and
    # the compiled ones (torch engine)
    grid = [c for c in everything if "zero_stage" in c]
    others = [c for c in everything if "zero_stage" not in c]
    assert all(
        c.get("fsdp", "off") != "off" or c["optimizer_in_backward"] or c["compile"] for c in others
    )
    assert {c["zero_stage"] for c in grid} == {0, 1, 2, 3}
    for c in grid:
        stage = c["zero_stage"]
        assert ("offload_optimizer" in c) == (stage >= 1)
        assert ("offload_param" in c) == (stage == 3)
        assert ("allgather_bucket_size" in c) == (stage in (1, 2))
        assert ("overlap_comm" in c) == ("contiguous_gradients" in c) == (stage in (2, 3))
        if c.get("offload_optimizer") == "cpu":
            assert c["optimizer"] == "adamw"
        assert c["precision"] != "fp16"  # DeepSpeed has no fp16 on a CPU without oneDNN fp16


def test_space_reads_yaml_booleans_and_exponents() -> None:
    text = {
        "dimensions": {
            "zero_stage": {"choices": [2]},
            "offload_optimizer": {"choices": [False, "cpu"]},  # YAML `off`
            "reduce_bucket_size": {"choices": ["5e6", 5.0e7]},  # YAML reads 5e6 as a string
            "overlap_comm": {"choices": ["yes", False]},
        }
    }
    dims = {d.name: d.choices for d in SearchSpace.from_dict(text).dimensions}
    assert dims["offload_optimizer"] == ("none", "cpu")
    assert dims["reduce_bucket_size"] == (5_000_000, 50_000_000)
    assert dims["overlap_comm"] == (True, False)
    for bad in ({"zero_stage": {"choices": [True]}}, {"overlap_comm": {"choices": ["maybe"]}}):
        with pytest.raises(UserError):
            SearchSpace.from_dict({"dimensions": bad})


@pytest.mark.parametrize(
    ("hw", "dim", "choice", "reason"),
    [
        (A100, "quantization", "nf4", None),
        (T4, "quantization", "int8", None),
        (CPU, "quantization", "nf4", "bitsandbytes needs a CUDA GPU"),
        (Hardware("cuda", (8, 0), 1, has_bitsandbytes=True), "quantization", "nf4", "peft"),
        (A100, "optimizer", "adamw_8bit", None),
        (CPU, "optimizer", "adamw_8bit", "CUDA"),
        (A100, "attention", "flash_attention_2", None),
        (T4, "attention", "flash_attention_2", "SM80"),
        (T4, "precision", "bf16", "SM80"),
        (CPU, "offload_optimizer", "cpu", None),
        (Hardware("cpu", has_cxx=False), "offload_optimizer", "cpu", "C++ compiler"),
        (Hardware("cpu", has_deepspeed=False), "offload_param", "cpu", "deepspeed is not"),
    ],
)
def test_capability_checks(hw: Hardware, dim: str, choice: Any, reason: str | None) -> None:
    got = unavailable_reason(hw, dim, choice)
    assert got is None if reason is None else reason in (got or "")


def test_fp16_goes_only_where_deepspeed_runs_it() -> None:
    assert unavailable_reason(CPU, "precision", "fp16", {"zero_stage"})
    assert unavailable_reason(CPU, "precision", "fp16") is None  # plain torch: GradScaler on CPU
    assert unavailable_reason(A100, "precision", "fp16", {"zero_stage"}) is None


def test_merge_takes_worst_peak_and_sums_throughput() -> None:
    a = TrialResult("ok", peak_bytes=100, tokens_per_s=10.0, losses=[4.0, 2.0])
    b = TrialResult("ok", peak_bytes=120, tokens_per_s=12.0, losses=[2.0, 1.0])
    merged = merge_ranks([a, b])
    assert (merged.peak_bytes, merged.tokens_per_s, merged.losses) == (120, 22.0, [3.0, 1.5])
    assert merged.rank_peaks == [100, 120]
    oom = merge_ranks([a, TrialResult("oom", peak_bytes=130, error="out of memory")])
    assert (oom.status, oom.peak_bytes, oom.error) == ("oom", 130, "out of memory")


def test_merge_keeps_the_worst_ranks_split_and_sums_the_host() -> None:
    """The budget is per rank, so the split shown is the worst rank's (also when it ran out of
    memory); the ranks share the host, so its resident sets add up."""
    a = TrialResult(
        "ok", peak_bytes=100, losses=[1.0], memory_breakdown={"parameters": 100},
        construction_peak_bytes=40, training_peak_bytes=100, host_peak_bytes=1000,
    )  # fmt: skip
    b = TrialResult(
        "ok", peak_bytes=120, losses=[1.0], memory_breakdown={"parameters": 60, "other": 60},
        construction_peak_bytes=50, training_peak_bytes=120,
        construction_breakdown={"parameters": 50}, host_peak_bytes=3000,
    )  # fmt: skip
    merged = merge_ranks([a, b])
    assert merged.memory_breakdown == {"parameters": 60, "other": 60}
    assert (merged.construction_peak_bytes, merged.training_peak_bytes) == (50, 120)
    assert merged.construction_breakdown == {"parameters": 50}
    assert merged.host_peak_bytes == 4000
    b.status = "oom"
    oom = merge_ranks([a, b])
    assert oom.status == "oom" and oom.memory_breakdown == {"parameters": 60, "other": 60}
    assert oom.host_peak_bytes == 4000


@pytest.mark.parametrize("documents", [None, [3, 16]])
def test_rank_batches_split_the_same_tokens(documents: list[int] | None) -> None:
    spec = tiny_spec({"micro_batch_size": 1}, global_batch_size=2, seq_len=16)
    wide = tiny_spec({"micro_batch_size": 1}, global_batch_size=4, seq_len=16)
    spec.documents = wide.documents = documents
    both = [b.input_ids for r in range(2) for b in rank_batches(spec, 3, r, 2)]
    alone = [b.input_ids for b in rank_batches(wide, 3, 0, 1)]
    assert len(both) == len(alone) == 4
    assert all(torch.equal(a, b) for a, b in zip(both, alone, strict=True))


@pytest.mark.real_trial
def test_lora_trains_only_the_adapters() -> None:
    """The LoRA path of quantized training, in full precision on the CPU."""
    model = add_lora(build_model(TINY, "sdpa", 0))
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) < 0.1 * sum(
        p.numel() for p in frozen.values()
    )
    spec = tiny_spec({"micro_batch_size": 4}, seq_len=16)
    engine = TorchEngine(model, spec, torch.device("cpu"), CpuMemoryMonitor(None))
    losses = [engine.step(rank_batches(spec, s, 0, 1)) for s in range(3)]
    assert all(loss == loss for loss in losses)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert any(not torch.equal(params[n], v) for n, v in trainable.items() if "lora_B" in n)
    assert set(QUANTIZATION) == {"none", "int8", "nf4"}


def test_host_marked_tensors_leave_the_device_peak_from_their_creation() -> None:
    monitor = CpuMemoryMonitor(None)
    with monitor:
        host = torch.zeros(1000)  # 4000 B, "offloaded", but only known to be later
        device = torch.zeros(500)  # 2000 B
        monitor.mark_host(host)
        tmp = torch.zeros(250)  # 1000 B
        del tmp
    assert monitor.peak_bytes == 3000  # device + tmp, as if host had never been on the device
    assert monitor.host_offloaded_bytes == 4000
    assert monitor.live_bytes == 2000
    del device, host


def test_host_born_tensors_handed_back_count_on_the_device_from_their_creation() -> None:
    """``mark_device``: a buffer made inside ``host_allocations`` that is device memory after all
    (DeepSpeed's reduce bucket, made with its offloaded partitions) counts on the device over its
    whole life, and no longer on the host."""
    monitor = CpuMemoryMonitor(None)
    with monitor:
        with monitor.host_allocations():
            partition = torch.zeros(1000)  # 4000 B of host memory
            bucket = torch.zeros(500)  # 2000 B, on the device really
        tmp = torch.zeros(250)  # 1000 B, while the bucket is alive
        del tmp
        monitor.mark_device(bucket)
        monitor.mark_device(bucket)  # twice: no change
        device = torch.zeros(100)  # 400 B, device-born: handing it back changes nothing
        monitor.mark_device(device)
    assert monitor.peak_bytes == 3000  # bucket + tmp: the bucket counted from its creation
    assert monitor.host_offloaded_bytes == 4000  # the partition alone, at every moment
    assert monitor.live_bytes == 2400
    del bucket, device
    assert monitor.live_bytes == 0
    del partition
