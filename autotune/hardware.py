"""What this machine can run (``trials.hardware.Hardware``), applied to the techniques' choices:
each choice's requirements live with its technique (``trials.techniques``, ``Knob.requires``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

from trials.hardware import Hardware
from trials.techniques import REGISTRY
from trials.techniques.base import Choice

__all__ = [
    "Hardware",
    "detected_gpu_key",
    "dimension_unavailable_reason",
    "gpu_key_for",
    "unavailable_reason",
]

T = TypeVar("T")


def dimension_unavailable_reason(hw: Hardware, dimension: str) -> str | None:
    """Why the whole dimension means nothing here (``Knob.requires_dimension``), or None."""
    knob = REGISTRY.knob(dimension)
    check = knob.requires_dimension if knob is not None else None
    return check(hw) if check else None


def unavailable_reason(
    hw: Hardware, dimension: str, choice: object, space_dimensions: Collection[str] = ()
) -> str | None:
    """Why ``dimension=choice`` can't run here (its technique's ``Knob.requires``, and
    ``requires_with`` when the space has that other dimension too), or None."""
    knob = REGISTRY.knob(dimension)
    if knob is None:
        return None
    check = _lookup(knob.requires, choice)
    reason = check(hw) if check else None
    other, check_with = _lookup(knob.requires_with, choice) or ("", None)
    if reason is None and check_with is not None and other in space_dimensions:
        reason = check_with(hw)
    return reason


def _lookup(table: Mapping[Choice, T], choice: object) -> T | None:
    """``table[choice]``, or None."""
    return next((value for key, value in table.items() if key == choice), None)


def gpu_key_for(device_name: str, memory_bytes: int) -> str | None:
    """The estimator's spec (``autotune.estimator.gpus``) for a CUDA device, from the name
    ``torch.cuda.get_device_name`` reports and its memory: the known card whose model name is
    in the device's name (``NVIDIA H100 80GB HBM3`` -> ``h100``), of the closest memory size;
    None for a card the table does not know (the prior then stays nominal)."""
    import re

    from autotune.estimator.gpus import GPUS

    def words(text: str) -> list[str]:
        return re.findall(r"[a-z]+\d+[a-z]*|\d+[a-z]*", text.lower())

    name = device_name.lower()
    matches = [
        g
        for g in GPUS.values()
        if (model := next((w for w in words(g.name) if any(c.isdigit() for c in w)), None))
        and re.search(rf"\b{re.escape(model)}\b", name)
    ]
    if not matches:
        return None
    return min(matches, key=lambda g: abs(g.memory_bytes - memory_bytes)).key


def detected_gpu_key(device: int = 0) -> str | None:
    """``gpu_key_for`` this machine's CUDA device (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return gpu_key_for(props.name, int(props.total_memory))
