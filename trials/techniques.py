"""Each search dimension as a table from its choices to what applying it means.

A trial config is a flat dict such as::

    {"gradient_checkpointing": "selective", "checkpoint_every": 2, "precision": "bf16",
     "attention": "sdpa", "optimizer": "adamw", "micro_batch_size": 2}

Adding a choice means adding a row here (and to a search space YAML), not an ``if`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# --- precision -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Mixed precision as autocast: fp32 master weights, 16-bit compute and activations."""

    autocast_dtype: torch.dtype | None
    loss_scaling: bool  # dynamic loss scaling (GradScaler), needed for fp16's narrow range
    lossy: bool


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(None, loss_scaling=False, lossy=False),
    "bf16": Precision(torch.bfloat16, loss_scaling=False, lossy=True),
    "fp16": Precision(torch.float16, loss_scaling=True, lossy=True),
}

# --- attention kernel --------------------------------------------------------------------------

#: search value -> transformers ``attn_implementation``; all are exact (same math).
ATTENTION: dict[str, str] = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash_attention_2",
}

# --- activation (gradient) checkpointing ------------------------------------------------------


def _checkpoint_every(k: int) -> Callable[[nn.Module, dict[str, Any]], None]:
    def apply(model: nn.Module, config: dict[str, Any]) -> None:
        every = k or int(config.get("checkpoint_every", 2))
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5
            enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every)
        else:  # pragma: no cover - older transformers, every layer only
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )

    return apply


def _no_checkpointing(model: nn.Module, config: dict[str, Any]) -> None:
    return None


#: ``selective`` checkpoints every ``checkpoint_every``-th decoder layer (0 = read it from config).
CHECKPOINTING: dict[str, Callable[[nn.Module, dict[str, Any]], None]] = {
    "off": _no_checkpointing,
    "full": _checkpoint_every(1),
    "selective": _checkpoint_every(0),
}

# --- optimizers --------------------------------------------------------------------------------

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]


def _adamw(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


#: Adafactor's step is relative to each parameter's RMS (Shazeer & Stern 2018): min(lr, 1/sqrt(t))
#: times RMS(param). The paper's (and torch's default) cap is 1e-2; AdamW's lr there would make
#: its steps several times smaller than intended, so it keeps its own.
ADAFACTOR_LR = 1e-2


def _adafactor(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=ADAFACTOR_LR, weight_decay=0.0)


def _lion(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    from lion_pytorch import Lion  # lucidrains' reference implementation of Chen et al. 2023

    # Lion's update has the magnitude of the sign, so its usual lr is 3-10x below AdamW's.
    return Lion(params, lr=lr / 3, weight_decay=0.0)


def _adamw_8bit(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    import bitsandbytes as bnb  # CUDA only; offered by the space only where available

    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.0)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class OptimizerChoice:
    factory: OptimizerFactory
    lossy: bool  # differs numerically from the AdamW reference
    hf_name: str  # TrainingArguments.optim
    state_bytes_per_param: float  # for the analytical estimator (fp32 states)


OPTIMIZERS: dict[str, OptimizerChoice] = {
    "adamw": OptimizerChoice(_adamw, lossy=False, hf_name="adamw_torch", state_bytes_per_param=8),
    "adafactor": OptimizerChoice(
        _adafactor, lossy=True, hf_name="adafactor", state_bytes_per_param=0
    ),
    "lion": OptimizerChoice(_lion, lossy=True, hf_name="lion_32bit", state_bytes_per_param=4),
    "adamw_8bit": OptimizerChoice(
        _adamw_8bit, lossy=True, hf_name="adamw_bnb_8bit", state_bytes_per_param=2
    ),
}


# --- fidelity classes ----------------------------------------------------------------------------

#: How far a configuration's training math is from plain fp32 AdamW full training, best first.
#: ``exact``: the same math up to float reordering (checkpointing, ZeRO, offload, attention
#: kernels, buckets, micro-batch/accumulation at a fixed global batch); ``mixed``: 16-bit compute
#: over fp32 master weights; ``reduced_state``: weights or optimizer state below fp32 (pure bf16,
#: 8-bit optimizer state); ``other_optimizer``: a different update rule (Adafactor, Lion);
#: ``adapters``: LoRA/QLoRA, a different training problem (the base weights stay frozen).
FIDELITY_CLASSES: tuple[str, ...] = (
    "exact",
    "mixed",
    "reduced_state",
    "other_optimizer",
    "adapters",
)

#: Per choice, the class it puts a configuration in (choices not listed are exact).
_FIDELITY_OF_CHOICE: dict[tuple[str, str], str] = {
    ("precision", "bf16"): "mixed",
    ("precision", "fp16"): "mixed",
    ("optimizer", "adamw_8bit"): "reduced_state",
    ("optimizer", "adafactor"): "other_optimizer",
    ("optimizer", "lion"): "other_optimizer",
    ("quantization", "int8"): "adapters",
    ("quantization", "nf4"): "adapters",
    ("quantization", "lora"): "adapters",
}


def fidelity_class(config: dict[str, Any]) -> str:
    """The worst (latest in ``FIDELITY_CLASSES``) class among the config's choices."""
    worst = 0
    for (dimension, choice), cls in _FIDELITY_OF_CHOICE.items():
        if str(config.get(dimension)) == choice:
            worst = max(worst, FIDELITY_CLASSES.index(cls))
    return FIDELITY_CLASSES[worst]


def is_exact(config: dict[str, Any]) -> bool:
    """True when the config only uses techniques that must reproduce the reference loss."""
    return fidelity_class(config) == "exact"


def classes_up_to(widest: str) -> tuple[str, ...]:
    """The classes a study searches under ``--allow widest``: ``widest`` and every class closer
    to exact (``exact`` alone, ``mixed`` = exact + mixed, ..., ``adapters`` = all)."""
    return FIDELITY_CLASSES[: FIDELITY_CLASSES.index(widest) + 1]


def choice_fidelity(dimension: str, choice: object) -> str:
    """The class one choice puts a configuration in (``exact`` when it changes no numerics)."""
    return _FIDELITY_OF_CHOICE.get((dimension, str(choice)), "exact")


#: the dimensions whose choices change the numbers a step computes (everything else is exact):
#: a loss probe is keyed by these choices alone
NUMERICS_DIMENSIONS: tuple[str, ...] = ("precision", "optimizer", "quantization")


def numerics_of(config: dict[str, Any]) -> dict[str, str]:
    """The config's numerics-changing choices, with the exact ones' defaults filled in."""
    plain = {"precision": "fp32", "optimizer": "adamw", "quantization": "none"}
    return {d: str(config.get(d, plain[d])) for d in NUMERICS_DIMENSIONS}
