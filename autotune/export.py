"""The winner, written as configs people already train with.

One table of exporters; each turns (trial config, study settings, the user's own settings) into a
file's content, from every registered technique's part of it (``trials.techniques``: each
technique's ``deepspeed``, ``training_arguments``, ``accelerate``, ``axolotl`` and ``companion``
hooks) and the study's settings. An export says what the study decided and nothing else:

* tuned choices (micro-batch and accumulation, precision, checkpointing, optimizer, ZeRO stage,
  offload, buckets, attention kernel) are written as values;
* the trial's training semantics that the measurement depends on are reproduced: no gradient
  clipping (``max_grad_norm: 0`` and ``gradient_clipping: 0``), dynamic fp16 loss scaling;
* what the study did not tune (learning rate, schedule, weight decay, output dir) is left to the
  consumer's defaults (``"auto"`` in DeepSpeed JSON, absent from ``TrainingArguments``) unless the
  user gives it (``autotune run --lr``, recorded with the study, or ``autotune export --lr``),
  never the trial's internal values;
* every export writes ``<stem>.autotune.json`` beside it: where it was measured, the model's
  keyword arguments (``attn_implementation``, which ``TrainingArguments`` cannot carry) and the
  batch shape, for a training script to read.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import UserError
from autotune.safe_files import (
    check_targets,
    manifest_entry,
    nothing_left,
    read_manifest,
    sha256,
    write_atomic,
)
from autotune.study import StudySettings
from autotune.terminal import printable
from trials import deepspeed_engine
from trials.techniques import TECHNIQUES, Run
from trials.techniques.attention import attn_implementation
from trials.techniques.fsdp import runs_fsdp
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.optimizer import hand_back
from trials.techniques.optimizer_in_backward import steps_in_backward
from trials.techniques.zero import runs_deepspeed


@dataclass(frozen=True)
class UserSettings:
    """Training settings the study did not search, given by the user (``autotune export
    --lr/--weight-decay``); ``None`` leaves each to the consumer's default."""

    lr: float | None = None
    weight_decay: float | None = None


#: what no export invents (the consumer's default, or the user's flag where one exists)
NOT_TUNED = ("learning_rate", "lr_scheduler", "weight_decay", "output_dir", "max_steps")
#: the trials do not clip gradients; 0 disables clipping in TrainingArguments and DeepSpeed alike
NO_CLIPPING = 0.0


def not_tuned(settings: StudySettings) -> list[str]:
    """What the export leaves to the consumer: ``NOT_TUNED`` but the learning rate given."""
    given = {"learning_rate"} if settings.user_lr is not None else set()
    return [key for key in NOT_TUNED if key not in given]


def _device(settings: StudySettings) -> str:
    """Where the configuration is meant to run: ``--backend estimate`` predicts for a GPU."""
    return "cpu" if settings.backend == "cpu" else "cuda"


def _run(config: dict[str, Any], settings: StudySettings) -> Run:
    """The trial's batch shape (the global batch is per process), processes, device and lr."""
    micro, accum = micro_and_accumulation(config, settings.global_batch_size)
    return Run(micro, accum, settings.nproc, _device(settings), settings.lr)


def _parts(hook: str, config: dict[str, Any], run: Run) -> dict[str, Any]:
    """Every registered technique's keys for one export (``Technique.<hook>``), in order."""
    out: dict[str, Any] = {}
    for technique in TECHNIQUES:
        out.update(getattr(technique, hook)(config, run))
    return out


def measured_on(settings: StudySettings) -> str:
    """One line saying where the winner's numbers come from."""
    if settings.backend == "cpu":
        return (
            "measured on CPU (autotune --backend cpu): the fastest configuration on this CPU; "
            "on a GPU, run a study with --backend cuda before relying on it"
        )
    if settings.backend == "estimate":
        return f"predicted for GPU {settings.target_gpu or '?'} (--backend estimate), not measured"
    return "measured on CUDA GPU (autotune --backend cuda)"


def deepspeed_config(
    config: dict[str, Any], settings: StudySettings, user: UserSettings = UserSettings()
) -> dict[str, Any]:
    """The DeepSpeed JSON the trial ran with (the trial job builds it with the same function),
    with the optimizer hyperparameters the study did not tune handed back to the user: ``"auto"``
    (the Trainer or accelerate fills them from the user's settings) or the user's flags; betas
    and eps are left out, so AdamW's defaults apply (the trial's, torch's and the Trainer's)."""
    ds = deepspeed_engine.deepspeed_config(config, _run(config, settings))
    hand_back(
        ds,
        "auto" if user.lr is None else user.lr,
        "auto" if user.weight_decay is None else user.weight_decay,
    )
    return ds


def hf_training_arguments(
    config: dict[str, Any],
    settings: StudySettings,
    deepspeed_path: str | None = None,
    user: UserSettings = UserSettings(),
) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments(**d)`` (no ``output_dir``: the
    user's; the attention kernel is in the companion file)."""
    args: dict[str, Any] = {
        **_parts("training_arguments", config, _run(config, settings)),
        "max_grad_norm": NO_CLIPPING,
    }
    if _device(settings) == "cpu":
        args["use_cpu"] = True  # what was measured; a GPU study's export has no such key
    if user.lr is not None:
        args["learning_rate"] = user.lr
    if user.weight_decay is not None:
        args["weight_decay"] = user.weight_decay
    if deepspeed_path is not None:
        args["deepspeed"] = deepspeed_path
    return args


def accelerate_config(
    config: dict[str, Any], settings: StudySettings, deepspeed_path: str | None = None
) -> dict[str, Any]:
    """An ``accelerate`` config file (``accelerate launch --config_file``). For a ZeRO trial it
    names the DeepSpeed JSON (``deepspeed_config_file``), which carries precision, batch shape,
    clipping and the optimizer; accelerate reads those from it."""
    multi = "MULTI_CPU" if _device(settings) == "cpu" else "MULTI_GPU"
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO" if settings.nproc == 1 else multi,
        **_parts("accelerate", config, _run(config, settings)),  # mixed_precision
        "num_machines": 1,
        "num_processes": settings.nproc,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": _device(settings) == "cpu",
    }
    if deepspeed_path is not None:
        # accelerate refuses a mixed_precision key beside a DeepSpeed file (the file says it)
        cfg.pop("mixed_precision", None)
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_path,
            "zero3_init_flag": False,
        }
    return cfg


def companion(
    config: dict[str, Any], settings: StudySettings, deepspeed_path: str | None
) -> dict[str, Any]:
    """``<stem>.autotune.json``: what a training script needs that the config files cannot say
    (with a DeepSpeed file, the batch shape is DeepSpeed's: accelerate refuses it twice)."""
    return {
        "deepspeed_config": deepspeed_path,
        "measured_on": _device(settings) if settings.backend != "estimate" else "estimate",
        "note": measured_on(settings),
        # model_kwargs (from_pretrained / from_config), the batch shape, checkpointing
        **_parts("companion", config, _run(config, settings)),
        "processes": settings.nproc,
        "max_grad_norm": None,  # the trials do not clip gradients
        "not_tuned": not_tuned(settings),
        "learning_rate": settings.user_lr,
        "model": settings.model,
        "model_folder": settings.weights,
        "seq_len": settings.seq_len,
    }


def _header(config: dict[str, Any], settings: StudySettings, out: Path) -> str:
    """Comment lines for the formats that have comments (YAML, shell)."""
    attention = attn_implementation(config)
    return (
        # the model name is a user's file name: on one line, so it stays inside the comment
        f"# autotune winner for {printable(settings.model)} within {settings.budget_label}: "
        f"{measured_on(settings)}\n"
        f"# model: attn_implementation={attention} (from_pretrained/from_config keyword; "
        f"also in {printable(str(_companion_path(out)))})\n"
        f"# not tuned, left to your defaults: {', '.join(not_tuned(settings))}\n"
    )


@dataclass(frozen=True)
class Exporter:
    render: Callable[[dict[str, Any], StudySettings, Path, UserSettings], str]
    suffix: str


def _json(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def _companion_path(out: Path) -> Path:
    return out.with_name(out.stem + ".autotune.json")


def _side_deepspeed(
    config: dict[str, Any], settings: StudySettings, out: Path, user: UserSettings
) -> str | None:
    """For a ZeRO trial, write its DeepSpeed JSON next to ``out`` and return the path."""
    if not runs_deepspeed(config):
        return None
    ds_file = out.with_name(out.stem + ".deepspeed.json")
    write_atomic(ds_file, _json(deepspeed_config(config, settings, user)))
    return str(ds_file)


def _render_deepspeed(
    config: dict[str, Any], settings: StudySettings, out: Path, user: UserSettings
) -> str:
    return _json(deepspeed_config(config, settings, user))


def _render_hf(
    config: dict[str, Any], settings: StudySettings, out: Path, user: UserSettings
) -> str:
    ds_path = _side_deepspeed(config, settings, out, user)  # TrainingArguments points at it
    return _json(hf_training_arguments(config, settings, ds_path, user))


def _render_accelerate(
    config: dict[str, Any], settings: StudySettings, out: Path, user: UserSettings
) -> str:
    run = _run(config, settings)
    micro, accum = run.micro_batch, run.accumulation
    ds_path = _side_deepspeed(config, settings, out, user)
    note = (
        f"# batch: micro-batch {micro} x {accum} accumulation steps per process "
        "(accelerate's file has no key for them: Accelerator(gradient_accumulation_steps=...)); "
        "no gradient clipping\n"
        if ds_path is None
        else "# batch shape, precision, clipping and optimizer: in the DeepSpeed file it names\n"
    )
    cfg = accelerate_config(config, settings, ds_path)
    return _header(config, settings, out) + note + yaml.safe_dump(cfg, sort_keys=False)


def axolotl_config(
    config: dict[str, Any],
    settings: StudySettings,
    deepspeed_path: str | None = None,
    user: UserSettings = UserSettings(),
) -> dict[str, Any]:
    """The training keys of an axolotl YAML config (merge into one that names the model, the
    data and the learning rate, which axolotl requires). axolotl checkpoints every layer:
    selective checkpointing exports as full. Validated by axolotl's ``validate_config``."""
    cfg: dict[str, Any] = {
        "sequence_len": settings.seq_len,
        # batch shape, checkpointing, attention, precision, optimizer, quantization + LoRA
        **_parts("axolotl", config, _run(config, settings)),
        "max_grad_norm": NO_CLIPPING,
    }
    if user.lr is not None:
        cfg["learning_rate"] = user.lr
    if user.weight_decay is not None:
        cfg["weight_decay"] = user.weight_decay
    if deepspeed_path is not None:
        cfg["deepspeed"] = deepspeed_path
    return cfg


def _render_axolotl(
    config: dict[str, Any], settings: StudySettings, out: Path, user: UserSettings
) -> str:
    ds_path = _side_deepspeed(config, settings, out, user)
    body = yaml.safe_dump(axolotl_config(config, settings, ds_path, user), sort_keys=False)
    return _header(config, settings, out) + body


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
    config: dict[str, Any],
    settings: StudySettings,
    out: Path,
    script: str = "train.py",
    user: UserSettings = UserSettings(),
) -> list[str]:
    """A ready launch of a Hugging Face Trainer script with the winner's settings: through
    ``deepspeed`` for a ZeRO trial, else ``accelerate launch``; writes the config it names."""
    ds_path = _side_deepspeed(config, settings, out, user)
    train_args = _flags(hf_training_arguments(config, settings, ds_path, user))
    if ds_path is not None:
        return ["deepspeed", "--num_gpus", str(settings.nproc), script, *train_args]
    acc_file = out.with_name(out.stem + ".accelerate.yaml")
    write_atomic(acc_file, yaml.safe_dump(accelerate_config(config, settings), sort_keys=False))
    return ["accelerate", "launch", "--config_file", str(acc_file), script, *train_args]


def _render_command(
    config: dict[str, Any], settings: StudySettings, out: Path, user: UserSettings
) -> str:
    command = " ".join(
        shlex.quote(part) for part in launch_command(config, settings, out, user=user)
    )
    return (
        "#!/usr/bin/env bash\n"
        + _header(config, settings, out)
        + "# train.py: your Hugging Face Trainer script (HfArgumentParser reads these flags);"
        " add your own (output dir, steps) after the command\n"
        f'{command} "$@"\n'
    )


EXPORTERS: dict[str, Exporter] = {
    "deepspeed": Exporter(_render_deepspeed, ".json"),
    "hf": Exporter(_render_hf, ".json"),
    "accelerate": Exporter(_render_accelerate, ".yaml"),
    "axolotl": Exporter(_render_axolotl, ".yaml"),
    "command": Exporter(_render_command, ".sh"),
}


def targets(fmt: str, config: dict[str, Any], out: Path) -> list[Path]:
    """Every file ``export`` writes for this format and winner: ``out``, the DeepSpeed JSON or
    accelerate YAML it names, and the companion ``<stem>.autotune.json``."""
    paths = [out]
    if runs_deepspeed(config) and fmt != "deepspeed":
        paths.append(out.with_name(out.stem + ".deepspeed.json"))
    if fmt == "command" and not runs_deepspeed(config):
        paths.append(out.with_name(out.stem + ".accelerate.yaml"))
    return [*paths, _companion_path(out)]


def export(
    fmt: str,
    config: dict[str, Any],
    settings: StudySettings,
    out: Path,
    user: UserSettings = UserSettings(),
    force: bool = False,
    protected: Sequence[Path] = (),
) -> Path:
    """Write ``out`` (and the files it names, and ``<stem>.autotune.json``) for the winner.

    Every file is checked before any is written (``safe_files.check_targets``: not the study's
    database in ``protected``, not a file autotune did not write unless ``force``) and written
    atomically; the companion records what was written, so a second export may replace it."""
    if fmt not in EXPORTERS:
        raise UserError(f"unknown export format '{fmt}' (known: {', '.join(EXPORTERS)})")
    if fmt == "deepspeed" and (runs_fsdp(config) or steps_in_backward(config)):
        engine = "FSDP2" if runs_fsdp(config) else "the optimizer step in backward"
        raise UserError(
            f"this configuration trains with {engine}, not DeepSpeed: export it with "
            "--format accelerate, hf, axolotl or command"
        )
    if not out.parent.exists():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    if user.lr is None and settings.user_lr is not None:  # the study's --lr
        user = replace(user, lr=settings.user_lr)
    settings = replace(settings, user_lr=user.lr)  # what the header and companion say
    companion_path = _companion_path(out)
    paths = targets(fmt, config, out)
    check_targets(paths, companion_path, force, protected)
    recorded = read_manifest(companion_path) or {}
    with nothing_left(paths):
        text = EXPORTERS[fmt].render(config, settings, out, user)
        recorded[out.name] = write_atomic(out, text)
        for side in paths[1:-1]:  # written by the renderer
            recorded[side.name] = sha256(side.read_bytes())
        side = out.with_name(out.stem + ".deepspeed.json")
        ds_path = str(out if fmt == "deepspeed" else side) if runs_deepspeed(config) else None
        doc = {**companion(config, settings, ds_path), **manifest_entry(recorded)}
        write_atomic(companion_path, _json(doc))
    return out
