"""Every export format, for configurations and study settings across the space (backends, process
counts, user learning rates), read back and compared with the winner's stored configuration
worked out by hand: the batch shape, checkpointing, precision, optimizer, ZeRO stage, where it
runs, what the user set and what is left to them. The consumers' own parsers read each file
(transformers' TrainingArguments, DeepSpeed's DeepSpeedConfig, accelerate's config loader)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.export import UserSettings, export
from tests.conftest import TINY_SETTINGS

BASE = TINY_SETTINGS
#: (config, expected: checkpointing every n layers, DeepSpeed stage or None, hf optim)
CASES: dict[str, tuple[dict[str, Any], int | None, int | None, str]] = {
    "plain-fp32": ({"precision": "fp32", "micro_batch_size": 8}, None, None, "adamw_torch"),
    "full-ckpt-bf16": (
        {"gradient_checkpointing": "full", "precision": "bf16", "micro_batch_size": 2},
        1,
        None,
        "adamw_torch",
    ),
    "selective3-fp16-adafactor": (
        {
            "gradient_checkpointing": "selective",
            "checkpoint_every": 3,
            "precision": "fp16",
            "optimizer": "adafactor",
            "attention": "eager",
            "micro_batch_size": 4,
        },
        3,
        None,
        "adafactor",
    ),
    "zero3-offload-bf16": (
        {
            "zero_stage": 3,
            "offload_optimizer": "cpu",
            "offload_param": "cpu",
            "precision": "bf16",
            "micro_batch_size": 1,
        },
        None,
        3,
        "adamw_torch",
    ),
    "zero1-fp32": (
        {"zero_stage": 1, "precision": "fp32", "micro_batch_size": 2},
        None,
        1,
        "adamw_torch",
    ),
}
SETTINGS = {
    "cpu-1": (BASE, UserSettings()),
    "cpu-1-lr": (BASE, UserSettings(lr=3e-4, weight_decay=0.1)),
    "estimate-2": (
        replace(BASE, backend="estimate", nproc=2, global_batch_size=16, target_gpu="H100-80GB"),
        UserSettings(lr=1e-5),
    ),
}


@pytest.mark.parametrize("where", list(SETTINGS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_format_reads_back_as_the_winner(case: str, where: str, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from deepspeed.runtime.config import DeepSpeedConfig

    config, every, stage, optim = CASES[case]
    settings, user = SETTINGS[where]
    micro = config["micro_batch_size"]
    accum = settings.global_batch_size // micro  # per process, as the trial ran it
    precision = config["precision"]
    on_cpu = settings.backend == "cpu"

    def write(fmt: str, suffix: str) -> Path:
        return export(fmt, config, settings, tmp_path / f"{fmt}{suffix}", user)

    # the companion file: what the config files cannot say
    write("hf", ".json")
    side = json.loads((tmp_path / "hf.autotune.json").read_text())
    assert side["micro_batch_size"] == micro and side["gradient_accumulation_steps"] == accum
    assert side["processes"] == settings.nproc
    assert side["checkpoint_every_n_layers"] == every
    assert side["model_kwargs"] == {"attn_implementation": config.get("attention", "sdpa")}
    assert side["measured_on"] == ("cpu" if on_cpu else "estimate")
    assert side["note"].startswith("measured on CPU" if on_cpu else "predicted for GPU H100-80GB")
    assert side["model"] == "tiny-llama" and side["seq_len"] == 64
    assert side["max_grad_norm"] is None
    assert set(side["not_tuned"]) >= {"weight_decay", "output_dir"}
    # a learning rate given is written, and no longer said to be left to the trainer's default
    assert ("learning_rate" in side["not_tuned"]) == (user.lr is None)
    assert side["learning_rate"] == user.lr
    assert (side["deepspeed_config"] is not None) == (stage is not None)

    # TrainingArguments
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert hf["per_device_train_batch_size"] == micro
    assert hf["gradient_accumulation_steps"] == accum
    assert (hf["bf16"], hf["fp16"]) == (precision == "bf16", precision == "fp16")
    assert hf["optim"] == optim and hf["max_grad_norm"] == 0.0
    assert hf.get("use_cpu", False) is on_cpu
    assert hf.get("learning_rate") == user.lr and hf.get("weight_decay") == user.weight_decay
    if every is None:
        assert "activation_checkpointing" not in hf
    else:
        assert hf["activation_checkpointing"] is True
        assert hf["activation_checkpointing_kwargs"] == {
            "use_reentrant": False,
            "every_n_layers": every,
        }
    if on_cpu:
        from transformers import TrainingArguments

        args = TrainingArguments(**{**hf, "output_dir": str(tmp_path / "o")})
        assert args.per_device_train_batch_size == micro
        assert (args.deepspeed is not None) == (stage is not None)

    # DeepSpeed JSON, read by DeepSpeed (for every config: a plain one is ZeRO stage 0)
    ds_file = write("deepspeed", ".json")
    ds_dict = json.loads(ds_file.read_text())
    assert ds_dict["train_micro_batch_size_per_gpu"] == micro
    assert ds_dict["gradient_accumulation_steps"] == accum
    assert ds_dict["train_batch_size"] == micro * accum * settings.nproc
    if settings.nproc == 1:  # DeepSpeed checks the batch shape against its world size
        ds = DeepSpeedConfig(ds_dict)
        assert ds.train_batch_size == micro * accum
        assert ds.zero_optimization_stage == (stage or 0)
        assert ds.bfloat16_config.enabled == (precision == "bf16")
        assert ds.float16_config.enabled == (precision == "fp16")
    assert ds_dict.get("zero_optimization", {}).get("stage", 0) == (stage or 0)
    assert ds_dict.get("bf16", {}).get("enabled", False) == (precision == "bf16")
    assert ds_dict.get("fp16", {}).get("enabled", False) == (precision == "fp16")
    if stage == 3:
        zero = ds_dict["zero_optimization"]
        assert zero["offload_optimizer"]["device"] == "cpu"
        assert zero["offload_param"]["device"] == "cpu"
    if "optimizer" in ds_dict:
        params = ds_dict["optimizer"]["params"]
        assert params["lr"] == ("auto" if user.lr is None else user.lr)
        assert params["weight_decay"] == (
            "auto" if user.weight_decay is None else user.weight_decay
        )
        assert "betas" not in params and "eps" not in params

    # accelerate
    acc_file = write("accelerate", ".yaml")
    acc = load_config_from_file(str(acc_file))
    assert acc.num_processes == settings.nproc and acc.use_cpu is on_cpu
    if stage is not None:
        assert acc.distributed_type.value == "DEEPSPEED"
        named = json.loads(Path(acc.deepspeed_config["deepspeed_config_file"]).read_text())
        assert named["zero_optimization"]["stage"] == stage
    else:
        multi = "MULTI_CPU" if on_cpu else "MULTI_GPU"
        assert acc.distributed_type.value == ("NO" if settings.nproc == 1 else multi)
        assert acc.mixed_precision == {"fp32": "no"}.get(precision, precision)
    text = acc_file.read_text()
    assert text.startswith("# autotune winner for tiny-llama within 300MB: ")
    assert f"# model: attn_implementation={config.get('attention', 'sdpa')} " in text

    # axolotl
    axo = yaml.safe_load(write("axolotl", ".yaml").read_text())
    assert axo["sequence_len"] == 64
    assert (axo["micro_batch_size"], axo["gradient_accumulation_steps"]) == (micro, accum)
    assert axo["gradient_checkpointing"] is (every is not None)
    assert (axo["bf16"], axo["fp16"]) == (precision == "bf16", precision == "fp16")
    assert axo["optimizer"] == optim and axo["max_grad_norm"] == 0.0
    assert axo.get("learning_rate") == user.lr and axo.get("weight_decay") == user.weight_decay
    assert ("deepspeed" in axo) == (stage is not None)
