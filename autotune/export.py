"""The winner, written as configs people already train with.

One table of exporters; each turns (trial config, study settings) into a file's content.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import UserError
from autotune.study import StudySettings
from autotune.terminal import printable
from trials import zero
from trials.techniques import OPTIMIZERS


def _micro_and_accum(config: dict[str, Any], settings: StudySettings) -> tuple[int, int]:
    micro = int(config.get("micro_batch_size", settings.global_batch_size))
    per_rank_global = settings.global_batch_size
    return micro, max(1, per_rank_global // micro)


def deepspeed_config(config: dict[str, Any], settings: StudySettings) -> dict[str, Any]:
    """The DeepSpeed JSON the trial ran with: the trial job builds it with the same function."""
    micro, accum = _micro_and_accum(config, settings)
    return zero.deepspeed_config(
        config,
        micro,
        accum,
        str(config.get("precision", "fp32")),
        settings.nproc,
        settings.lr,
        "cpu" if settings.backend == "cpu" else "cuda",
    )


def hf_training_arguments(
    config: dict[str, Any], settings: StudySettings, deepspeed_path: str | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments(**d)``."""
    micro, accum = _micro_and_accum(config, settings)
    precision = config.get("precision", "fp32")
    ckpt = config.get("gradient_checkpointing", "off")
    args: dict[str, Any] = {
        "output_dir": "output",
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accum,
        "gradient_checkpointing": ckpt != "off",
        "bf16": precision == "bf16",
        "fp16": precision == "fp16",
        "optim": OPTIMIZERS[config.get("optimizer", "adamw")].hf_name,
        "learning_rate": settings.lr,
        "weight_decay": 0.0,
    }
    if ckpt != "off":
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if deepspeed_path is not None:
        args["deepspeed"] = deepspeed_path
    return args


def accelerate_config(config: dict[str, Any], settings: StudySettings) -> dict[str, Any]:
    """An ``accelerate`` config file (``accelerate launch --config_file``)."""
    precision = config.get("precision", "fp32")
    _, accum = _micro_and_accum(config, settings)
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO" if settings.nproc == 1 else "MULTI_GPU",
        "mixed_precision": {"fp32": "no"}.get(precision, precision),
        "num_machines": 1,
        "num_processes": settings.nproc,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": settings.backend == "cpu",
    }
    # accelerate's config file has no top-level accumulation key (its loader rejects one): the
    # steps go to the training script (`autotune export --format command`), or to DeepSpeed
    if int(config.get("zero_stage", 0)) > 0:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "gradient_accumulation_steps": accum,
            "zero_stage": int(config["zero_stage"]),
            "offload_optimizer_device": config.get("offload_optimizer", "none"),
            "offload_param_device": config.get("offload_param", "none"),
        }
    return cfg


@dataclass(frozen=True)
class Exporter:
    render: Callable[[dict[str, Any], StudySettings, Path], str]
    suffix: str


def _json(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def _render_hf(config: dict[str, Any], settings: StudySettings, out: Path) -> str:
    ds_path = None
    if int(config.get("zero_stage", 0)) > 0:  # TrainingArguments points at the DeepSpeed file
        ds_file = out.with_name(out.stem + ".deepspeed.json")
        ds_file.write_text(_json(deepspeed_config(config, settings)))
        ds_path = str(ds_file)
    return _json(hf_training_arguments(config, settings, ds_path))


def _side_deepspeed(config: dict[str, Any], settings: StudySettings, out: Path) -> str | None:
    """For a ZeRO trial, write its DeepSpeed JSON next to ``out`` and return the path."""
    if int(config.get("zero_stage", 0)) == 0:
        return None
    ds_file = out.with_name(out.stem + ".deepspeed.json")
    ds_file.write_text(_json(deepspeed_config(config, settings)))
    return str(ds_file)


AXOLOTL_LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_linear": True}
#: ``quantization`` choice -> axolotl's ``adapter`` and its quantized-base-weight keys
AXOLOTL_QUANTIZATION: dict[str, tuple[str | None, dict[str, bool]]] = {
    "none": (None, {"load_in_4bit": False}),
    "int8": ("lora", {"load_in_8bit": True, "load_in_4bit": False}),
    "nf4": ("qlora", {"load_in_4bit": True}),
}


def axolotl_config(
    config: dict[str, Any], settings: StudySettings, deepspeed_path: str | None = None
) -> dict[str, Any]:
    """The training keys of an axolotl YAML config (merge into one that names the model
    and the data). axolotl checkpoints every layer: selective checkpointing exports as full."""
    micro, accum = _micro_and_accum(config, settings)
    precision = config.get("precision", "fp32")
    attention = config.get("attention", "sdpa")
    adapter, quantized = AXOLOTL_QUANTIZATION[str(config.get("quantization", "none"))]
    cfg: dict[str, Any] = {
        "sequence_len": settings.seq_len,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accum,
        "gradient_checkpointing": config.get("gradient_checkpointing", "off") != "off",
        "flash_attention": attention == "flash_attention_2",
        "sdp_attention": attention == "sdpa",
        "bf16": precision == "bf16",
        "fp16": precision == "fp16",
        **quantized,
        "optimizer": OPTIMIZERS[config.get("optimizer", "adamw")].hf_name,
        "learning_rate": settings.lr,
    }
    if adapter is not None:  # the trial's LoRA recipe (trials/quantization.py)
        cfg |= {"adapter": adapter, **AXOLOTL_LORA}
    if deepspeed_path is not None:
        cfg["deepspeed"] = deepspeed_path
    return cfg


def _render_axolotl(config: dict[str, Any], settings: StudySettings, out: Path) -> str:
    ds_path = _side_deepspeed(config, settings, out)
    return yaml.safe_dump(axolotl_config(config, settings, ds_path), sort_keys=False)


def _flags(args: dict[str, Any]) -> list[str]:
    """TrainingArguments as the command-line flags HfArgumentParser reads."""
    out: list[str] = []
    for key, value in args.items():
        if isinstance(value, bool):
            if value:
                out.append(f"--{key}")
        elif isinstance(value, dict):
            out += [f"--{key}", json.dumps(value)]
        else:
            out += [f"--{key}", str(value)]
    return out


def launch_command(
    config: dict[str, Any], settings: StudySettings, out: Path, script: str = "train.py"
) -> list[str]:
    """A ready launch of a Hugging Face Trainer script with the winner's settings: through
    ``deepspeed`` for a ZeRO trial, else ``accelerate launch``; writes the config it names."""
    ds_path = _side_deepspeed(config, settings, out)
    train_args = _flags(hf_training_arguments(config, settings, ds_path))
    if ds_path is not None:
        return ["deepspeed", "--num_gpus", str(settings.nproc), script, *train_args]
    acc_file = out.with_name(out.stem + ".accelerate.yaml")
    acc_file.write_text(yaml.safe_dump(accelerate_config(config, settings), sort_keys=False))
    return ["accelerate", "launch", "--config_file", str(acc_file), script, *train_args]


def _render_command(config: dict[str, Any], settings: StudySettings, out: Path) -> str:
    command = " ".join(shlex.quote(part) for part in launch_command(config, settings, out))
    return (
        "#!/usr/bin/env bash\n"
        # the model name is a user's file name: on one line, so it stays inside the comment
        f"# autotune winner for {printable(settings.model)} within {settings.budget_label}; "
        "train.py: your Hugging Face Trainer script (HfArgumentParser reads these flags)\n"
        f'{command} "$@"\n'
    )


EXPORTERS: dict[str, Exporter] = {
    "deepspeed": Exporter(lambda c, s, _: _json(deepspeed_config(c, s)), ".json"),
    "hf": Exporter(_render_hf, ".json"),
    "accelerate": Exporter(
        lambda c, s, _: yaml.safe_dump(accelerate_config(c, s), sort_keys=False), ".yaml"
    ),
    "axolotl": Exporter(_render_axolotl, ".yaml"),
    "command": Exporter(_render_command, ".sh"),
}


def export(fmt: str, config: dict[str, Any], settings: StudySettings, out: Path) -> Path:
    if fmt not in EXPORTERS:
        raise UserError(f"unknown export format '{fmt}' (known: {', '.join(EXPORTERS)})")
    if not out.parent.exists():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    text = EXPORTERS[fmt].render(config, settings, out)
    out.write_text(text)
    return out
