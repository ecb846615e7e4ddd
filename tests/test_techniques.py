"""The technique registry: every part reads it, so a new technique is one module.

``ToyPad`` stands for a technique someone adds: one dimension, ``toy_pad``, that keeps a zero
buffer of N fp32 elements beside the model (the same math, more memory: exact, and a larger pad
never needs less memory). It is registered for the test only, with nothing edited elsewhere,
and the search space, the hardware checks, the strategy's pruning, the ladder, "simplest wins",
the exports, both estimators (its memory and speed terms) and the real trial job all pick it up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from torch import nn

from autotune.availability import Hardware
from autotune.errors import UserError
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GPUS
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.export import EXPORTERS, export
from autotune.ladder import baseline_config
from autotune.models import MODELS, stats_of
from autotune.selector import simplicity
from autotune.space import SearchSpace
from autotune.strategy import (
    STALL,
    AutotuneSampler,
    needs_no_less_memory,
    observations,
    trials_since_improvement,
)
from tests.conftest import TINY_SETTINGS, tiny_spec
from trials.job import run_trial
from trials.techniques import TECHNIQUES, fidelity_class
from trials.techniques.base import Config, Knob, Run, Technique
from trials.techniques.terms import MemoryStep, SpeedStep, TraceStep

#: elements of each pad choice (fp32: 4 bytes each)
PAD = {"none": 0, "small": 250_000, "large": 1_000_000, "huge": 4_000_000}


def _two_gpus(hw: Hardware) -> str | None:
    return None if hw.gpu_count >= 2 else "needs two GPUs"


class ToyPad(Technique):
    family = "toy_pad"
    traced = True  # the traced estimator's fake step applies it too
    knobs = (
        Knob(
            "toy_pad",
            tuple(PAD),
            baseline="none",
            memory_order=lambda v: float(PAD[v]),
            requires={"huge": _two_gpus},
        ),
    )

    def __init__(self) -> None:
        self.applied: list[str] = []

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        choice = str(config.get("toy_pad", "none"))
        self.applied.append(choice)
        if PAD[choice]:
            model.register_buffer("toy_pad", torch.zeros(PAD[choice], device=device))
        return model

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        return {"toy_pad_elements": PAD[str(config.get("toy_pad", "none"))]}

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return self.training_arguments(config, run)

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return self.training_arguments(config, run)

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        return {"zero_optimization": {"toy_pad_elements": PAD[str(config["toy_pad"])]}}

    def memory(self, step: MemoryStep) -> None:
        # the pad stays on the device through the whole step
        step.resident += 4 * PAD[str(step.config.get("toy_pad", "none"))]

    def speed(self, step: SpeedStep) -> None:
        # say the pad is copied to the host once per step
        step.offload += 4 * PAD[str(step.config.get("toy_pad", "none"))] / step.pcie


SPACE = {
    "dimensions": {
        "gradient_checkpointing": {"choices": ["off", "full"]},
        "toy_pad": {"choices": list(PAD)},
        "micro_batch_size": {"choices": [2, 8]},
    }
}
GPU = Hardware(backend="cuda", cuda_capability=(9, 0), gpu_count=1)


@pytest.fixture()
def toy() -> Iterator[ToyPad]:
    with TECHNIQUES.extended(ToyPad()) as technique:
        assert isinstance(technique, ToyPad)
        yield technique


def test_built_in_tables_are_the_ones_the_modules_replaced() -> None:
    """The registry gives back, per dimension, the tables that used to be written out in
    space.py, ladder.py/selector.py, strategy.py and techniques.py (copied here by hand)."""
    assert list(TECHNIQUES.known_dimensions()) == [
        "gradient_checkpointing",
        "checkpoint_every",
        "checkpoint_save",
        "cross_entropy",
        "activation_offload",
        "precision",
        "master_weights",
        "attention",
        "optimizer",
        "optimizer_in_backward",
        "micro_batch_size",
        "packing",
        "compile",
        "fsdp",
        "fsdp_offload",
        "zero_stage",
        "offload_optimizer",
        "offload_param",
        "quantization",
        "adapter",
        "lora_rank",
        "lora_targets",
        "reduce_bucket_size",
        "allgather_bucket_size",
        "overlap_comm",
        "contiguous_gradients",
        "expandable_segments",
    ]
    assert TECHNIQUES.known_dimensions()["quantization"] == ("none", "int8", "nf4")
    assert TECHNIQUES.known_dimensions()["zero_stage"] == (0, 1, 2, 3)
    assert TECHNIQUES.baseline() == {
        "gradient_checkpointing": "off",
        "cross_entropy": "full",
        "activation_offload": "none",
        "precision": "fp32",
        "master_weights": "fp32",
        "attention": "sdpa",
        "optimizer": "adamw",
        "optimizer_in_backward": False,
        "packing": False,
        "compile": False,
        "fsdp": "off",
        "fsdp_offload": "none",
        "zero_stage": 0,
        "offload_optimizer": "none",
        "offload_param": "none",
        "quantization": "none",
        "adapter": "none",
    }
    assert set(TECHNIQUES.memory_orders()) == {
        "micro_batch_size",
        "gradient_checkpointing",
        "checkpoint_save",
        "activation_offload",
        "master_weights",
        "optimizer_in_backward",
        "fsdp_offload",
        "offload_optimizer",
        "offload_param",
        "lora_rank",
        "lora_targets",
        "reduce_bucket_size",
        "allgather_bucket_size",
        "overlap_comm",
    }
    assert TECHNIQUES.numerics_dimensions() == (
        "precision",
        "master_weights",
        "optimizer",
        "quantization",
        "adapter",
    )
    families = [t.family for t in TECHNIQUES]
    assert len(families) == len(set(families)) == 17


def test_a_dimension_belongs_to_one_technique(toy: ToyPad) -> None:
    with pytest.raises(ValueError, match="toy_pad"):
        TECHNIQUES.register(ToyPad())


def test_unregistered_the_dimension_is_unknown() -> None:
    with pytest.raises(UserError, match="unknown dimension 'toy_pad'"):
        SearchSpace.from_dict(SPACE)


def test_the_space_and_the_hardware_checks_read_it(toy: ToyPad) -> None:
    space = SearchSpace.from_dict(SPACE)
    with pytest.raises(UserError, match="unknown choice 'tiny' for toy_pad"):
        SearchSpace.from_dict({"dimensions": {"toy_pad": {"choices": ["tiny"]}}})
    one = space.resolve(8, GPU)
    assert "toy_pad=huge: needs two GPUs" in one.dropped
    assert {c["toy_pad"] for c in one.grid()} == {"none", "small", "large"}
    two = space.resolve(8, Hardware(backend="cuda", cuda_capability=(9, 0), gpu_count=2))
    assert {c["toy_pad"] for c in two.grid()} == set(PAD)
    assert {fidelity_class(c) for c in two.grid()} == {"exact"}  # no fidelity entry: exact


def test_the_strategy_prunes_in_its_memory_order(toy: ToyPad) -> None:
    oom = {"gradient_checkpointing": "off", "toy_pad": "small", "micro_batch_size": 2}
    assert needs_no_less_memory({**oom, "toy_pad": "large"}, oom)
    assert not needs_no_less_memory({**oom, "toy_pad": "none"}, oom)

    space = SearchSpace.from_dict(SPACE).resolve(8, GPU)
    grid = space.grid()
    budget = 100.0

    def truth(c: dict[str, Any]) -> tuple[float, float]:
        """The pad fills the memory; the small micro-batch and checkpointing are (here) faster,
        so the sampler meets the over-budget pad there first."""
        ckpt = c["gradient_checkpointing"] == "full"
        peak = 50 + PAD[c["toy_pad"]] / 10_000 + (0 if ckpt else 10)
        return peak, 1000.0 - c["micro_batch_size"] + (100 if ckpt else 0)

    # a blind prior (every configuration fits): only the OOMs can rule any out
    sampler = AutotuneSampler(grid, lambda c: (50.0, truth(c)[1]), budget)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    ooms: list[dict[str, Any]] = []
    planned_by_the_rules: list[dict[str, Any]] = []  # proposed before the search stalled

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        config = space.sample(trial.suggest_categorical)  # type: ignore[arg-type]
        # until it stalls (STALL trials without a better measurement) the search holds an OOM's
        # implications as rules; after, as weights (a stalled search may be held back by them)
        if trials_since_improvement(observations(study), budget, sampler.loss_tolerance) < STALL:
            assert not any(needs_no_less_memory(config, o) for o in ooms), config
            planned_by_the_rules.append(config)
        peak, speed = truth(config)
        status = "ok" if peak <= budget else "oom"
        if status == "oom":
            ooms.append(config)
        trial.set_user_attr("config", config)
        trial.set_user_attr("status", status)
        trial.set_user_attr("peak_bytes", min(peak, budget))
        trial.set_user_attr("tokens_per_s", speed if status == "ok" else 0.0)
        return (speed if status == "ok" else 0.0), min(peak, budget)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    while sampler.plan(observations(study)) is not None:
        study.optimize(objective, n_trials=1)
    first = [o for o in ooms if o in planned_by_the_rules]  # the OOMs met under the rules
    assert first and all(o["toy_pad"] == "large" for o in first)
    # each OOM of the large pad implies the huge pad's configurations (and those with a bigger
    # micro-batch or no checkpointing): none of them was run while the rules held
    implied = [c for c in grid if c not in first and any(needs_no_less_memory(c, o) for o in first)]
    assert implied and all(c["toy_pad"] in ("large", "huge") for c in implied)
    assert not [c for c in implied if c in planned_by_the_rules]
    assert len(planned_by_the_rules) > len(first)  # the rules held over trials after the OOMs


def test_the_ladder_and_simplest_wins_start_from_its_baseline(toy: ToyPad) -> None:
    space = SearchSpace.from_dict(SPACE).resolve(8, GPU)
    assert baseline_config(space, 8) == {
        "gradient_checkpointing": "off",
        "toy_pad": "none",
        "micro_batch_size": 8,
    }
    plain = {"gradient_checkpointing": "off", "toy_pad": "none", "micro_batch_size": 8}
    assert simplicity({**plain, "toy_pad": "small"})[0] == simplicity(plain)[0] + 1


def test_every_export_carries_its_keys(toy: ToyPad, tmp_path: Path) -> None:
    settings = TINY_SETTINGS
    config = {
        "gradient_checkpointing": "off",
        "toy_pad": "large",
        "micro_batch_size": 2,
        "zero_stage": 2,
    }
    for fmt, exporter in EXPORTERS.items():
        out = export(fmt, config, settings, tmp_path / f"{fmt}{exporter.suffix}")
        companion = json.loads(out.with_name(out.stem + ".autotune.json").read_text())
        assert companion["toy_pad_elements"] == 1_000_000, fmt
        if fmt in ("hf", "axolotl"):
            assert "toy_pad_elements: 1000000" in out.read_text().replace('"', ""), fmt
    ds = json.loads((tmp_path / "deepspeed.json").read_text())
    assert ds["zero_optimization"] == {"stage": 2, "toy_pad_elements": 1_000_000}


def test_both_estimators_add_its_terms(toy: ToyPad, tmp_path: Path) -> None:
    """Its memory term (the pad's 4 bytes per element at every moment: 4 MB for ``large``) in
    the analytical peak, its fake buffer in the traced one, and its speed term (4 MB over the
    H100's PCIe 5 x16, 64 GB/s at 80%) in both step times, with nothing edited elsewhere."""
    model = MODELS["tiny-llama"].config
    plain = {"gradient_checkpointing": "off", "micro_batch_size": 2, "toy_pad": "none"}
    padded = {**plain, "toy_pad": "large"}
    copy_s = 4_000_000 / (64e9 * 0.8)
    for estimator in (AnalyticalEstimator(), TracedEstimator(cache=tmp_path)):
        kw: dict[str, Any] = {
            "seq_len_tokens": 64,
            "global_batch_sequences": 4,
            "gpu": GPUS["h100"],
        }
        a = estimator.estimate(Workload(model, **kw), plain)
        b = estimator.estimate(Workload(model, **kw), padded)
        assert b.peak_bytes - a.peak_bytes == 4_000_000, estimator.name
        offload = b.time_breakdown["offload"] - a.time_breakdown["offload"]
        assert offload == pytest.approx(copy_s, rel=1e-9), estimator.name
        assert b.step_time_s - a.step_time_s == pytest.approx(copy_s, rel=1e-6), estimator.name
    assert b.breakdown["parameters"] >= a.breakdown["parameters"]


def test_the_job_applies_it(toy: ToyPad) -> None:
    """A real trial step: the job applied the choice, the loss is the plain run's (exact), and
    the measured peak grew by at least the pad's bytes (4 per fp32 element)."""
    plain = run_trial(tiny_spec({"toy_pad": "none"}))
    padded = run_trial(tiny_spec({"toy_pad": "large"}))
    assert plain.status == padded.status == "ok", (plain.error, padded.error)
    assert toy.applied == ["none", "large"]
    assert padded.losses == pytest.approx(plain.losses, rel=1e-6)
    assert padded.peak_bytes - plain.peak_bytes >= 4 * PAD["large"]


class ToyStep(Technique):
    """A toy whose ``heavy`` choice makes the optimizer's step move 4 more bytes per
    parameter (an ``operators`` term) and whose fake step keeps 1,000 bytes the real one would
    not (a ``traced_activations`` term)."""

    family = "toy_step"
    knobs = (Knob("toy_step", ("plain", "heavy"), baseline="plain"),)

    def operators(self, step: SpeedStep) -> None:
        if step.config.get("toy_step") == "heavy":
            step.step_bytes += 4

    def traced_activations(self, step: TraceStep) -> None:
        if step.config.get("toy_step") == "heavy":
            step.peak -= 1000
            step.breakdown["activations"] -= 1000
            step.notes.append("toy: 1000 B the fake step keeps taken off")


def test_its_operator_and_trace_terms_reach_the_estimators(tmp_path: Path) -> None:
    """The optimizer step of both estimators grows by 4 bytes per parameter at the H100's
    HBM (3,350 GB/s at 75%), and only the traced peak loses the toy's 1,000 bytes."""
    model = MODELS["tiny-llama"].config
    plain = {"gradient_checkpointing": "off", "micro_batch_size": 2, "toy_step": "plain"}
    heavy = {**plain, "toy_step": "heavy"}
    extra_s = 4 * stats_of(model).n_params / (3350e9 * 0.75)
    kw: dict[str, Any] = {"seq_len_tokens": 64, "global_batch_sequences": 4, "gpu": GPUS["h100"]}
    with TECHNIQUES.extended(ToyStep()):
        for estimator, cut in ((AnalyticalEstimator(), 0), (TracedEstimator(cache=tmp_path), 1000)):
            a = estimator.estimate(Workload(model, **kw), plain)
            b = estimator.estimate(Workload(model, **kw), heavy)
            grown = b.time_breakdown["optimizer"] - a.time_breakdown["optimizer"]
            assert grown == pytest.approx(extra_s, rel=1e-9), estimator.name
            assert a.peak_bytes - b.peak_bytes == cut, estimator.name
