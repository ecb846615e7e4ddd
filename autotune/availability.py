"""What this machine can run (``trials.hardware.Hardware``), applied to the techniques' choices:
each choice's requirements live with its technique (``trials.techniques``, ``Knob.requires``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

from trials.hardware import Hardware
from trials.techniques import TECHNIQUES
from trials.techniques.base import Choice

__all__ = [
    "Hardware",
    "detected_gpu_key",
    "dimension_unavailable_reason",
    "unavailable_reason",
]

T = TypeVar("T")


def dimension_unavailable_reason(hw: Hardware, dimension: str) -> str | None:
    """Why the whole dimension means nothing here (``Knob.requires_dimension``), or None."""
    knob = TECHNIQUES.knob(dimension)
    check = knob.requires_dimension if knob is not None else None
    return check(hw) if check else None


def unavailable_reason(
    hw: Hardware, dimension: str, choice: object, space_dimensions: Collection[str] = ()
) -> str | None:
    """Why ``dimension=choice`` can't run here (its technique's ``Knob.requires``, and
    ``requires_with`` when the space has that other dimension too), or None."""
    knob = TECHNIQUES.knob(dimension)
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


def detected_gpu_key(device: int = 0) -> str | None:
    """The estimator's row (``autotune.estimator.gpus``) of this machine's CUDA device, by the
    name its driver reports; None without CUDA or for a card no row lists."""
    import torch

    from autotune.estimator.gpus import gpu_for_device

    if not torch.cuda.is_available():
        return None
    gpu = gpu_for_device(torch.cuda.get_device_properties(device).name)
    return gpu.key if gpu else None
