"""The estimate backend's space knows the trial space's techniques: FSDP2 beside
DeepSpeed, the optimizer step in backward and the low-bit optimizers are choices of
``search_spaces/estimate.yaml``, under the same exclusions, and the estimator prices them.

The oracles are outside the estimator: the trial space's own file for which choices exist, the
technique modules' documented exclusions, and hand arithmetic for the bytes."""

from __future__ import annotations

from importlib import resources

import pytest

from autotune.estimate_backend import estimate_space, hardware_for
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import Estimate
from autotune.estimator.gpus import GPUS
from autotune.estimator.workload import Workload
from autotune.models import MODELS, stats_of
from autotune.space import SearchSpace
from autotune.yaml_limits import parse_yaml

#: knobs the estimate leaves at DeepSpeed's and the allocator's defaults: they tune buffers, not
#: which states a rank holds, and would multiply a grid scored in seconds
LEFT_AT_DEFAULTS = {
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "expandable_segments",
}
LLAMA7B = MODELS["llama-7b"].config


def trial_space() -> SearchSpace:
    text = resources.files("search_spaces").joinpath("default.yaml").read_text()
    return SearchSpace.from_dict(parse_yaml(text, "default.yaml"), "default.yaml")


def test_every_technique_choice_of_the_trial_space_is_in_the_estimate_space() -> None:
    trial = {d.name: d for d in trial_space().dimensions}
    estimate = {d.name: d for d in estimate_space().dimensions}
    assert set(trial) - set(estimate) == LEFT_AT_DEFAULTS
    for name in set(trial) - LEFT_AT_DEFAULTS:
        missing = set(map(repr, trial[name].choices)) - set(map(repr, estimate[name].choices))
        assert not missing, f"{name}: {missing} not in the estimate space"


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return estimate_space().resolve(32, hardware_for(GPUS["rtx4090"], 1)).grid()


def test_the_estimate_grid_keeps_the_techniques_exclusions(grid: list[dict]) -> None:
    fsdp = [c for c in grid if c.get("fsdp", "off") != "off"]
    in_backward = [c for c in grid if c.get("optimizer_in_backward")]
    assert {c["fsdp"] for c in fsdp} == {"full_shard", "shard_grad_op"}
    assert {c["fsdp_offload"] for c in fsdp} == {"none", "cpu"}
    # FSDP2 and the step in backward own the step: no DeepSpeed beside them, no fp16 scaler
    assert all("zero_stage" not in c and c["precision"] != "fp16" for c in fsdp)
    assert in_backward and all(
        c.get("zero_stage", 0) == 0 and c.get("fsdp", "off") == "off" for c in in_backward
    )
    assert all(c["precision"] != "fp16" for c in in_backward)
    # the step in backward takes whole batches: no gradient accumulation
    assert {c["micro_batch_size"] for c in in_backward} == {32}
    # the paged and torchao optimizers step plain tensors: no ZeRO partitions, no FSDP shards
    low_bit = [
        c for c in grid if c.get("optimizer", "adamw").startswith(("paged", "adamw_torchao"))
    ]
    assert {c["optimizer"] for c in low_bit} == {
        "paged_adamw_8bit",
        "adamw_torchao_8bit",
        "adamw_torchao_4bit",
    }
    assert all(c.get("zero_stage", 0) == 0 and c.get("fsdp", "off") == "off" for c in low_bit)


def estimate(config: dict) -> Estimate:
    return AnalyticalEstimator().estimate(
        Workload(
            LLAMA7B,
            seq_len_tokens=2048,
            global_batch_sequences=32,
            processes=1,
            gpu=GPUS["rtx4090"],
        ),
        config,
    )


BASE = {
    "gradient_checkpointing": "full",
    "precision": "bf16",
    "attention": "flash_attention_2",
    "optimizer": "adamw",
    "micro_batch_size": 1,
}


def test_fsdp2_offload_keeps_16_bytes_a_parameter_on_the_host() -> None:
    """FSDP2 with ``CPUOffloadPolicy`` on one GPU: fp32 shards, their gradients and AdamW's two
    moments on the host, 4 + 4 + 8 bytes per parameter (hand arithmetic), and none of them on
    the device: the offloaded peak is the on-device one less exactly those 16 B/param."""
    n = stats_of(LLAMA7B).n_params
    off = estimate({**BASE, "fsdp": "full_shard", "fsdp_offload": "cpu"})
    on_device = estimate({**BASE, "fsdp": "full_shard", "fsdp_offload": "none"})
    assert off.host_breakdown["offloaded states"] == pytest.approx(16 * n, rel=1e-6)
    assert on_device.peak_bytes - off.peak_bytes == pytest.approx(16 * n, rel=1e-3)
    assert off.peak_bytes < 24 * 10**9 < on_device.peak_bytes


def test_the_step_in_backward_never_holds_every_gradient() -> None:
    """Without accumulation (micro-batch = the whole batch) the plain step holds every fp32
    gradient at once; in backward only one at a time: the peak drops by the gradients less the
    largest one (llama-7b: 4 B x 6.74e9 less the 131M-parameter embedding), when the gradients
    are what sets the peak (fp32 at seq 128). Reached: 0.06% from the hand number."""
    st = stats_of(LLAMA7B)
    config = {**BASE, "precision": "fp32", "micro_batch_size": 32}
    plain = AnalyticalEstimator().estimate(
        Workload(
            LLAMA7B, seq_len_tokens=128, global_batch_sequences=32, processes=1, gpu=GPUS["h100"]
        ),
        config,
    )
    fused = AnalyticalEstimator().estimate(
        Workload(
            LLAMA7B, seq_len_tokens=128, global_batch_sequences=32, processes=1, gpu=GPUS["h100"]
        ),
        {**config, "optimizer_in_backward": True},
    )
    saved = plain.peak_bytes - fused.peak_bytes
    assert saved == pytest.approx(4 * (st.n_params - st.largest_param), rel=0.002)
