"""``--model`` as a Hugging Face model folder or a cached Hub id: its pretrained weights reach
every engine as transformers' own ``from_pretrained`` loads them; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.errors import UserError
from autotune.model_source import model_folder, tokenizer_folder
from autotune.models import resolve_model
from tests.conftest import tiny_spec
from trials.job import rank_batches, run_trial

PRETRAINED = Path(__file__).parent / "data" / "pretrained-llama"


def _reference_loss(spec: Any) -> float:
    """The first step's loss of transformers' own from_pretrained model on the trial's batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(PRETRAINED, dtype=torch.float32)
    batches = rank_batches(spec, 0, 0, 1)
    with torch.no_grad():
        return sum(float(b.scaled(model(**b.inputs()).loss)) for b in batches)


def _spec(config: dict[str, Any], weights: str | None = str(PRETRAINED)) -> Any:
    entry = resolve_model(str(PRETRAINED))
    spec = tiny_spec({"micro_batch_size": 4, **config}, seq_len=32, weights=weights)
    spec.model_config = entry.config
    spec.measured_steps = 1
    spec.warmup_steps = 1
    return spec


def test_a_model_folder_resolves_to_its_config_and_weights() -> None:
    from transformers import AutoModelForCausalLM

    entry = resolve_model(str(PRETRAINED))
    assert entry.weights == str(PRETRAINED.resolve()) and entry.name == "pretrained-llama"
    loaded = AutoModelForCausalLM.from_pretrained(PRETRAINED)
    assert entry.n_params == loaded.num_parameters()


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"zero_stage": 3, "reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000},
        {"fsdp": "full_shard"},
    ],
    ids=["torch", "zero3", "fsdp2"],
)
def test_a_trial_starts_from_the_pretrained_weights(config: dict[str, Any]) -> None:
    spec = _spec(config)
    result = run_trial(spec)
    assert result.status == "ok", result.error
    assert result.losses[0] == pytest.approx(_reference_loss(spec), rel=1e-5)
    random = run_trial(_spec(config, weights=None))
    assert random.losses[0] > 2 * result.losses[0]  # the checkpoint knows the task
    # loading reads one tensor at a time into the built model: construction holds the model
    # and at most one checkpoint tensor beside it (the largest: the 512 x 64 fp32 embedding)
    one_tensor = 512 * 64 * 4
    # ZeRO-3's set-up gathers the parameters one by one, and whether a 64 x 64 matrix's gather is
    # still alive at the peak varies from run to run (either way, weights or not)
    gather = 64 * 64 * 4 if config.get("zero_stage") == 3 else 0
    built = random.construction_peak_bytes
    assert built - gather <= result.construction_peak_bytes <= built + one_tensor


def test_a_cached_hub_id_resolves_without_a_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(PRETRAINED, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    entry = resolve_model("someone/tiny")
    assert entry.name == "someone/tiny" and entry.weights == str(snap)
    with pytest.raises(UserError, match=r"not in the local Hugging Face cache \(.*hub\)"):
        resolve_model("someone/absent")
    assert sorted(p.name for p in cache.iterdir()) == ["models--someone--tiny"]  # nothing fetched


def test_what_is_missing_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no model folder or config\.json at \./nowhere/model"):
        model_folder("./nowhere/model")
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        model_folder(str(bare))
    shutil.copy(PRETRAINED / "config.json", bare / "config.json")
    with pytest.raises(UserError, match=r"no safetensors weights: looked for model\.safetensors"):
        resolve_model(str(bare))
    with pytest.raises(UserError, match=r"no tokenizer in model folder \S+: looked for tokenizer"):
        tokenizer_folder(str(PRETRAINED))
    other = json.loads((PRETRAINED / "config.json").read_text())
    other["num_hidden_layers"] = 3  # a config the checkpoint does not fit
    (bare / "config.json").write_text(json.dumps(other))
    shutil.copy(PRETRAINED / "model.safetensors", bare / "model.safetensors")
    with pytest.raises(UserError, match=r"lack \d+ of the model's tensors \(e.g. model.layers.2"):
        resolve_model(str(bare))


def test_a_study_on_a_model_folder_keeps_its_lr_and_exports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import optuna
    import yaml

    from autotune.study import settings_of
    from tests.conftest import DATA, NO_PROBES, cli

    monkeypatch.chdir(tmp_path)
    space = str(DATA / "tiny_space.yaml")
    run = ["run", "--model", str(PRETRAINED), "--budget", "1GB", "--space", space]
    run += ["--seq-len", "32", "--global-batch-size", "8", *NO_PROBES, "--trials", "1"]
    first = cli(*run, "--lr", "2e-5")
    assert first.exit_code == 0, first.output
    study = optuna.load_study(study_name=None, storage="sqlite:///autotune.db")
    settings = settings_of(study)
    given = (settings.lr, settings.user_lr, settings.weights)
    assert given == (2e-5, 2e-5, str(PRETRAINED.resolve()))
    reference = study.trials[0].user_attrs["losses"]
    spec = settings.spec(study.trials[0].user_attrs["config"], None)
    assert reference[0] == pytest.approx(_reference_loss(spec), rel=1e-5)  # from the checkpoint
    other = cli(*run, "--lr", "1e-4")
    assert other.exit_code == 2 and "has user_lr=2e-05, not 0.0001 (--lr)" in other.output
    resumed = cli("resume", "--study", study.study_name, "--trials", "1")
    assert resumed.exit_code == 0, resumed.output
    study = optuna.load_study(study_name=None, storage="sqlite:///autotune.db")
    assert settings_of(study).user_lr == 2e-5 and len(study.trials) == 2
    # the resumed trial started from the checkpoint too (bf16 compute or not: within 1%)
    assert study.trials[1].user_attrs["losses"][0] == pytest.approx(reference[0], rel=1e-2)
    for fmt, name in [("deepspeed", "ds.json"), ("hf", "hf.json"), ("axolotl", "ax.yaml")]:
        assert cli("export", "--format", fmt, "--out", name).exit_code == 0
    assert json.loads(Path("hf.json").read_text())["learning_rate"] == 2e-5
    assert yaml.safe_load(Path("ax.yaml").read_text())["learning_rate"] == 2e-5
    assert "learning_rate" not in Path("ax.yaml").read_text().splitlines()[2]  # not "left to"
    side = json.loads(Path("hf.autotune.json").read_text())
    assert side["learning_rate"] == 2e-5 and side["model_folder"] == str(PRETRAINED.resolve())
    ds = json.loads(Path("ds.json").read_text())
    assert ds["optimizer"]["params"]["lr"] == 2e-5


@pytest.mark.parametrize(
    ("model", "line"),
    [
        ("./nowhere/model", "no model folder or config.json at ./nowhere/model"),
        ("someone/absent", "'someone/absent': no such folder here, and not in the local Hugging"),
    ],
)
def test_a_missing_model_is_one_line_and_exit_2(
    model: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = cli("run", "--model", model, "--budget", "1GB")
    assert result.exit_code == 2 and line in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "hub").exists() and not (tmp_path / "autotune.db").exists()
