"""Exports proven by the tools that consume them.

A study's winner is planted as a real Optuna trial in a real SQLite study (next to a slower
decoy), exported through the real CLI, and then:

* read back against the winner's configuration as Optuna stored it (the raw
  ``trial_user_attributes`` row, read with ``sqlite3``, not through autotune);
* checked by the consumers' own consistency checks (``TrainingArguments`` with a DeepSpeed file
  runs transformers' ``trainer_config_process``, which refuses any DeepSpeed value that disagrees
  with the Trainer's);
* (slow) run by the consumer: a plain ``Trainer`` script under ``torchrun``, a plain loop under
  ``accelerate launch --config_file``, the ``command`` script with a stand-in ``train.py``, each
  training tiny-llama a few steps on the CPU with the real DeepSpeed engine (gloo). The scripts
  report what the consumer actually used (processed DeepSpeed config, engine stage, optimizer
  class, checkpointed layers, attention kernel), which is compared with the stored winner.

fp16 under DeepSpeed needs fp16 kernels a CPU lacks (the trials drop it here too): fp16 is run on
the plain Trainer and accelerate paths (torch autocast + GradScaler), where it runs on a CPU.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from tests.conftest import SMALL_SPACE, TINY, cli
from tests.studies import make_study

CONSUMERS = Path(__file__).parent / "consumers"
VENV_BIN = Path(sys.executable).parent
FORMATS = {
    "deepspeed": ".json",
    "hf": ".json",
    "accelerate": ".yaml",
    "axolotl": ".yaml",
    "command": ".sh",
}
GLOBAL_BATCH = 8  # tests/studies.make_study: tiny-llama, seq 64, global batch 8
TRIAL_LR = 3e-3  # the trials' internal learning rate (StudySettings.lr), never to be exported
HF_DEFAULT_LR = 5e-5  # TrainingArguments' default learning rate

BASE = {"attention": "sdpa", "optimizer": "adamw", "gradient_checkpointing": "off"}
#: winners covering ZeRO 0-3, offload of optimizer and parameters, bf16/fp16, checkpointing
#: (full and every k-th layer), attention kernels and accumulation
WINNERS: dict[str, dict[str, Any]] = {
    "zero3_offload": {
        **BASE,
        "attention": "eager",
        "gradient_checkpointing": "full",
        "precision": "fp32",
        "micro_batch_size": 2,
        "zero_stage": 3,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
        "reduce_bucket_size": 5000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
    "zero2_offload_bf16": {
        **BASE,
        "gradient_checkpointing": "selective",
        "checkpoint_every": 2,
        "precision": "bf16",
        "micro_batch_size": 4,
        "zero_stage": 2,
        "offload_optimizer": "cpu",
        "reduce_bucket_size": 50000000,
        "allgather_bucket_size": 50000000,
        "overlap_comm": False,
        "contiguous_gradients": True,
    },
    "zero1_bf16": {
        **BASE,
        "precision": "bf16",
        "micro_batch_size": 4,
        "zero_stage": 1,
        "offload_optimizer": "none",
        "reduce_bucket_size": 5000000,
    },
    "zero0": {**BASE, "precision": "fp32", "micro_batch_size": 2, "zero_stage": 0},
    "plain_fp16": {
        **BASE,
        "gradient_checkpointing": "full",
        "precision": "fp16",
        "micro_batch_size": 4,
    },
    "plain_bf16": {
        **BASE,
        "attention": "eager",
        "gradient_checkpointing": "selective",
        "checkpoint_every": 2,
        "precision": "bf16",
        "micro_batch_size": 2,
    },
}
DECOY = {**BASE, "precision": "fp32", "micro_batch_size": 8}


def plant(db: Path, name: str, winner: dict[str, Any], backend: str = "cpu") -> None:
    """A study (as ``autotune run`` makes it) holding two finished trials: the slower decoy and
    the winner, recorded through Optuna's own API."""
    study = make_study(f"sqlite:///{db}", name, SMALL_SPACE, "1GB", backend)
    for config, speed in ((DECOY, 500.0), (winner, 1000.0)):
        attrs = {
            "config": config,
            "status": "ok",
            "peak_bytes": 100 * 2**20,
            "tokens_per_s": speed,
            "losses": [9.0, 9.0],
        }
        study.add_trial(optuna.trial.create_trial(values=[speed, 100.0], user_attrs=attrs))


def stored_winner(db: Path, name: str) -> dict[str, Any]:
    """The fastest trial's ``config`` user attr, straight from Optuna's SQLite tables."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT a.value_json, v.value FROM trial_user_attributes a "
            "JOIN trials t ON t.trial_id = a.trial_id "
            "JOIN studies s ON s.study_id = t.study_id "
            "JOIN trial_values v ON v.trial_id = t.trial_id AND v.objective = 0 "
            "WHERE s.study_name = ? AND a.key = 'config'",
            (name,),
        ).fetchall()
    return dict(json.loads(max(rows, key=lambda r: r[1])[0]))


def export_all(folder: Path, name: str, *flags: str, prefix: str = "out") -> dict[str, Path]:
    files = {}
    for fmt, suffix in FORMATS.items():
        out = folder / f"{prefix}-{fmt}{suffix}"
        result = cli("export", "--study", name, "--format", fmt, "--out", str(out), *flags)
        assert result.exit_code == 0, result.output
        files[fmt] = out
    return files


def _companion(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.with_name(path.stem + ".autotune.json").read_text()))


def _every(raw: dict[str, Any]) -> int | None:
    ckpt = raw.get("gradient_checkpointing", "off")
    return None if ckpt == "off" else 1 if ckpt == "full" else int(raw["checkpoint_every"])


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite file, one study per winner (cpu backend), plus one cuda-backend study."""
    folder = tmp_path_factory.mktemp("studies")
    for name, winner in WINNERS.items():
        plant(folder / "autotune.db", name, winner)
    plant(folder / "autotune.db", "on-cuda", WINNERS["zero2_offload_bf16"], backend="cuda")
    return folder


@pytest.fixture()
def at_studies(studies: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(studies)
    return studies


# --- round trip: every export against the stored winner ---------------------------------------


@pytest.mark.parametrize("name", list(WINNERS))
def test_exports_round_trip_to_the_stored_winner(
    name: str, at_studies: Path, tmp_path: Path
) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import HfArgumentParser, TrainingArguments

    raw = stored_winner(at_studies / "autotune.db", name)
    assert raw == WINNERS[name]  # the planted winner, not the decoy, is the fastest stored
    files = export_all(tmp_path, name)
    micro, stage = raw["micro_batch_size"], raw.get("zero_stage")
    accum = GLOBAL_BATCH // micro

    ds_dict = json.loads(files["deepspeed"].read_text())
    if stage is not None:
        ds = DeepSpeedConfig(ds_dict)  # DeepSpeed's own parser
        assert ds.train_micro_batch_size_per_gpu == micro
        assert ds.gradient_accumulation_steps == accum
        assert ds.zero_optimization_stage == stage
        assert ds.bfloat16_config.enabled == (raw["precision"] == "bf16")
        assert ds.gradient_clipping == 0.0  # the trials do not clip
        offload = ds.zero_config.offload_optimizer
        assert (offload is not None and offload.device == "cpu") == (
            raw.get("offload_optimizer") == "cpu"
        )
        if "reduce_bucket_size" in raw:
            assert ds.zero_config.reduce_bucket_size == raw["reduce_bucket_size"]
        if "overlap_comm" in raw:
            assert ds.zero_config.overlap_comm is raw["overlap_comm"]
        if stage == 3:
            assert ds.zero_config.offload_param.device == raw["offload_param"]

    hf = json.loads(files["hf"].read_text())
    args = TrainingArguments(**hf, output_dir=str(tmp_path / "o"))  # with a DeepSpeed file: checked
    assert args.per_device_train_batch_size == micro
    assert args.gradient_accumulation_steps == accum
    assert args.bf16 == (raw["precision"] == "bf16") and args.fp16 == (raw["precision"] == "fp16")
    assert args.max_grad_norm == 0.0
    assert bool(args.activation_checkpointing) == (_every(raw) is not None)
    if _every(raw) is not None:
        assert args.activation_checkpointing_kwargs["every_n_layers"] == _every(raw)
    assert (args.deepspeed is not None) == (stage is not None)

    companion = _companion(files["hf"])
    assert companion["model_kwargs"] == {"attn_implementation": raw["attention"]}
    assert companion["micro_batch_size"] == micro
    assert companion["gradient_accumulation_steps"] == accum
    assert companion["checkpoint_every_n_layers"] == _every(raw)

    acc = load_config_from_file(str(files["accelerate"]))  # accelerate's own loader
    assert acc.num_processes == 1 and acc.use_cpu is True
    if stage is not None:
        assert acc.distributed_type.value == "DEEPSPEED"
        named = json.loads(Path(acc.deepspeed_config["deepspeed_config_file"]).read_text())
        assert named == ds_dict  # the same DeepSpeed JSON, whichever format names it
    else:
        assert acc.distributed_type.value == "NO"
        assert acc.mixed_precision == {"fp32": "no"}.get(raw["precision"], raw["precision"])

    axo = yaml.safe_load(files["axolotl"].read_text())
    assert (axo["micro_batch_size"], axo["gradient_accumulation_steps"]) == (micro, accum)
    assert axo["attn_implementation"] == raw["attention"]
    assert axo["gradient_checkpointing"] is (_every(raw) is not None)

    argv = shlex.split(files["command"].read_text().splitlines()[-1])
    assert argv[-1] == "$@"
    script_at = argv.index("train.py")
    (cmd_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [*argv[script_at + 1 : -1], "--output_dir", str(tmp_path / "c")]
    )
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16"):
        assert getattr(cmd_args, key) == getattr(args, key), key
    assert cmd_args.max_grad_norm == 0.0
    assert cmd_args.activation_checkpointing_kwargs == args.activation_checkpointing_kwargs


# --- agreement: the consumers own consistency checks -------------------------------------------


@pytest.mark.parametrize("name", [n for n, w in WINNERS.items() if "zero_stage" in w])
def test_trainer_consistency_check_passes_and_fills_untuned(
    name: str, at_studies: Path, tmp_path: Path
) -> None:
    """transformers compares every DeepSpeed value it shares with TrainingArguments (batch,
    accumulation, clipping, precision, optimizer lr/weight decay) and refuses mismatches; what
    the study did not tune is "auto" and takes the Trainer's defaults."""

    files = export_all(tmp_path, name)
    hf = json.loads(files["hf"].read_text())
    filled = _trainer_checked(hf, tmp_path)
    assert filled["gradient_clipping"] == hf["max_grad_norm"] == 0.0
    assert filled["train_batch_size"] == GLOBAL_BATCH
    if "optimizer" in filled:
        assert filled["optimizer"]["params"]["lr"] == HF_DEFAULT_LR
        assert filled["optimizer"]["params"]["weight_decay"] == 0.0  # TrainingArguments' default
    # the check does refuse: without max_grad_norm the Trainer's default (1.0) would clip
    with pytest.raises(ValueError, match="gradient_clipping"):
        _trainer_checked({k: v for k, v in hf.items() if k != "max_grad_norm"}, tmp_path)


def _trainer_checked(hf: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """transformers' own DeepSpeed/TrainingArguments reconciliation, as ``Trainer`` runs it
    (fill "auto", then raise on any mismatch); returns the DeepSpeed config it would use."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    args = TrainingArguments(**hf, output_dir=str(tmp_path / "o"))
    hf_ds = args.hf_deepspeed_config
    hf_ds.trainer_config_process(args)
    hf_ds.trainer_config_finalize(args, LlamaForCausalLM(LlamaConfig(**TINY)), 10)
    return dict(hf_ds.config)


def test_user_flags_set_what_the_study_did_not_tune(at_studies: Path, tmp_path: Path) -> None:

    files = export_all(tmp_path, "zero2_offload_bf16", "--lr", "2e-4", "--weight-decay", "0.1")
    hf = json.loads(files["hf"].read_text())
    assert (hf["learning_rate"], hf["weight_decay"]) == (2e-4, 0.1)
    ds = json.loads(files["deepspeed"].read_text())
    assert ds["optimizer"]["params"]["lr"] == 2e-4
    assert ds["optimizer"]["params"]["weight_decay"] == 0.1
    assert _trainer_checked(hf, tmp_path)["optimizer"]["params"]["lr"] == 2e-4  # consistent
    assert yaml.safe_load(files["axolotl"].read_text())["learning_rate"] == 2e-4
    assert "--learning_rate 0.0002" in files["command"].read_text()


@pytest.mark.parametrize("name", list(WINNERS))
def test_no_value_the_study_did_not_decide(name: str, at_studies: Path, tmp_path: Path) -> None:
    """Neither the trials' learning rate nor any weight decay, scheduler or output dir."""
    files = export_all(tmp_path, name)
    written = sorted(tmp_path.iterdir())
    assert len(written) > len(files)  # the side files are checked too
    for path in written:
        text = path.read_text()
        for invented in (str(TRIAL_LR), "0.003", "3e-3", "lr_scheduler_type", "--output_dir"):
            assert invented not in text, (path, invented)
    hf = json.loads(files["hf"].read_text())
    assert not {"learning_rate", "weight_decay", "output_dir", "warmup_steps"} & set(hf)
    ds = json.loads(files["deepspeed"].read_text())
    assert "scheduler" not in ds
    if "optimizer" in ds:
        assert ds["optimizer"]["params"]["lr"] == "auto"
        assert ds["optimizer"]["params"]["weight_decay"] == "auto"
    axo = yaml.safe_load(files["axolotl"].read_text())
    assert "learning_rate" not in axo


# --- where it was measured --------------------------------------------------------------------


def test_cuda_study_exports_a_gpu_configuration(at_studies: Path, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    files = export_all(tmp_path, "on-cuda")
    hf = json.loads(files["hf"].read_text())
    assert "use_cpu" not in hf
    assert "--use_cpu" not in files["command"].read_text()
    acc = load_config_from_file(str(files["accelerate"]))
    assert acc.use_cpu is False
    ds = json.loads(files["deepspeed"].read_text())
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    for path in tmp_path.iterdir():
        assert "measured on CPU" not in path.read_text(), path
    assert _companion(files["hf"])["measured_on"] == "cuda"


def test_cpu_study_says_it_was_measured_on_cpu(at_studies: Path, tmp_path: Path) -> None:
    files = export_all(tmp_path, "zero2_offload_bf16")
    for fmt in ("accelerate", "axolotl", "command"):  # formats with comments say it inline
        assert "measured on CPU" in files[fmt].read_text(), fmt
    for path in files.values():  # and every export's companion file says it
        companion = _companion(path)
        assert companion["measured_on"] == "cpu" and "measured on CPU" in companion["note"]
    assert json.loads(files["hf"].read_text())["use_cpu"] is True
    result = cli("export", "--study", "zero1_bf16", "--format", "hf", "--out", "x.json")
    assert "measured on CPU" in result.output


# --- axolotl ---------------------------------------------------------------------------------

#: what the user's axolotl YAML adds to the exported training keys (axolotl requires each)
AXOLOTL_USER = {
    "base_model": "HuggingFaceTB/SmolLM2-135M",
    "datasets": [{"path": "mhenrichsen/alpaca_2k_test", "type": "alpaca"}],
    "output_dir": "./out",
    "num_epochs": 1,
    "learning_rate": 2e-5,
}


@pytest.mark.parametrize("name", list(WINNERS))
def test_axolotl_export_passes_axolotls_config_loader(
    name: str, at_studies: Path, tmp_path: Path
) -> None:
    """axolotl's own ``validate_config`` (installed without its CUDA dependencies, see
    scripts/install.sh) reads the exported keys merged into a user's config."""
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    raw = stored_winner(at_studies / "autotune.db", name)
    files = export_all(tmp_path, name)
    fragment = yaml.safe_load(files["axolotl"].read_text())
    cfg = validate_config(DictDefault({**AXOLOTL_USER, **fragment}))
    assert cfg["micro_batch_size"] == raw["micro_batch_size"]
    assert cfg["gradient_accumulation_steps"] == GLOBAL_BATCH // raw["micro_batch_size"]
    assert cfg["attn_implementation"] == raw["attention"]
    assert cfg["bf16"] is (raw["precision"] == "bf16") and cfg["max_grad_norm"] == 0.0
    assert cfg.get("deepspeed") == fragment.get("deepspeed")
    with pytest.raises(
        ValueError, match="learning_rate"
    ):  # the loader does check: lr is the user's
        validate_config(
            DictDefault({k: v for k, v in AXOLOTL_USER.items() if k != "learning_rate"} | fragment)
        )


# --- the consumers train ---------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the consumers import only the libraries, never autotune
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])


def _trainer_args(folder: Path, companion: Path) -> list[str]:
    return [
        "--output_dir", str(folder / "trainer-out"), "--max_steps", "2", "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0",
        "--model_config", str(folder / "tiny.json"), "--model_kwargs", str(companion),
        "--report", str(folder / "report.json"),
    ]  # fmt: skip


def _check_trained(report: dict[str, Any], raw: dict[str, Any]) -> None:
    """What the consumer ran, against the stored winner."""
    assert len(report["losses"]) >= 2 and all(math.isfinite(x) for x in report["losses"])
    assert report["attn_implementation"] == raw["attention"]
    every = _every(raw)
    if "checkpointed_layers" in report:
        n = len(report["checkpointed_layers"])
        assert report["checkpointed_layers"] == [
            every is not None and i % every == 0 for i in range(n)
        ]
    stage = raw.get("zero_stage")
    assert report["zero_stage"] == stage
    if stage is not None:
        ds = report["deepspeed"]
        assert ds["train_micro_batch_size_per_gpu"] == raw["micro_batch_size"]
        assert ds["gradient_accumulation_steps"] == GLOBAL_BATCH // raw["micro_batch_size"]
        assert ds["gradient_clipping"] == 0.0
        assert ds["bf16"]["enabled"] == (raw["precision"] == "bf16")
        offloaded = raw.get("offload_optimizer") == "cpu"
        assert report["optimizer"] == ("DeepSpeedCPUAdam" if offloaded else "AdamW")
    else:
        assert report["optimizer"] == "AdamW"


def _prepare(folder: Path) -> None:
    (folder / "tiny.json").write_text(json.dumps(TINY))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_offload", "zero2_offload_bf16", "plain_fp16"])
def test_hf_trainer_under_torchrun_trains(name: str, at_studies: Path, tmp_path: Path) -> None:
    """The exported TrainingArguments (JSON, merged with the user's own keys as HfArgumentParser
    reads a JSON file) and DeepSpeed file, in a plain Trainer script under torchrun."""
    _prepare(tmp_path)
    files = export_all(tmp_path, name)
    user = {  # what the user adds: where to write, how long, logging
        "output_dir": str(tmp_path / "trainer-out"), "max_steps": 2, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none",
        "model_config": str(tmp_path / "tiny.json"), "report": str(tmp_path / "report.json"),
        "model_kwargs": str(files["hf"].with_name(files["hf"].stem + ".autotune.json")),
    }  # fmt: skip
    merged = tmp_path / "train-args.json"
    merged.write_text(json.dumps({**json.loads(files["hf"].read_text()), **user}))
    script = str(CONSUMERS / "hf_trainer.py")
    _run(["torchrun", "--standalone", "--nproc_per_node", "1", script, str(merged)], tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    raw = stored_winner(at_studies / "autotune.db", name)
    _check_trained(report, raw)
    assert report["steps"] == 2
    assert report["max_grad_norm"] == 0.0 and report["learning_rate"] == HF_DEFAULT_LR
    assert report["fp16"] == (raw["precision"] == "fp16")
    assert report["per_device_train_batch_size"] == raw["micro_batch_size"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1_bf16", "plain_fp16"])
def test_accelerate_launch_trains_a_plain_loop(name: str, at_studies: Path, tmp_path: Path) -> None:
    _prepare(tmp_path)
    files = export_all(tmp_path, name)
    companion = files["accelerate"].with_name(files["accelerate"].stem + ".autotune.json")
    loop = str(CONSUMERS / "accelerate_loop.py")
    report_path = tmp_path / "report.json"
    _run(
        ["accelerate", "launch", "--config_file", str(files["accelerate"]), loop,
         str(tmp_path / "tiny.json"), str(companion), str(report_path)],
        tmp_path,
    )  # fmt: skip
    report = json.loads(report_path.read_text())
    raw = stored_winner(at_studies / "autotune.db", name)
    _check_trained(report, raw)
    precision = raw["precision"]
    assert report["mixed_precision"] == {"fp32": "no"}.get(precision, precision)
    # fp16 loss scaling is accelerate's: it makes a GradScaler on GPUs, not for CPU autocast
    assert report["scaler"] is (precision == "fp16" and report["device"] != "cpu")
    assert report["gradient_accumulation_steps"] == GLOBAL_BATCH // raw["micro_batch_size"]
    assert report["device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero0", "plain_bf16"])
def test_command_export_runs_a_stand_in_training_script(
    name: str, at_studies: Path, tmp_path: Path
) -> None:
    """The ``command`` script, run as written (``deepspeed`` or ``accelerate launch``), with a
    plain Trainer script as its ``train.py`` and the user's own flags after it."""
    _prepare(tmp_path)
    files = export_all(tmp_path, name)
    shutil.copy(CONSUMERS / "hf_trainer.py", tmp_path / "train.py")
    companion = files["command"].with_name(files["command"].stem + ".autotune.json")
    _run(["bash", str(files["command"]), *_trainer_args(tmp_path, companion)], tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    raw = stored_winner(at_studies / "autotune.db", name)
    _check_trained(report, raw)
    assert report["steps"] == 2 and report["bf16"] == (raw["precision"] == "bf16")
    assert report["gradient_accumulation_steps"] == GLOBAL_BATCH // raw["micro_batch_size"]
