import random
from pathlib import Path

import optuna
import pytest

from autotune.availability import Hardware
from autotune.errors import UserError
from autotune.space import SearchSpace

CPU = Hardware(backend="cpu")
H100 = Hardware(
    backend="cuda",
    cuda_capability=(9, 0),
    gpu_count=1,
    has_flash_attn=True,
    has_bitsandbytes=True,
    has_peft=True,
)
V100 = Hardware(
    backend="cuda",
    cuda_capability=(7, 0),
    gpu_count=1,
    has_flash_attn=True,
    has_bitsandbytes=True,
    has_peft=True,
)


def test_default_space_loads_from_package() -> None:
    space = SearchSpace.load()
    names = [d.name for d in space.dimensions]
    assert names[:5] == [
        "gradient_checkpointing",
        "checkpoint_every",
        "checkpoint_save",
        "cross_entropy",
        "activation_offload",
    ]
    assert space.reference["precision"] == "fp32"


def test_resolve_drops_by_hardware_and_batch() -> None:
    cpu = SearchSpace.load().resolve(8, CPU)
    dims = {d.name: d.choices for d in cpu.dimensions}
    assert "flash_attention_2" not in dims["attention"]
    assert "adamw_8bit" not in dims["optimizer"]
    assert dims["micro_batch_size"] == (1, 2, 4, 8)  # 16 does not divide 8
    assert any(
        line.startswith("attention=flash_attention_2: needs a CUDA GPU") for line in cpu.dropped
    )

    h100 = {d.name: d.choices for d in SearchSpace.load().resolve(16, H100).dimensions}
    assert "flash_attention_2" in h100["attention"] and "bf16" in h100["precision"]
    v100 = SearchSpace.load().resolve(16, V100)
    v100_dims = {d.name: d.choices for d in v100.dimensions}
    assert "flash_attention_2" not in v100_dims["attention"]
    assert "bf16" not in v100_dims["precision"]
    assert any("SM70" in line for line in v100.dropped)


def test_grid_respects_conditions_and_rules() -> None:
    grid = SearchSpace.load().resolve(16, CPU).grid()
    assert len(grid) == len({tuple(sorted(c.items())) for c in grid})  # no duplicates
    for c in grid:
        assert ("checkpoint_every" in c) == (c["gradient_checkpointing"] == "selective")
        assert not (c["attention"] == "eager" and c["micro_batch_size"] == 16)
    # (off + 3 ops saved under full and under selective) checkpointing x 2 cross-entropy x (5
    # micro-batches with sdpa + 4 with eager) x precision (no DeepSpeed fp16 on this CPU) and
    # ZeRO settings. fp32: with adamw 1 + 18 + 72 + 48 (stages 0-3), the two other optimizers
    # can't offload the optimizer: 1 + 9 + 36 + 24 each. bf16 adds pure bf16 at stages 1-3
    # where the optimizer is not offloaded: adamw 1 + (9 + 9) + (36 + 36) + (24 + 24) more
    # FSDP2 instead of ZeRO: 3 precisions (fp32, bf16, pure bf16) x 2 optimizers (AdamW, Lion)
    # x 2 modes x 2 offloads. The optimizer step in backward adds, without DeepSpeed or FSDP and
    # only at micro-batch 16 (sdpa): 3 optimizers x 3 precisions. (No torchao on this CPU: no
    # stochastic rounding.)
    fp32 = (1 + 18 + 72 + 48) + 2 * (1 + 9 + 36 + 24)
    bf16 = fp32 + 3 * (9 + 36 + 24)
    fsdp = 3 * 2 * 2 * 2
    in_backward = 1 * 3 * 3
    # torch.compile runs under the torch engine (no ZeRO or FSDP2), without activation
    # offloading: 7 checkpointings x 2 cross-entropies x (9 micro-batch/attention x 3
    # precisions x 3 optimizers, and the step in backward)
    compiled = (1 + 3 + 3) * 2 * ((5 + 4) * 3 * 3 + in_backward)
    # checkpointing: off, full (3 ops saved x activation offload or not), every 2nd (3 ops saved)
    assert (
        len(grid) == (1 + 3 * 2 + 3) * 2 * ((5 + 4) * (fp32 + bf16 + fsdp) + in_backward) + compiled
    )
    for c in grid:
        if c.get("optimizer_in_backward"):
            assert c["micro_batch_size"] == 16 and "zero_stage" not in c and "fsdp" not in c
        if c.get("fsdp", "off") != "off":
            assert "zero_stage" not in c and c["optimizer"] in ("adamw", "lion")


def test_grid_is_what_sampling_reaches() -> None:
    """The grid against ``sample`` (what Optuna's trials go through): every grid configuration
    is reproduced by sampling its own parameters, and random sampling never leaves the grid."""
    space = SearchSpace.load().resolve(16, H100).restrict(("exact", "mixed"))
    grid = space.grid()
    as_set = {tuple(sorted(c.items())) for c in grid}
    assert len(as_set) == len(grid) > 1000
    for c in grid[::97]:
        params = space.params_for(c)
        assert space.sample(lambda name, _choices, p=params: p[name]) == c
    rng = random.Random(3)
    for _ in range(2000):
        drawn = space.sample(lambda _name, choices: rng.choice(choices))
        assert tuple(sorted(drawn.items())) in as_set


def test_optuna_never_samples_forbidden_combinations() -> None:
    space = SearchSpace.load().resolve(16, CPU)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = []
    for _ in range(300):
        trial = study.ask()
        seen.append(space.sample(trial.suggest_categorical))
        study.tell(trial, 0.0)
    assert not any(c["attention"] == "eager" and c["micro_batch_size"] == 16 for c in seen)
    assert any(c["attention"] == "sdpa" and c["micro_batch_size"] == 16 for c in seen)
    assert all(
        ("checkpoint_every" in c) == (c["gradient_checkpointing"] == "selective") for c in seen
    )


def test_params_for_round_trips_through_enqueue() -> None:
    space = SearchSpace.load().resolve(16, CPU)
    config = {
        "gradient_checkpointing": "off",
        "cross_entropy": "chunked",
        "precision": "bf16",
        "attention": "eager",
        "optimizer": "lion",
        "micro_batch_size": 4,
        "quantization": "none",
        "adapter": "none",
        "optimizer_in_backward": False,
        "compile": False,
        "fsdp": "off",
        "zero_stage": 3,
        "offload_optimizer": "none",  # lion: DeepSpeed offloads only its own Adam
        "offload_param": "cpu",
        "master_weights": "bf16",
        "reduce_bucket_size": 5_000_000,
        "overlap_comm": True,
        "contiguous_gradients": False,
    }
    study = optuna.create_study()
    study.enqueue_trial(space.params_for(config))
    trial = study.ask()
    assert space.sample(trial.suggest_categorical) == config


def test_reference_is_exact_and_minimal() -> None:
    ref = SearchSpace.load().resolve(16, CPU).reference_config()
    assert ref == {
        "gradient_checkpointing": "full",
        "checkpoint_save": "none",
        "cross_entropy": "full",
        "activation_offload": "none",
        "precision": "fp32",
        "attention": "sdpa",
        "optimizer": "adamw",
        "micro_batch_size": 1,
        "quantization": "none",
        "adapter": "none",
        "optimizer_in_backward": False,
        "compile": False,
        "fsdp": "off",
        "zero_stage": 0,
    }


def test_unquoted_off_in_yaml_is_read_as_off(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("dimensions:\n  gradient_checkpointing:\n    choices: [off, full]\n")
    assert SearchSpace.load(path).dimensions[0].choices == ("off", "full")


BAD_SPACES = {
    "unknown top key": (
        "dimensions: {precision: {choices: [fp32]}}\nfoo: 1\n",
        "unknown key 'foo'",
    ),
    "unknown dimension": (
        "dimensions: {warp_speed: {choices: [1]}}\n",
        "unknown dimension 'warp_speed'",
    ),
    "wrong type": (
        "dimensions: {precision: {choices: fp32}}\n",
        "dimensions.precision.choices must be a list",
    ),
    "empty choices": (
        "dimensions: {precision: {choices: []}}\n",
        "dimensions.precision.choices is empty",
    ),
    "unknown choice": ("dimensions: {precision: {choices: [fp8]}}\n", "unknown choice 'fp8'"),
    "bad int": ("dimensions: {micro_batch_size: {choices: [0]}}\n", "micro_batch_size.choices: 0"),
    "when on later dim": (
        "dimensions:\n"
        "  checkpoint_every: {choices: [2], when: {gradient_checkpointing: selective}}\n"
        "  gradient_checkpointing: {choices: [selective]}\n",
        "must be declared before",
    ),
    "impossible rule": (
        "dimensions:\n  precision: {choices: [fp32, bf16]}\n  micro_batch_size: {choices: [1, 2]}\n"
        "rules:\n  - forbid: {precision: fp32, micro_batch_size: [1, 2]}\n",
        "impossible: it forbids every choice of 'micro_batch_size'",
    ),
    "rule on missing dim": (
        "dimensions:\n  precision: {choices: [fp32]}\n"
        "rules:\n  - forbid: {precision: fp32, attention: eager}\n",
        "'attention' is not a dimension of this space",
    ),
    "not a mapping": ("- a\n- b\n", "expected a mapping"),
    "broken yaml": ("dimensions: {precision: [\n", "invalid YAML"),
    "reference not in space": (
        "dimensions: {precision: {choices: [fp32]}}\nreference: {attention: sdpa}\n",
        "reference.attention: not a dimension",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SPACES))
def test_bad_space_files_name_the_key(case: str, tmp_path: Path) -> None:
    text, message = BAD_SPACES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SearchSpace.load(path)
