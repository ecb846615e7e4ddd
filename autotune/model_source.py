"""Where a model's files are: a local Hugging Face model folder, or a Hub id already in the local
Hugging Face cache. Nothing is ever downloaded: the cache is read with ``local_files_only``.

A model folder holds ``config.json`` and its weights as safetensors (``model.safetensors``, or
shards named by ``model.safetensors.index.json``); the tokenizer files sit beside them when the
data needs one (``tokenizer_folder``). ``model_source`` is the one place other code asks where a
study's model lives.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from autotune.errors import UserError
from trials.weights import SAFETENSORS_INDEX, SINGLE_FILE, checkpoint_keys, weight_files

#: what a Hub model id looks like (``owner/name``), as huggingface_hub accepts it
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
#: files that make a tokenizer (any one of them, with or beside tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def hub_cache() -> Path:
    """The local Hugging Face hub cache (``HF_HUB_CACHE``, ``HF_HOME``/hub, or the default),
    read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "/"))


def _cached_folder(repo_id: str) -> Path | None:
    """The cached snapshot holding ``repo_id``'s config.json, or None (never a network call)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache())
    except Exception:  # an id huggingface_hub refuses
        return None
    return Path(found).parent if isinstance(found, str) else None


def model_folder(name_or_path: str) -> Path | None:
    """The model folder ``name_or_path`` names: a local folder holding config.json, or a Hub id's
    cached snapshot; None when it names neither (a registered model, a config.json file).
    Raises ``UserError`` (one line) when it looks like one but is not there."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json":  # a config.json file (autotune.models)
        return None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model folder {name_or_path} has no config.json")
        return path.resolve()
    if path.exists():
        return None
    if looks_like_hub_id(name_or_path):
        cached = _cached_folder(name_or_path)
        if cached is None:
            raise UserError(
                f"model '{name_or_path}': no such folder here, and not in the local Hugging Face "
                f"cache ({hub_cache()}); nothing is downloaded: fetch it first "
                f"(hf download {name_or_path}) or give its folder"
            )
        return cached
    if name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path:
        raise UserError(f"no model folder or config.json at {name_or_path}")
    return None


def check_weights(folder: Path, shown: str, config: dict[str, Any]) -> None:
    """The folder's safetensors hold every weight of the model its config builds (read from the
    files' headers); one line otherwise."""
    files = weight_files(folder)
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        found = f" (found {', '.join(other[:3])}: pickled weights are not loaded)" if other else ""
        raise UserError(
            f"model folder {shown} has no safetensors weights: looked for {SINGLE_FILE} and "
            f"{SAFETENSORS_INDEX} in {folder}{found}"
        )
    missing = sorted(set(expected_keys(config)) - set(checkpoint_keys(folder)))
    if missing:
        raise UserError(
            f"model folder {shown}: its weights lack {len(missing)} of the model's tensors "
            f"(e.g. {missing[0]}); they are not the checkpoint of its config.json"
        )


def expected_keys(config: dict[str, Any]) -> list[str]:
    """The tensor names the model built from ``config`` loads (tied weights once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    built = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(built)
    return [name for name, _ in model.named_parameters()]


def model_source(model: str, weights: str | None = None) -> Path | None:
    """The folder a study's model is loaded from (``StudySettings.weights``, else resolved from
    ``--model``), or None for a registered model or a bare config.json."""
    if weights:
        return Path(weights)
    return model_folder(model)


def tokenizer_folder(model: str, weights: str | None = None) -> Path:
    """The model's folder when it holds a tokenizer; else one line saying what was looked for
    and where."""
    folder = model_source(model, weights)
    if folder is None:
        raise UserError(
            f"model '{model}' has no tokenizer: it is not a model folder or a cached Hub model; "
            "give --model a folder with the tokenizer files"
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"no tokenizer in model folder {folder}: looked for {', '.join(TOKENIZER_FILES)}"
        )
    return folder


def folder_identity(folder: str | Path) -> str:
    """What names a folder's weights for caches: its path and its weight files' sizes and times
    (a retrained checkpoint in the same folder is another model)."""
    parts = [str(folder)]  # the path as stored with the study
    for f in weight_files(folder):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return json.dumps(parts)


def model_settings(weights: str | None, lr: float | None) -> dict[str, Any]:
    """The study settings ``--model`` and ``--lr`` give: the weights' folder, and the user's
    learning rate (the trials', the probes' and every export's) when given."""
    given: dict[str, Any] = {"weights": weights}
    if lr is not None:
        given.update(lr=lr, user_lr=lr)
    return given
