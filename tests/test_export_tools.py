"""Each export, read back by the library that will use it (no study needed: the exporters take a
trial config and the study settings)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.export import EXPORTERS, export
from tests.conftest import TINY_SETTINGS

SETTINGS = TINY_SETTINGS
PLAIN = {
    "gradient_checkpointing": "selective",
    "checkpoint_every": 2,
    "precision": "bf16",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 2,
}
ZERO = {
    "gradient_checkpointing": "off",
    "precision": "fp16",
    "attention": "eager",
    "optimizer": "adamw",
    "micro_batch_size": 4,
    "zero_stage": 2,
}
CONFIGS = {"plain": PLAIN, "zero2": ZERO}


def _write_all(config: dict[str, Any], folder: Path) -> dict[str, Path]:
    return {
        fmt: export(fmt, config, SETTINGS, folder / f"out-{fmt}{e.suffix}")
        for fmt, e in EXPORTERS.items()
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deepspeed_json_is_read_by_deepspeed(name: str, tmp_path: Path) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    config = CONFIGS[name]
    files = _write_all(config, tmp_path)
    ds = DeepSpeedConfig(json.loads(files["deepspeed"].read_text()))
    assert ds.train_micro_batch_size_per_gpu == config["micro_batch_size"]
    assert ds.gradient_accumulation_steps * config["micro_batch_size"] == 8
    assert ds.zero_optimization_stage == config.get("zero_stage", 0)
    assert ds.bfloat16_config.enabled == (config["precision"] == "bf16")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_arguments_construct_training_arguments(name: str, tmp_path: Path) -> None:
    from transformers import TrainingArguments

    config = CONFIGS[name]
    d = json.loads(_write_all(config, tmp_path)["hf"].read_text())
    args = TrainingArguments(**{**d, "output_dir": str(tmp_path / "o"), "use_cpu": True})
    assert args.per_device_train_batch_size == config["micro_batch_size"]
    assert args.gradient_accumulation_steps == 8 // config["micro_batch_size"]
    assert bool(args.activation_checkpointing) == (config["gradient_checkpointing"] != "off")
    assert args.fp16 == (config["precision"] == "fp16")
    assert (args.deepspeed is not None) == ("zero_stage" in config)
    assert args.optim.value == "adamw_torch"
    assert args.bf16 == (config["precision"] == "bf16")
    if "zero_stage" in config:  # a DeepSpeed file written beside it, read by transformers
        assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accelerate_yaml_is_read_by_accelerate(name: str, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = CONFIGS[name]
    cluster = load_config_from_file(str(_write_all(config, tmp_path)["accelerate"]))
    assert cluster.num_processes == 1
    if "zero_stage" in config:  # precision and stage: in the DeepSpeed file it names
        assert cluster.distributed_type.value == "DEEPSPEED"
        assert cluster.mixed_precision is None  # accelerate refuses it beside a DeepSpeed file
        ds = json.loads(Path(cluster.deepspeed_config["deepspeed_config_file"]).read_text())
        assert ds["zero_optimization"]["stage"] == 2 and ds["fp16"]["enabled"] is True
    else:
        assert cluster.mixed_precision == config["precision"]
        assert cluster.distributed_type.value == "NO"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_axolotl_fragment(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]
    frag = yaml.safe_load(_write_all(config, tmp_path)["axolotl"].read_text())
    assert frag["micro_batch_size"] * frag["gradient_accumulation_steps"] == 8
    assert frag["gradient_checkpointing"] is (config["gradient_checkpointing"] != "off")
    assert frag["load_in_4bit"] is False
    assert frag["attn_implementation"] == config["attention"]
    assert frag["optimizer"] == "adamw_torch"
    assert "adapter" not in frag
    if "zero_stage" in config:
        from deepspeed.runtime.config import DeepSpeedConfig

        assert DeepSpeedConfig(frag["deepspeed"]).zero_optimization_stage == 2
    else:
        assert "deepspeed" not in frag


@pytest.mark.parametrize("name", list(CONFIGS))
def test_command_line_parses_with_the_launchers(name: str, tmp_path: Path) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    config = CONFIGS[name]
    script = _write_all(config, tmp_path)["command"].read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    argv = shlex.split(script.splitlines()[-1])
    assert argv[-1] == "$@"
    argv = argv[:-1]
    if "zero_stage" in config:
        from deepspeed.launcher.runner import parse_args

        launched = parse_args(argv[1:])
        assert argv[0] == "deepspeed" and launched.num_gpus == 1
        script_args = launched.user_args
        assert launched.user_script == "train.py"
    else:
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.commands.launch import launch_command_parser

        launched = launch_command_parser().parse_args(argv[2:])
        assert argv[:2] == ["accelerate", "launch"] and launched.training_script == "train.py"
        assert load_config_from_file(launched.config_file).mixed_precision == "bf16"
        script_args = launched.training_script_args
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [*script_args, "--use_cpu", "--output_dir", str(tmp_path / "o")]
    )
    assert args.per_device_train_batch_size == config["micro_batch_size"]
    assert args.gradient_accumulation_steps == 8 // config["micro_batch_size"]
    assert bool(args.activation_checkpointing) == (config["gradient_checkpointing"] != "off")
    assert args.fp16 == (config["precision"] == "fp16")
    assert (args.deepspeed is not None) == ("zero_stage" in config)


@pytest.mark.parametrize(("quantization", "adapter"), [("int8", "lora"), ("nf4", "qlora")])
def test_axolotl_adapters_follow_quantization(
    quantization: str, adapter: str, tmp_path: Path
) -> None:
    config = {**PLAIN, "quantization": quantization}
    frag = yaml.safe_load(export("axolotl", config, SETTINGS, tmp_path / "a.yaml").read_text())
    assert frag["adapter"] == adapter and frag["lora_target_linear"] is True
    assert frag["load_in_4bit"] is (quantization == "nf4")
    assert frag.get("load_in_8bit", False) is (quantization == "int8")
