"""Activation offloading (``activation_offload`` in ``trials/techniques/activation_offload.py``):
the same losses and gradients as keeping the activations, the host bytes counted by hand, the
device and host bytes of real trials against both estimators, the PCIe time it costs, and its
axolotl key read by axolotl's loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GB, GPUS
from autotune.estimator.speed import PCIE_EFFICIENCY
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from tests.conftest import TINY, measured_and_predicted, tiny_loss_and_grads, tiny_spec
from trials.job import run_trial
from trials.techniques import TECHNIQUES
from trials.techniques.base import Run

FULL = {"gradient_checkpointing": "full"}
EVERY_2 = {"gradient_checkpointing": "selective", "checkpoint_every": 2}
OFF = {"activation_offload": "cpu"}


@pytest.mark.parametrize("checkpointing", [FULL, EVERY_2], ids=["full", "every-2"])
def test_the_same_loss_and_gradients_as_keeping_them(checkpointing: dict) -> None:
    plain_loss, plain = tiny_loss_and_grads(checkpointing)
    loss, grads = tiny_loss_and_grads({**checkpointing, **OFF})
    assert loss == plain_loss
    for name, grad in grads.items():
        assert torch.equal(grad, plain[name]), name


def test_without_checkpointing_nothing_is_offloaded() -> None:
    """The dimension exists only under checkpointing (the YAML's ``when``); a config that sets
    it without checkpointing trains as plain (no host bytes)."""
    result = run_trial(tiny_spec({"gradient_checkpointing": "off", **OFF}, measured_steps=1))
    assert result.status == "ok"
    assert result.memory_breakdown["host_offloaded"] == 0


def test_host_bytes_are_what_the_layers_save_counted_by_hand() -> None:
    """tiny-llama (4 layers, hidden 256) at micro-batch 8 x 64 tokens, fp32, full checkpointing:
    up to the output layer autograd saves the token ids (embedding, int64), each checkpointed
    layer's input, the final norm's input, its rsqrt per token and its normalised output (the
    norm's weight is a parameter: kept). Each is copied once though q, k and v all save one."""
    tokens, h, layers = 8 * 64, TINY["hidden_size"], TINY["num_hidden_layers"]
    by_hand = 8 * tokens + layers * 4 * h * tokens + 4 * h * tokens + 4 * tokens + 4 * h * tokens
    result = run_trial(tiny_spec({**FULL, **OFF}, measured_steps=1))
    assert result.status == "ok", result.error
    assert result.memory_breakdown["host_offloaded"] == by_hand
    plain = run_trial(tiny_spec(FULL, measured_steps=1))
    assert result.losses == plain.losses
    # the layers' inputs (and the norm's) leave the device: the peak drops by about that much
    saved = plain.peak_bytes - result.peak_bytes
    assert saved == pytest.approx(by_hand, rel=0.01)


def test_the_speed_model_charges_two_pcie_crossings_per_micro_batch() -> None:
    """llama-7b on an A100 80GB, full checkpointing, micro-batch 2 of 8 (4 micro-batches): the
    offload time grows by 4 x 2 x (offloaded bytes) / (PCIe bandwidth x efficiency)."""
    from autotune.models import MODELS

    cfg = MODELS["llama-7b"].config
    base = {**FULL, "precision": "bf16", "micro_batch_size": 2}
    kw = {
        "seq_len_tokens": 2048,
        "global_batch_sequences": 8,
        "processes": 1,
        "gpu": GPUS["a100-80gb"],
    }
    plain = AnalyticalEstimator().estimate(Workload(cfg, **kw), base)
    offloaded = AnalyticalEstimator().estimate(Workload(cfg, **kw), {**base, **OFF})
    moved = offloaded.host_breakdown["activations"]
    # by hand: 32 layer inputs (fp32 residual, 4h per token), the ids and the final norm's
    tokens, h = 2 * 2048, 4096
    assert moved == pytest.approx(32 * 4 * h * tokens + 2 * 4 * h * tokens, rel=0.01)
    pcie = GPUS["a100-80gb"].pcie_gbps * GB * PCIE_EFFICIENCY
    extra = offloaded.time_breakdown["offload"] - plain.time_breakdown["offload"]
    assert extra == pytest.approx(4 * 2 * moved / pcie, rel=1e-9)
    assert offloaded.tokens_per_s < plain.tokens_per_s
    # and the device no longer holds them (the peak is at the end of forward in both)
    assert plain.peak_bytes - offloaded.peak_bytes == pytest.approx(34 * 4 * h * tokens, rel=0.01)


def test_axolotl_reads_its_activation_offloading_key() -> None:
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    from tests.test_export_consumers import AXOLOTL_USER

    technique = next(t for t in TECHNIQUES if t.family == "activation_offload")
    run = Run(1, 1, 1, "cuda", 1e-4)
    checkpointing = next(t for t in TECHNIQUES if t.family == "checkpointing")
    for config, mode in [({**FULL, **OFF}, "hidden_states"), ({**EVERY_2, **OFF}, True)]:
        fragment = {**checkpointing.axolotl(config, run), **technique.axolotl(config, run)}
        cfg = validate_config(DictDefault({**AXOLOTL_USER, "micro_batch_size": 1, **fragment}))
        assert cfg["activation_offloading"] == mode
    assert technique.axolotl(FULL, run) == {}
    assert technique.companion({**FULL, **OFF}, run)["activation_offload"] == "cpu"
    assert technique.companion({"gradient_checkpointing": "off", **OFF}, run) == {
        "activation_offload": None,
        "activation_offload_min_bytes": None,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpointing", "precision", "rel"),
    [(FULL, "fp32", 0.05), (EVERY_2, "bf16", 0.2)],
    ids=["full-fp32", "every-2-bf16"],
)
def test_real_trials_against_both_estimators(
    checkpointing: dict, precision: str, rel: float, tmp_path: Path
) -> None:
    """Real CPU trials with and without offloading: the same losses (bf16 included: the host
    copies keep the strides, so backward runs the same kernels); the measured device saving
    against the analytical estimator's (measured: 0.1% with full checkpointing in fp32, 10.8%
    under with every other layer in bf16, where the layers kept whole save their autocast
    copies in more views than the formula counts), and the traced estimator's peak and host
    bytes within 1% of the measured."""
    config = {**checkpointing, "precision": precision}
    plain, plain_predicted = measured_and_predicted(
        tiny_spec(config, measured_steps=1), tmp_path / "plain"
    )
    spec = tiny_spec({**config, **OFF}, measured_steps=1)
    result, predicted = measured_and_predicted(spec, tmp_path / "offloaded")
    assert result.losses == plain.losses
    saved, predicted_saving = plain.peak_bytes - result.peak_bytes, plain_predicted - predicted
    assert saved > 0
    assert predicted_saving == pytest.approx(saved, rel=rel)
    traced = TracedEstimator(use_cache=False).estimate(
        Workload(spec.model_config, seq_len_tokens=spec.seq_len, global_batch_sequences=8),
        spec.config,
    )
    assert traced.peak_bytes == pytest.approx(result.peak_bytes, rel=0.01)
    host = result.memory_breakdown["host_offloaded"]
    assert traced.host_breakdown["activations"] == pytest.approx(host, rel=0.01)


@pytest.mark.slow
def test_under_zero3_with_offloaded_parameters(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-3 with parameters and optimizer offloaded, bf16: the hooks sit on the
    module DeepSpeed wraps; the same losses as without offloading activations, less device
    memory."""
    zero = {
        **FULL,
        "precision": "bf16",
        "zero_stage": 3,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
    }
    plain, _ = measured_and_predicted(tiny_spec(zero, measured_steps=1), tmp_path / "plain")
    result, _ = measured_and_predicted(
        tiny_spec({**zero, **OFF}, measured_steps=1), tmp_path / "offloaded"
    )
    assert result.losses == plain.losses
    assert result.peak_bytes < plain.peak_bytes
    assert result.memory_breakdown["host_offloaded"] > plain.memory_breakdown["host_offloaded"]


def test_the_estimate_space_scores_it_under_full_checkpointing_only() -> None:
    """The estimate backend's space holds the dimension where it is used: both choices under
    full checkpointing (torchtune's pairing), never elsewhere."""
    from autotune.estimate_backend import estimate_space

    grid = estimate_space().grid()
    assert {c.get("activation_offload") for c in grid} == {None, "none", "cpu"}
    for c in grid:
        assert ("activation_offload" in c) == (c["gradient_checkpointing"] == "full")
