"""LoRA/DoRA on a 16-bit base in the estimate space (``search_spaces/estimate.yaml``): the
adapters class scored on its own smaller grid (the dimensions that apply to adapters: rank,
targets, base precision, checkpointing, cross-entropy, attention, micro-batch; not the optimizer,
engines or pure bf16 of full training), reported beside the full-training classes.

Oracles from outside the estimator: the space file itself with the adapter dimensions taken out
(the full-training grid is unchanged by adding the class), peft's own count of a LoRA model's
trainable parameters (on LLaMA-7B built on the meta device), hand arithmetic for the bytes of the
frozen 16-bit base and the adapters' fp32 weights, gradients and AdamW moments, and the traced
estimator (the step run on fake tensors) for the whole peak."""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.estimate_backend import estimate_space, hardware_for
from autotune.estimator.gpus import GPUS
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from autotune.space import SearchSpace
from autotune.yaml_limits import parse_yaml
from tests.conftest import cli

ADAPTER_DIMENSIONS = ("adapter", "lora_rank", "lora_targets")
#: full training's dimensions an adapter configuration does not have: the optimizer of a few
#: million fp32 adapter weights is never what decides (AdamW, as peft's recipes), the engines
#: shard a whole model, pure bf16 and compile are refused beside adapters
NOT_FOR_ADAPTERS = ("optimizer", "optimizer_in_backward", "fsdp", "zero_stage", "offload_optimizer")


def _file() -> dict[str, Any]:
    text = resources.files("search_spaces").joinpath("estimate.yaml").read_text()
    return parse_yaml(text, "estimate.yaml")  # type: ignore[no-any-return]


def _without_adapters(data: dict[str, Any]) -> dict[str, Any]:
    """The space file as it would be without the adapter dimensions (and the conditions on
    them)."""
    data = copy.deepcopy(data)
    for name in ADAPTER_DIMENSIONS:
        data["dimensions"].pop(name)
    for spec in data["dimensions"].values():
        when = spec.get("when", {})
        for name in ADAPTER_DIMENSIONS:
            when.pop(name, None)
        if not when:
            spec.pop("when", None)
    return data


@pytest.mark.parametrize(("gpu", "nproc"), [("rtx4090", 1), ("h100", 8)])
def test_adding_the_adapters_class_leaves_the_full_training_grid_as_it_was(
    gpu: str, nproc: int
) -> None:
    hardware = hardware_for(GPUS[gpu], nproc)
    grid = estimate_space().resolve(32, hardware).grid()
    before = SearchSpace.from_dict(_without_adapters(_file()), "before")
    full = [c for c in grid if c["adapter"] == "none"]
    expected = before.resolve(32, hardware).grid()
    # the same configurations, in the same order (ties keep the first scored), with the
    # adapter's baseline named
    assert [{k: v for k, v in c.items() if k != "adapter"} for c in full] == expected
    adapters = [c for c in grid if c["adapter"] != "none"]
    assert {c["adapter"] for c in adapters} == {"lora", "dora"}
    # its own smaller grid: none of full training's dimensions that do not apply
    assert not any(name in c for c in adapters for name in NOT_FOR_ADAPTERS)
    assert {c.get("master_weights", "fp32") for c in adapters} == {"fp32"}
    assert {c["quantization"] for c in adapters} == {"none"}
    assert {c["compile"] for c in adapters} == {False}
    # ... the dimensions that decide an adapter's memory and speed all searched
    for name in ("lora_rank", "lora_targets", "precision", "gradient_checkpointing"):
        assert len({c[name] for c in adapters}) > 1, name
    assert {c["micro_batch_size"] for c in adapters} == {c["micro_batch_size"] for c in full}
    assert len(adapters) < len(full) / 4


def _peft_trainable(rank: int, targets: str) -> int:
    """peft's own count of the trainable parameters of LLaMA-7B with LoRA adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from trials.techniques.adapter import TARGETS

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**MODELS["llama-7b"].config))
    peft = get_peft_model(model, LoraConfig(r=rank, target_modules=TARGETS[targets]))
    trainable, _ = peft.get_nb_trainable_parameters()
    return int(trainable)


@pytest.mark.slow
def test_run_estimate_answers_llama7b_on_24gb_with_a_lora_configuration(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))
    result = cli(
        "run", "--model", "llama-7b", "--budget", "24GB", "--backend", "estimate",
        "--allow", "adapters", "--trials", "1",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    # the adapters' best beside the full-training classes
    line = out.split(" adapters ")[1].split("tokens/s")[0]
    assert line.startswith("lora r"), line
    assert " mixed " in out and "predicted best for NVIDIA GeForce RTX 4090 (full training" in out
    storage = f"sqlite:///{in_tmp / 'autotune.db'}"
    study = optuna.load_study(study_name="llama-7b-24GB-estimate", storage=storage)
    best = next(
        t
        for t in study.trials
        if t.user_attrs.get("role") == "class-best" and t.user_attrs["fidelity"] == "adapters"
    )
    config, attrs = best.user_attrs["config"], best.user_attrs
    assert config["adapter"] == "lora" and config["precision"] in ("bf16", "fp16"), config
    assert attrs["status"] == "ok" and attrs["peak_bytes"] <= 24 * 10**9
    # by hand: the frozen base in 16 bits (2 B/param), the adapters (peft's count) in fp32 with
    # fp32 gradients and AdamW's two fp32 moments
    psi = MODELS["llama-7b"].n_params
    trainable = _peft_trainable(config["lora_rank"], config["lora_targets"])
    parts = attrs["memory_breakdown"]
    assert parts["parameters"] == 2 * psi + 4 * trainable
    assert parts["gradients"] == 4 * trainable
    assert parts["optimizer_states"] == 8 * trainable
    # the whole peak against the step traced on fake tensors
    workload = Workload(
        MODELS["llama-7b"].config,
        seq_len_tokens=2048,
        global_batch_sequences=32,
        gpu=GPUS["rtx4090"],
    )
    traced = TracedEstimator(cache=in_tmp / "traced").estimate(workload, config)
    assert abs(attrs["peak_bytes"] - traced.peak_bytes) <= 0.05 * traced.peak_bytes, (
        attrs["peak_bytes"],
        traced.peak_bytes,
    )
