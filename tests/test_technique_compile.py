"""``torch.compile`` of the decoder layers (``trials/techniques/compile.py``) and the CPU
allocator's count that measures it (``CpuMemoryMonitor.allocator_counted``).

The allocator's count is checked against the dispatch-mode tracker on eager steps (two
independent mechanisms: the profiler's allocator events and the tracker's storages, byte for
byte); the compiled trial against the uncompiled one (the same losses, a lower peak by the
estimator's saving, which was measured with saved-tensor hooks on a compiled layer), its
compilation reported apart from the step time; the space's exclusions; the exports read by
their consumers."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.availability import Hardware
from autotune.estimator.workload import Workload
from autotune.space import SearchSpace
from tests.conftest import TINY, measured_and_predicted, tiny_spec
from trials.build import build_model
from trials.engines import TorchEngine
from trials.job import rank_batches
from trials.memory import CpuMemoryMonitor
from trials.techniques import TECHNIQUES
from trials.techniques.base import Run


def _three_steps(config: dict[str, Any], allocator: bool, budget: int | None = None) -> Any:
    spec = tiny_spec(config)
    monitor = CpuMemoryMonitor(budget)
    with monitor:
        model = TECHNIQUES.apply(build_model(TINY, "sdpa", 0), spec.config, torch.device("cpu"))
        engine = TorchEngine(model, spec, torch.device("cpu"), monitor)
        monitor.end_construction()
        for step in range(3):
            batches = rank_batches(spec, step, 0, 1)
            with monitor.allocator_counted() if allocator else nullcontext():
                engine.step(batches)
        monitor.live_after_steps = monitor.live_bytes  # type: ignore[attr-defined]
    return monitor


@pytest.mark.parametrize(
    "config",
    [{}, {"gradient_checkpointing": "full", "cross_entropy": "chunked"}, {"precision": "bf16"}],
)
def test_the_allocator_counts_what_the_tracker_counts(config: dict[str, Any]) -> None:
    """Eager steps: the same peak and the same live bytes after, to the byte for plain fp32
    and bf16 training; with checkpointing and chunked cross-entropy the allocator sees 12 B more
    at the peak (three scalars made below the dispatcher), allowed 64."""
    tracked = _three_steps(config, allocator=False)
    counted = _three_steps(config, allocator=True)
    assert counted.peak_bytes == pytest.approx(tracked.peak_bytes, abs=64)
    assert counted.peak_bytes >= tracked.peak_bytes
    assert counted.training_peak_bytes == pytest.approx(tracked.training_peak_bytes, abs=64)
    assert counted.live_after_steps == tracked.live_after_steps
    assert counted.breakdown() == {}  # bytes, not storages: the engine's breakdown applies
    assert tracked.breakdown()


def test_over_the_budget_the_allocator_count_is_an_oom() -> None:
    peak = _three_steps({}, allocator=False).peak_bytes
    assert _three_steps({}, allocator=True, budget=peak).peak_bytes == peak
    with pytest.raises(torch.OutOfMemoryError, match="CPU allocator: out of memory"):
        _three_steps({}, allocator=True, budget=peak - 1)


def test_a_compiled_layer_compiles_where_the_allocator_counts() -> None:
    """Under the allocator's count (the tracker's dispatch mode off, the monitor's
    ``force_eager`` stance left by the compiled blocks alone) dynamo compiles one graph for
    every layer. (Under the dispatch mode dynamo would skip the layer's code, for good in this
    process: so a compiled trial runs every tracked step under the allocator's count.)"""
    from torch._dynamo.utils import counters

    spec = tiny_spec({"compile": True})
    torch._dynamo.reset()
    counters.clear()
    monitor = CpuMemoryMonitor(None)
    with monitor:
        model = TECHNIQUES.apply(build_model(TINY, "sdpa", 0), spec.config, torch.device("cpu"))
        engine = TorchEngine(model, spec, torch.device("cpu"), monitor)
        with monitor.allocator_counted():
            engine.step(rank_batches(spec, 0, 0, 1))
    assert counters["stats"]["unique_graphs"] == 1  # the same code for all four layers
    assert counters["frames"]["ok"] == 1


@pytest.mark.slow  # inductor compiles from an empty cache: a minute or two on 2 cores
@pytest.mark.real_trial
@pytest.mark.parametrize(
    ("precision", "master"), [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]
)
def test_a_compiled_trial_saves_what_the_estimator_says(
    precision: str, master: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny-llama, micro-batch 8, seq 64: the measured peaks 183,813,540 -> 173,983,652 B
    (fp32) and 179,652,004 -> 168,445,860 B (bf16); the analytical estimator's saving 9,830,400
    and 11,206,656 B, within 0.01% (512 B apart); the traced estimate within 0.6%. The losses
    agree as an exact technique's must; the compilation (an empty inductor cache) is reported
    apart from the step time."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    results, predicted = {}, {}
    for compiled in (False, True):
        config = {"compile": compiled, "precision": precision, "master_weights": master}
        spec = tiny_spec(config, measured_steps=3)
        results[compiled], predicted[compiled] = measured_and_predicted(
            spec, tmp_path / str(compiled)
        )
    eager, compiled_ = results[False], results[True]
    saving = eager.peak_bytes - compiled_.peak_bytes
    assert saving > 0.05 * eager.peak_bytes
    assert predicted[False] - predicted[True] == pytest.approx(saving, rel=1e-4)
    assert compiled_.losses == pytest.approx(
        eager.losses, rel={"fp32": 1e-5, "bf16": 1e-3}[precision] * (10 if master == "bf16" else 1)
    )
    assert eager.compile_s == 0.0
    assert compiled_.compile_s > compiled_.step_time_s > 0
    assert compiled_.memory_breakdown["activations_and_other"] > 0  # the engine's breakdown
    # the traced estimator traces the layers eagerly and takes the analytical saving off:
    # +0.30% (fp32) and +0.16% (bf16) of the measured peak
    from autotune.estimator.traced import TracedEstimator

    spec = tiny_spec({"compile": True, "precision": precision, "master_weights": master})
    traced = TracedEstimator(use_cache=False).estimate(
        Workload(spec.model_config, seq_len_tokens=64, global_batch_sequences=8), spec.config
    )
    assert traced.peak_bytes == pytest.approx(compiled_.peak_bytes, rel=0.006)


@pytest.mark.slow  # inductor compiles from an empty cache
@pytest.mark.real_trial
def test_compiled_blocks_beside_torchaos_optimizer_as_predicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny-llama fp32, micro-batch 8, seq 64, torchao's 8-bit AdamW with and without compiled
    blocks: its step stays eager (the allocator counts it as the tracker does), so the peak is
    that step's in both (185,078,696 and 185,079,208 B measured, 185,041,408 predicted: -0.02%);
    the losses agree as an exact technique's must."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    results = {}
    for compiled in (False, True):
        spec = tiny_spec({"compile": compiled, "optimizer": "adamw_torchao_8bit"})
        results[compiled], predicted = measured_and_predicted(spec, tmp_path / str(compiled))
        assert results[compiled].peak_bytes == pytest.approx(predicted, rel=0.001)
    assert results[True].losses == pytest.approx(results[False].losses, rel=1e-5)
    assert results[True].compile_s > 0
    assert results[False].compile_s == 0


def test_the_space_keeps_compile_to_the_torch_engine() -> None:
    space = SearchSpace.load(None).resolve(8, Hardware(backend="cpu", has_torchao=True))
    compiled = [c for c in space.grid() if c.get("compile")]
    assert compiled
    for config in compiled:
        assert "zero_stage" not in config and "fsdp" not in config
        assert config.get("activation_offload", "none") == "none"
    # torchao's low-bit AdamW beside compiled blocks (its own step stays eager under the tracker)
    assert {c["optimizer"] for c in compiled} >= {"adamw_torchao_8bit", "adamw_torchao_4bit"}
    without_cxx = SearchSpace.load(None).resolve(8, Hardware(backend="cpu", has_cxx=False))
    assert not any(c.get("compile") for c in without_cxx.grid())
    assert any(line.startswith("compile=True: inductor needs") for line in without_cxx.dropped)


def test_the_exports_are_read_by_their_consumers() -> None:
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault
    from transformers import HfArgumentParser, TrainingArguments

    from tests.test_export_consumers import AXOLOTL_USER

    technique = next(t for t in TECHNIQUES if t.family == "compile")
    run = Run(1, 1, 1, "cuda", 1e-4)
    args = technique.training_arguments({"compile": True}, run)
    (parsed,) = HfArgumentParser(TrainingArguments).parse_dict(
        {"output_dir": "out", "use_cpu": True, **args}
    )
    assert parsed.torch_compile is True
    fragment = technique.axolotl({"compile": True}, run)
    cfg = validate_config(DictDefault({**AXOLOTL_USER, "micro_batch_size": 1, **fragment}))
    assert cfg["torch_compile"] is True
    assert technique.training_arguments({"compile": False}, run) == {}
    assert technique.companion({"compile": False}, run) == {"compile": None}


def test_the_compiled_layer_keeps_what_the_hooks_measured() -> None:
    """Per token and layer, tiny-llama (h 256, I 688): saved-tensor hooks on one compiled
    layer measured 21,336 -> 16,536 B kept in fp32 (4,800 = 4 (2h + I) fewer) and 14,296 ->
    8,824 B under bf16 autocast (5,472 = 16h + 2I fewer); the whole model in bf16 (pure bf16),
    35,498,496 -> 28,486,144 B over its four layers at 8 x 64 tokens (3,424 = 8h + 2I fewer per
    token and layer); layouts the rule was not measured on (GPT-2's LayerNorm, GELU and
    dropout), DeepSpeed's 16-bit model and adapters keep the eager count."""
    from autotune.estimator.activations import compiled_saving, layer_activation_bytes
    from autotune.models import resolve_model, stats_of

    st = stats_of(TINY)
    assert compiled_saving(st, {"compile": True}) == 4_800
    assert compiled_saving(st, {"compile": True, "precision": "bf16"}) == 5_472
    assert compiled_saving(st, {"compile": True, "precision": "fp16"}) == 5_472
    assert compiled_saving(st, {"compile": False}) == 0
    assert compiled_saving(st, {"compile": True, "precision": "bf16", "zero_stage": 2}) == 0
    pure = {"compile": True, "precision": "bf16", "master_weights": "bf16"}
    assert compiled_saving(st, pure) == 3_424
    assert compiled_saving(st, {**pure, "adapter": "lora", "lora_rank": 8}) == 0
    gpt2 = stats_of(resolve_model("gpt2-xl").config)
    assert compiled_saving(gpt2, {"compile": True}) == 0
    unlike = {
        "norm": "layer",
        "gated_mlp": False,
        "hidden_act": "gelu",
        "experts": 8,
        "resid_dropout": 0.1,
        "attn_dropout": 0.1,
        "qkv_projections": 1,
        "mlp_in_projections": 1,
        "qk_norm": True,
        "shared_norm_input": True,
    }
    for field, value in unlike.items():  # any one difference from the measured layout
        assert compiled_saving(dataclasses.replace(st, **{field: value}), {"compile": True}) == 0
    for precision in ("fp32", "bf16"):
        eager = layer_activation_bytes(st, {"precision": precision}, 64, 8)
        compiled = layer_activation_bytes(st, {"precision": precision, "compile": True}, 64, 8)
        saving = 4_800 if precision == "fp32" else 5_472
        assert eager - compiled == saving * 64 * 8
