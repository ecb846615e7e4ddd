import json
from pathlib import Path

import pytest

from autotune.errors import UserError
from autotune.models import MODELS, count_params, resolve_model


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama-7b", 6.74), ("llama-13b", 13.02), ("llama-70b", 68.98), ("mistral-7b", 7.24)],
)
def test_full_size_parameter_counts_match_published(name: str, billions: float) -> None:
    assert MODELS[name].n_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_small_models_same_architecture() -> None:
    tiny, small = MODELS["tiny-llama"], MODELS["small-llama"]
    assert tiny.config["model_type"] == small.config["model_type"] == "llama"
    assert 1e6 < tiny.n_params < 10e6
    assert 50e6 <= small.n_params <= 100e6


def test_count_params_matches_transformers() -> None:
    from trials.job import build_model

    model = build_model(MODELS["tiny-llama"].config, "sdpa", seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_params(MODELS["tiny-llama"].config)


def test_config_json_path(tmp_path: Path) -> None:
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps({**MODELS["tiny-llama"].config, "architectures": ["X"]}))
    entry = resolve_model(str(path))
    assert entry.name == "my-model"
    assert entry.config["hidden_size"] == 256
    assert "architectures" not in entry.config


def test_unknown_model_suggests_near_names() -> None:
    with pytest.raises(UserError, match="did you mean llama-7b"):
        resolve_model("lama-7b")


def test_config_json_that_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(UserError, match="not a causal-LM model config"):
        resolve_model(str(path))
