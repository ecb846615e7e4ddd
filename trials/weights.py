"""Pretrained weights into a model built the way its engine trains it.

The model is made as for random weights (``trials.build``: no initialisation, in the engine's
dtype and place, under ZeRO-3's ``zero.Init`` partitioned as it is made), then each module's
own parameters are read from the folder's safetensors, one tensor at a time, memory-mapped, and
copied in (cast to the parameter's dtype; under ZeRO-3 gathered for the copy, one module at a
time, as transformers' ``from_pretrained`` does for ZeRO-3). Construction memory is therefore
the trained model's, never a second full copy. A model built with fewer layers than the
checkpoint (a probe's slice) takes the first layers' weights.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

SINGLE_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(folder: str | Path) -> list[Path]:
    """The folder's safetensors files: the index's shards, or the single file; [] if none."""
    root = Path(folder)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / name for name in shards]
    single = root / SINGLE_FILE
    return [single] if single.is_file() else []


def checkpoint_keys(folder: str | Path) -> dict[str, Path]:
    """Every tensor name in the folder's safetensors (their headers only) and its file."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                where[key] = f
    return where


def load_weights(
    model: nn.Module,
    folder: str | Path,
    gather: Callable[[list[nn.Parameter]], ContextManager[Any]] | None = None,
) -> None:
    """Copy the checkpoint's tensors into ``model``'s parameters (see the module docstring).
    A parameter the checkpoint lacks is an error (tied weights are loaded once)."""
    from safetensors import safe_open

    where = checkpoint_keys(folder)
    if not where:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    loaded: set[int] = set()
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for f in set(where.values())
        }
        for name, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in loaded]
            if not own:
                continue
            with gather([p for _, p in own]) if gather is not None else contextlib.nullcontext():
                for pname, param in own:
                    key = f"{name}.{pname}" if name else pname
                    if key not in where:
                        raise KeyError(f"the checkpoint in {folder} has no tensor {key}")
                    tensor = handles[where[key]].get_tensor(key)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"{key}: the checkpoint's shape {tuple(tensor.shape)} is not the "
                            f"model's {tuple(param.shape)}"
                        )
                    param.copy_(tensor.to(param.dtype))
                    loaded.add(id(param))
                    del tensor
