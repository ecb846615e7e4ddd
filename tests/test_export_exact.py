"""The exports' exact words and files: what a user reads in each file (the header comment lines,
the note lines of the accelerate YAML and the command script, the one-line ``measured_on``
sentence), which side files each export writes and what they hold, the launch command as a
shell reads it, the key order of the YAML files, the JSON layout, and the one-line errors.

The expected texts are written out here by hand; the consumers' own loaders (accelerate's
``load_config_from_file``, transformers' ``HfArgumentParser``) read the files back.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune.errors import UserError
from autotune.export import UserSettings, export, measured_on
from autotune.study import StudySettings
from tests.conftest import TINY_SETTINGS
from tests.test_export_tools import PLAIN
from trials.techniques import TECHNIQUES
from trials.techniques.base import Config, Run, Technique

CPU = TINY_SETTINGS  # tiny-llama, 300MB, backend cpu, seq 64, global batch 8, one process
CUDA2 = replace(TINY_SETTINGS, backend="cuda", nproc=2)
CPU2 = replace(TINY_SETTINGS, nproc=2)
ESTIMATE = replace(TINY_SETTINGS, backend="estimate", target_gpu="H100-80GB")

ZERO: dict[str, Any] = {
    "precision": "fp16",
    "attention": "eager",
    "micro_batch_size": 4,
    "zero_stage": 2,
}
FSDP = {"precision": "bf16", "micro_batch_size": 2, "fsdp": "full_shard"}
IN_BACKWARD = {"precision": "fp32", "micro_batch_size": 2, "optimizer_in_backward": True}

CPU_SENTENCE = (
    "measured on CPU (autotune --backend cpu): the fastest configuration on this CPU; "
    "on a GPU, run a study with --backend cuda before relying on it"
)
CUDA_SENTENCE = "measured on CUDA GPU (autotune --backend cuda)"
NOT_TUNED_LINE = (
    "# not tuned, left to your defaults: "
    "learning_rate, lr_scheduler, weight_decay, output_dir, max_steps"
)
PLAIN_NOTE = (
    "# batch: micro-batch 2 x 4 accumulation steps per process (accelerate's file has no key "
    "for them: Accelerator(gradient_accumulation_steps=...)); no gradient clipping"
)
DEEPSPEED_NOTE = "# batch shape, precision, clipping and optimizer: in the DeepSpeed file it names"
TRAIN_PY_NOTE = (
    "# train.py: your Hugging Face Trainer script (HfArgumentParser reads these flags); "
    "add your own (output dir, steps) after the command"
)
#: the accelerate config of PLAIN on one CPU process, as the command export writes it beside
#: the script (the keys in the order a reader expects: environment first, then the processes)
PLAIN_ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: bf16
num_machines: 1
num_processes: 1
machine_rank: 0
main_training_function: main
use_cpu: true
"""
BAD_ENGINE = (
    "this configuration trains with {}, not DeepSpeed: "
    "export it with --format accelerate, hf, axolotl or command"
)


def _header(settings_line: str, attention: str, out: Path, lr: bool = False) -> list[str]:
    """The comment lines; with a learning rate given it is written, not left to the defaults."""
    return [
        f"# autotune winner for tiny-llama within 300MB: {settings_line}",
        f"# model: attn_implementation={attention} (from_pretrained/from_config keyword; "
        f"also in {out.with_name(out.stem + '.autotune.json')})",
        NOT_TUNED_LINE.replace("learning_rate, ", "") if lr else NOT_TUNED_LINE,
    ]


def _companion(out: Path) -> dict[str, Any]:
    return dict(json.loads(out.with_name(out.stem + ".autotune.json").read_text()))


# --- measured_on: the three sentences --------------------------------------------------------


def test_measured_on_says_where_the_numbers_come_from() -> None:
    assert measured_on(CPU) == CPU_SENTENCE
    assert measured_on(CUDA2) == CUDA_SENTENCE
    assert measured_on(ESTIMATE) == (
        "predicted for GPU H100-80GB (--backend estimate), not measured"
    )
    no_gpu = replace(ESTIMATE, target_gpu="")
    assert measured_on(no_gpu) == "predicted for GPU ? (--backend estimate), not measured"


@pytest.mark.parametrize(
    ("settings", "where", "note"),
    [
        (CPU, "cpu", CPU_SENTENCE),
        (CUDA2, "cuda", CUDA_SENTENCE),
        (ESTIMATE, "estimate", "predicted for GPU H100-80GB (--backend estimate), not measured"),
    ],
)
def test_companion_file_holds_what_the_configs_cannot_say(
    settings: StudySettings, where: str, note: str, tmp_path: Path
) -> None:
    out = export("hf", PLAIN, settings, tmp_path / "out.json")
    side = _companion(out)
    assert side["measured_on"] == where and side["note"] == note
    assert side["deepspeed_config"] is None
    assert side["processes"] == settings.nproc
    assert side["max_grad_norm"] is None
    assert side["not_tuned"] == [
        "learning_rate",
        "lr_scheduler",
        "weight_decay",
        "output_dir",
        "max_steps",
    ]
    assert side["model"] == "tiny-llama" and side["seq_len"] == 64
    assert side["model_kwargs"] == {"attn_implementation": "sdpa"}
    assert (side["micro_batch_size"], side["gradient_accumulation_steps"]) == (2, 4)


def test_json_files_are_sorted_two_space_indented_with_a_final_newline(tmp_path: Path) -> None:
    """Stable, diff-friendly JSON: the same winner always gives the same bytes."""
    out = export("hf", ZERO, CPU, tmp_path / "out.json")
    for path in (out, tmp_path / "out.deepspeed.json", tmp_path / "out.autotune.json"):
        text = path.read_text()
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n", path
        assert text.startswith('{\n  "'), path
        keys = list(json.loads(text))
        assert keys == sorted(keys), path
    ds_text = export("deepspeed", ZERO, CPU, tmp_path / "ds.json").read_text()
    assert ds_text == json.dumps(json.loads(ds_text), indent=2, sort_keys=True) + "\n"


# --- the accelerate YAML: header, note, keys ---------------------------------------------------


def test_accelerate_export_without_deepspeed_word_for_word(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    out = export("accelerate", PLAIN, CPU, tmp_path / "out.yaml")
    text = out.read_text()
    assert text.splitlines() == [
        *_header(CPU_SENTENCE, "sdpa", out),
        PLAIN_NOTE,
        *PLAIN_ACCELERATE_YAML.splitlines(),
    ]
    cluster = load_config_from_file(str(out))
    assert cluster.num_machines == 1 and cluster.machine_rank == 0
    assert cluster.main_training_function == "main"
    assert cluster.distributed_type.value == "NO" and cluster.use_cpu is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.autotune.json", "out.yaml"]


def test_accelerate_export_with_deepspeed_names_the_file(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    out = export("accelerate", ZERO, CUDA2, tmp_path / "out.yaml")
    ds_file = tmp_path / "out.deepspeed.json"
    assert out.read_text().splitlines() == [
        *_header(CUDA_SENTENCE, "eager", out),
        DEEPSPEED_NOTE,
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: DEEPSPEED",
        "num_machines: 1",
        "num_processes: 2",
        "machine_rank: 0",
        "main_training_function: main",
        "use_cpu: false",
        "deepspeed_config:",
        f"  deepspeed_config_file: {ds_file}",
        "  zero3_init_flag: false",
    ]
    cluster = load_config_from_file(str(out))
    assert cluster.distributed_type.value == "DEEPSPEED"
    assert cluster.mixed_precision is None  # the DeepSpeed file says it
    assert cluster.deepspeed_config == {
        "deepspeed_config_file": str(ds_file),
        "zero3_init_flag": False,
    }
    assert cluster.num_machines == 1 and cluster.machine_rank == 0
    assert cluster.main_training_function == "main" and cluster.use_cpu is False
    assert json.loads(ds_file.read_text())["fp16"]["enabled"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out.autotune.json",
        "out.deepspeed.json",
        "out.yaml",
    ]


@pytest.mark.parametrize(
    ("settings", "kind"),
    [
        (CPU, "NO"),
        (CPU2, "MULTI_CPU"),
        (CUDA2, "MULTI_GPU"),
        (replace(ESTIMATE, nproc=2), "MULTI_GPU"),
    ],
)
def test_accelerate_distributed_type_follows_processes_and_device(
    settings: StudySettings, kind: str, tmp_path: Path
) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    out = export("accelerate", PLAIN, settings, tmp_path / "out.yaml")
    cluster = load_config_from_file(str(out))
    assert cluster.distributed_type.value == kind
    assert cluster.num_processes == settings.nproc
    assert cluster.use_cpu is (settings.backend == "cpu")
    assert cluster.mixed_precision == "bf16"
    assert yaml.safe_load(out.read_text())["distributed_type"] == kind


def test_fsdp_winner_exports_to_accelerate_but_not_to_deepspeed(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    out = export("accelerate", FSDP, CUDA2, tmp_path / "out.yaml")
    cluster = load_config_from_file(str(out))
    assert cluster.distributed_type.value == "FSDP"
    assert cluster.fsdp_config["fsdp_version"] == 2
    assert cluster.mixed_precision == "bf16"
    for fmt, suffix in (("hf", ".json"), ("axolotl", ".yaml"), ("command", ".sh")):
        assert export(fmt, FSDP, CUDA2, tmp_path / f"{fmt}{suffix}").exists()
    assert export("hf", IN_BACKWARD, CPU, tmp_path / "inb.json").exists()


# --- the axolotl YAML --------------------------------------------------------------------------


@pytest.mark.parametrize("deepspeed", [False, True])
def test_axolotl_export_header_and_key_order(deepspeed: bool, tmp_path: Path) -> None:
    config = ZERO if deepspeed else PLAIN
    user = UserSettings(lr=2e-4, weight_decay=0.1)
    out = export("axolotl", config, CPU, tmp_path / "out.yaml", user)
    lines = out.read_text().splitlines()
    assert lines[:3] == _header(CPU_SENTENCE, config["attention"], out, lr=True)
    assert not any(line.startswith("#") for line in lines[3:])
    frag = yaml.safe_load(out.read_text())
    keys = list(frag)  # document order: the sequence first, the user's and the file last
    assert keys[0] == "sequence_len" and frag["sequence_len"] == 64
    tail = ["max_grad_norm", "learning_rate", "weight_decay", *(["deepspeed"] if deepspeed else [])]
    assert keys[-len(tail) :] == tail
    assert (frag["learning_rate"], frag["weight_decay"], frag["max_grad_norm"]) == (2e-4, 0.1, 0.0)
    assert (frag["micro_batch_size"], frag["gradient_accumulation_steps"]) == (
        config["micro_batch_size"],
        8 // config["micro_batch_size"],
    )
    if deepspeed:
        assert frag["deepspeed"] == str(tmp_path / "out.deepspeed.json")
        params = json.loads((tmp_path / "out.deepspeed.json").read_text())["optimizer"]["params"]
        assert (params["lr"], params["weight_decay"]) == (2e-4, 0.1)
    else:
        assert "deepspeed" not in frag
        assert not (tmp_path / "out.deepspeed.json").exists()


def test_header_keeps_a_users_names_inside_the_comment(tmp_path: Path) -> None:
    """A model name or output path with a newline is written escaped, on the comment's line."""
    folder = tmp_path / "odd\nname"
    folder.mkdir()
    settings = replace(CPU, model="my\nmodel")
    out = export("axolotl", PLAIN, settings, folder / "out.yaml")
    lines = out.read_text().splitlines()
    assert lines[0] == f"# autotune winner for my\\nmodel within 300MB: {CPU_SENTENCE}"
    escaped = str(folder / "out.autotune.json").replace("\n", "\\n")
    assert lines[1] == (
        "# model: attn_implementation=sdpa (from_pretrained/from_config keyword; "
        f"also in {escaped})"
    )
    assert lines[2] == NOT_TUNED_LINE and not lines[3].startswith("#")
    assert yaml.safe_load(out.read_text())["sequence_len"] == 64


# --- the command script ------------------------------------------------------------------------


def test_command_without_deepspeed_launches_accelerate_with_its_file(tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from transformers import HfArgumentParser, TrainingArguments

    out = export("command", PLAIN, CPU, tmp_path / "out.sh")
    lines = out.read_text().splitlines()
    assert lines[:5] == [
        "#!/usr/bin/env bash",
        *_header(CPU_SENTENCE, "sdpa", out),
        TRAIN_PY_NOTE,
    ]
    assert len(lines) == 6
    acc_file = tmp_path / "out.accelerate.yaml"
    argv = shlex.split(lines[5])
    assert argv[:5] == ["accelerate", "launch", "--config_file", str(acc_file), "train.py"]
    assert argv[-1] == "$@"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out.accelerate.yaml",
        "out.autotune.json",
        "out.sh",
    ]
    assert acc_file.read_text() == PLAIN_ACCELERATE_YAML  # no comments; the keys in order
    assert load_config_from_file(str(acc_file)).mixed_precision == "bf16"
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [*argv[5:-1], "--output_dir", str(tmp_path / "o")]
    )
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.use_cpu is True and args.max_grad_norm == 0.0 and args.deepspeed is None
    assert _companion(out)["deepspeed_config"] is None


def test_command_with_deepspeed_launches_deepspeed_on_every_process(tmp_path: Path) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    user = UserSettings(lr=2e-4)
    out = export("command", ZERO, CUDA2, tmp_path / "out.sh", user)
    lines = out.read_text().splitlines()
    assert lines[:5] == [
        "#!/usr/bin/env bash",
        *_header(CUDA_SENTENCE, "eager", out, lr=True),
        TRAIN_PY_NOTE,
    ]
    ds_file = tmp_path / "out.deepspeed.json"
    argv = shlex.split(lines[5])
    assert argv[:4] == ["deepspeed", "--num_gpus", "2", "train.py"]
    assert argv[-3:] == ["--deepspeed", str(ds_file), "$@"]
    assert "--use_cpu" not in argv
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "out.autotune.json",
        "out.deepspeed.json",
        "out.sh",
    ]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [*argv[4:-1], "--output_dir", str(tmp_path / "o")]
    )
    assert args.learning_rate == 2e-4 and args.fp16 is True
    assert json.loads(ds_file.read_text())["optimizer"]["params"]["lr"] == 2e-4
    assert _companion(out)["deepspeed_config"] == str(ds_file)


# --- which files each export writes ------------------------------------------------------------

SUFFIX = {"deepspeed": ".json", "hf": ".json", "accelerate": ".yaml", "axolotl": ".yaml"}


@pytest.mark.parametrize("fmt", list(SUFFIX))
@pytest.mark.parametrize("name", ["plain", "zero"])
def test_side_files_on_disk(fmt: str, name: str, tmp_path: Path) -> None:
    config = ZERO if name == "zero" else PLAIN
    user = UserSettings(lr=1e-4, weight_decay=0.05)
    out = export(fmt, config, CPU, tmp_path / f"out{SUFFIX[fmt]}", user)
    assert out == tmp_path / f"out{SUFFIX[fmt]}"
    written = sorted(p.name for p in tmp_path.iterdir())
    side_ds = name == "zero" and fmt != "deepspeed"  # the DeepSpeed export is itself the file
    expected = sorted([out.name, "out.autotune.json", *(["out.deepspeed.json"] if side_ds else [])])
    assert written == expected
    named = _companion(out)["deepspeed_config"]
    if name == "plain":
        assert named is None
    else:
        assert named == str(out if fmt == "deepspeed" else tmp_path / "out.deepspeed.json")
        ds = json.loads(Path(named).read_text())
        assert ds["zero_optimization"]["stage"] == 2
        assert ds["optimizer"]["params"]["lr"] == 1e-4
        assert ds["optimizer"]["params"]["weight_decay"] == 0.05
        assert "betas" not in ds["optimizer"]["params"]
        assert "eps" not in ds["optimizer"]["params"]


def test_deepspeed_export_leaves_untuned_optimizer_values_auto(tmp_path: Path) -> None:
    ds = json.loads(export("deepspeed", ZERO, CPU, tmp_path / "ds.json").read_text())
    assert ds["optimizer"]["params"]["lr"] == "auto"
    assert ds["optimizer"]["params"]["weight_decay"] == "auto"
    only_lr = export("deepspeed", ZERO, CPU, tmp_path / "lr.json", UserSettings(lr=5e-4))
    params = json.loads(only_lr.read_text())["optimizer"]["params"]
    assert (params["lr"], params["weight_decay"]) == (5e-4, "auto")
    only_wd = export("deepspeed", ZERO, CPU, tmp_path / "wd.json", UserSettings(weight_decay=0.2))
    params = json.loads(only_wd.read_text())["optimizer"]["params"]
    assert (params["lr"], params["weight_decay"]) == ("auto", 0.2)


# --- the one-line errors ----------------------------------------------------------------------


def test_unknown_format_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError) as caught:
        export("yaml", PLAIN, CPU, tmp_path / "out.yaml")
    assert caught.value.message == (
        "unknown export format 'yaml' (known: deepspeed, hf, accelerate, axolotl, command)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("config", "engine"),
    [(FSDP, "FSDP2"), (IN_BACKWARD, "the optimizer step in backward")],
)
def test_deepspeed_export_of_another_engine_is_refused(
    config: dict[str, Any], engine: str, tmp_path: Path
) -> None:
    with pytest.raises(UserError) as caught:
        export("deepspeed", config, CPU, tmp_path / "out.json")
    assert caught.value.message == BAD_ENGINE.format(engine)
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "nowhere" / "out.json"
    with pytest.raises(UserError) as caught:
        export("hf", PLAIN, CPU, out)
    assert caught.value.message == (
        f"cannot write {out}: folder {tmp_path / 'nowhere'} does not exist"
    )
    assert list(tmp_path.iterdir()) == []


# --- every technique's hooks see the trial's run -----------------------------------------------


class RunRecorder(Technique):
    """A technique someone adds (registered for the test only): each export hook records the
    ``Run`` it is given and adds one key naming the hook."""

    family = "run_recorder"

    def __init__(self) -> None:
        self.seen: dict[str, list[Run]] = {}

    def _record(self, hook: str, config: Config, run: Run) -> dict[str, Any]:
        assert config["micro_batch_size"] == 2  # the winner's own config
        self.seen.setdefault(hook, []).append(run)
        return {f"recorded_{hook}": True}

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        return self._record("deepspeed", config, run)

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        return self._record("training_arguments", config, run)

    def accelerate(self, config: Config, run: Run) -> dict[str, Any]:
        return self._record("accelerate", config, run)

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return self._record("axolotl", config, run)

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return self._record("companion", config, run)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (CPU, Run(micro_batch=2, accumulation=4, processes=1, device="cpu", lr=3e-3)),
        (
            replace(CUDA2, global_batch_size=16, lr=1e-3),
            Run(micro_batch=2, accumulation=8, processes=2, device="cuda", lr=1e-3),
        ),
        (ESTIMATE, Run(micro_batch=2, accumulation=4, processes=1, device="cuda", lr=3e-3)),
    ],
)
def test_technique_hooks_get_the_trials_run(
    settings: StudySettings, expected: Run, tmp_path: Path
) -> None:
    """Each hook gets the batch shape per process, the process count, the device ("cuda" for
    an estimate) and the study's lr, and its keys reach its file."""
    config = {**ZERO, "micro_batch_size": 2}
    with TECHNIQUES.extended(RunRecorder()) as technique:
        assert isinstance(technique, RunRecorder)
        hf = json.loads(export("hf", config, settings, tmp_path / "hf.json").read_text())
        acc = yaml.safe_load(
            export("accelerate", PLAIN, settings, tmp_path / "acc.yaml").read_text()
        )
        axo = yaml.safe_load(export("axolotl", config, settings, tmp_path / "a.yaml").read_text())
        ds = json.loads(export("deepspeed", config, settings, tmp_path / "d.json").read_text())
    assert set(technique.seen) == {
        "deepspeed",
        "training_arguments",
        "accelerate",
        "axolotl",
        "companion",
    }
    for hook, runs in technique.seen.items():
        assert runs and all(run == expected for run in runs), hook
    assert hf["recorded_training_arguments"] is True
    assert acc["recorded_accelerate"] is True
    assert axo["recorded_axolotl"] is True
    assert ds["recorded_deepspeed"] is True
    assert _companion(tmp_path / "hf.json")["recorded_companion"] is True
    assert "recorded_deepspeed" in json.loads((tmp_path / "hf.deepspeed.json").read_text())
