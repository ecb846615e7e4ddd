"""Activation (gradient) checkpointing: recompute a decoder layer's activations in backward
instead of keeping them. ``full`` checkpoints every layer, ``selective`` every
``checkpoint_every``-th one; exact (the same math), less memory, more compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique

if TYPE_CHECKING:
    import torch
    from torch import nn


def _checkpoint_every(k: int) -> Callable[[nn.Module, Config], None]:
    def apply(model: nn.Module, config: Config) -> None:
        every = k or int(config.get("checkpoint_every", 2))
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5
            enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every)
        else:  # pragma: no cover - older transformers, every layer only
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

    return apply


def _no_checkpointing(model: nn.Module, config: Config) -> None:
    return None


#: ``selective`` checkpoints every ``checkpoint_every``-th decoder layer (0 = read it from config).
CHECKPOINTING: dict[str, Callable[[nn.Module, Config], None]] = {
    "off": _no_checkpointing,
    "full": _checkpoint_every(1),
    "selective": _checkpoint_every(0),
}


def every_n_layers(config: Config) -> int | None:
    """Checkpointing as transformers' ``every_n_layers`` (None: off), as the trial applies it."""
    ckpt = str(config.get("gradient_checkpointing", "off"))
    if ckpt == "off":
        return None
    return 1 if ckpt == "full" else int(config.get("checkpoint_every", 2))


class Checkpointing(Technique):
    family = "checkpointing"
    traced = True
    knobs = (
        Knob(
            "gradient_checkpointing",
            tuple(CHECKPOINTING),
            baseline="off",
            from_bool=("full", "off"),
            short=lambda v: {"off": "", "full": "ckpt", "selective": "ckpt/sel"}[v],
            # more layers checkpointed, fewer activations kept
            memory_order=lambda v: {"full": 0.0, "selective": 1.0, "off": 2.0}[v],
        ),
        Knob(
            "checkpoint_every", None, short=lambda v: f"k={v}"
        ),  # selective's k (a positive integer)
    )

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        CHECKPOINTING[str(config.get("gradient_checkpointing", "off"))](model, config)
        return model

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        every = every_n_layers(config)
        if every is None:
            return {}
        return {  # the trial's checkpointing, every layer or every k-th
            "activation_checkpointing": True,
            "activation_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": every},
        }

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        # axolotl checkpoints every layer: selective exports as full
        return {"gradient_checkpointing": every_n_layers(config) is not None}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {"checkpoint_every_n_layers": every_n_layers(config)}


TECHNIQUE = Checkpointing()
