"""Mixed precision: 16-bit compute and activations over fp32 master weights (torch autocast; in
DeepSpeed its bf16/fp16 engine). fp16 needs dynamic loss scaling for its narrow range.

Pure bf16 (``master_weights: bf16``): weights, gradients and optimizer states in bf16, no fp32
master copy, on every engine: DeepSpeed ZeRO 1-3 through its ``bf16`` section's keys; the torch
engine and FSDP2 build the model in bf16 and train it without autocast, the optimizer's states
made like the parameters (bf16). ``bf16_stochastic`` is pure bf16 whose optimizer step computes
in fp32 and rounds the new weights to bf16 stochastically (torchao's AdamW
``bf16_stochastic_round``), so updates below bf16's resolution survive on average; it exists on
the torch engine with the optimizers ``STOCHASTIC_OPTIMIZERS`` names (the space's rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trials.hardware import needs_torchao
from trials.techniques.base import Config, Forbid, Knob, Run, Technique, When

if TYPE_CHECKING:
    from trials.hardware import Hardware
    from trials.techniques.terms import SpeedStep


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


def precision_of(config: Config) -> str:
    return str(config.get("precision", "fp32"))


def computes_in_16_bits(config: Config) -> bool:
    """bf16 or fp16 compute (autocast, or a 16-bit model)."""
    return PRECISIONS[precision_of(config)].autocast_dtype is not None


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype DeepSpeed trains the model's own weights in (its fp32 master copy apart)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


#: ``master_weights`` choices: fp32 masters (mixed precision), pure bf16, pure bf16 with
#: stochastic rounding in the optimizer's step
MASTER_WEIGHTS = ("fp32", "bf16", "bf16_stochastic")
#: optimizer -> torchao class whose ``bf16_stochastic_round`` gives ``bf16_stochastic`` (the
#: others have no stochastic rounding: the space forbids them with it)
STOCHASTIC_OPTIMIZERS = {
    "adamw": "_AdamW",
    "adamw_torchao_8bit": "AdamW8bit",
    "adamw_torchao_4bit": "AdamW4bit",
}

#: pure bf16 (no fp32 masters): the step reads and writes 16-bit weights and reads 16-bit
#: gradients, 3 x 2 bytes per parameter fewer than the optimizer's step moves over fp32 masters
PURE16_SAVED_BYTES = 6


def pure_bf16(config: Config) -> bool:
    """Whether weights, gradients and optimizer states are all kept in bf16 (no fp32 master)."""
    return precision_of(config) == "bf16" and str(config.get("master_weights", "fp32")) in (
        "bf16",
        "bf16_stochastic",
    )


def stochastic_rounding(config: Config) -> bool:
    """Pure bf16 whose optimizer rounds the updated weights to bf16 stochastically."""
    return pure_bf16(config) and str(config.get("master_weights")) == "bf16_stochastic"


def model_dtype(config: Config) -> torch.dtype:
    """The dtype the torch engine and FSDP2 build the model's weights in: bf16 in pure bf16, else
    fp32 (autocast and FSDP2's mixed-precision policy compute in 16 bits over them)."""
    return torch.bfloat16 if pure_bf16(config) else torch.float32


def pure_bf16_keys(config: Config) -> dict[str, bool]:
    """The DeepSpeed ``bf16`` section's keys for pure bf16 (DeepSpeed 0.19, ZeRO 1-3)."""
    if not pure_bf16(config) or stochastic_rounding(config):
        return {}
    return {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _bf16(hw: Hardware) -> str | None:
    if hw.backend == "cuda" and not hw.ampere_or_newer:
        return "bf16 needs an Ampere (SM80) or newer GPU"
    return None


def _deepspeed_fp16(hw: Hardware) -> str | None:
    if hw.backend == "cpu" and not hw.cpu_fp16:
        return "DeepSpeed has no fp16 on this CPU (no oneDNN fp16 kernels)"
    return None


class MixedPrecision(Technique):
    family = "precision"
    knobs = (
        Knob(
            "precision",
            tuple(PRECISIONS),
            baseline="fp32",
            short=str,
            fidelity={"bf16": "mixed", "fp16": "mixed"},
            # mixed precision over fp32 master weights tracks the fp32 loss closely
            # (Micikevicius et al. 2018): a regression seen with another lossy choice is
            # blamed on that first
            loss_prior=1.0,
            requires={"bf16": _bf16},
            # fp16 is fine in plain torch on any CPU, but every zero_stage runs DeepSpeed
            requires_with={"fp16": ("zero_stage", _deepspeed_fp16)},
        ),
        # Pure bf16: master weights, gradients and optimizer states in bf16 too (DeepSpeed
        # ZeRO 1-3: ``bf16_master_weights_and_grads``, ``bf16_optimizer_states``, the states on
        # the device; the torch engine and FSDP2: the model built in bf16, no autocast): 2 + 2 +
        # 4 bytes per parameter for AdamW instead of 4 + 4 + 8 (autocast) or 2 + 4 + 4 + 8
        # (DeepSpeed); updates below bf16's resolution are lost (stochastic rounding keeps them
        # on average), so the state class is reduced
        Knob(
            "master_weights",
            MASTER_WEIGHTS,
            baseline="fp32",
            short=lambda v: {"fp32": "", "bf16": "pure-bf16"}.get(v, "pure-bf16-sr"),
            fidelity={"bf16": "reduced_state", "bf16_stochastic": "reduced_state"},
            # bf16 states keep half the bytes; stochastic rounding's step makes fp32 temporaries
            memory_order=lambda v: {"bf16": 0.0, "bf16_stochastic": 0.5, "fp32": 1.0}[v],
            requires={"bf16_stochastic": needs_torchao},
            probe_needs={"bf16": {"zero_stage": 1}},
        ),
    )
    whens = (When("master_weights", {"precision": "bf16"}, "pure bf16 trains in bf16"),)
    forbids = (
        Forbid(
            {"offload_optimizer": "cpu", "master_weights": "bf16"},
            "pure bf16's states stay on the device: DeepSpeed's offloaded Adam keeps fp32 moments",
        ),
        Forbid(
            {"zero_stage": 0, "master_weights": ("bf16", "bf16_stochastic")},
            "DeepSpeed keeps bf16 master weights under ZeRO 1-3 only",
        ),
        Forbid(
            {"zero_stage": (1, 2, 3), "master_weights": "bf16_stochastic"},
            "stochastic rounding is torchao's step, which DeepSpeed does not run",
        ),
        Forbid(
            {"fsdp": ("full_shard", "shard_grad_op"), "master_weights": "bf16_stochastic"},
            "stochastic rounding is torchao's step, which FSDP2's DTensor shards do not run here",
        ),
        Forbid(
            {
                "optimizer": ("adafactor", "lion", "adamw_8bit", "paged_adamw_8bit"),
                "master_weights": "bf16_stochastic",
            },
            "stochastic rounding exists for AdamW and torchao's low-bit AdamW only "
            "(STOCHASTIC_OPTIMIZERS)",
        ),
    )

    def model_in_16_bits(self, config: Config) -> bool:
        return pure_bf16(config)  # built in bf16, trained without autocast

    def operators(self, step: SpeedStep) -> None:
        if pure_bf16(step.config):  # the weight read and written, its gradient read: 2 bytes
            step.step_bytes -= PURE16_SAVED_BYTES

    def speed(self, step: SpeedStep) -> None:
        # fp16's loss scaling unscales and checks every gradient (a frozen base has none)
        if PRECISIONS[precision_of(step.config)].loss_scaling and not step.frozen:
            step.optimizer_extra += 8 * step.stats.n_params / step.hbm

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        precision = precision_of(config)
        return {
            "bf16": {"enabled": precision == "bf16", **pure_bf16_keys(config)},
            "fp16": {
                "enabled": precision == "fp16",
                # dynamic loss scaling with torch.amp.GradScaler's defaults, which the plain
                # trial (and the Trainer without DeepSpeed) uses: start at 2**16, halve on the
                # first overflow, double after 2000 clean steps
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 2000,
                "hysteresis": 1,
                "min_loss_scale": 1,
            },
        }

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        precision = precision_of(config)
        return {"bf16": precision == "bf16", "fp16": precision == "fp16"}

    def accelerate(self, config: Config, run: Run) -> dict[str, Any]:
        precision = precision_of(config)
        return {"mixed_precision": {"fp32": "no"}.get(precision, precision)}

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        if pure_bf16(config) and "zero_stage" not in config:
            # the model loaded in bf16 and trained without autocast (axolotl's bfloat16)
            return {"bf16": False, "fp16": False, "bfloat16": True}
        return self.training_arguments(config, run)

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        if not pure_bf16(config) or "zero_stage" in config:
            return {}
        # pure bf16 outside DeepSpeed: a training script loads the model in bf16 (no autocast)
        # and, with stochastic rounding, steps torchao's optimizer with bf16_stochastic_round
        return {
            "model_dtype": "bfloat16",
            "autocast": False,
            "bf16_stochastic_round": stochastic_rounding(config),
        }


TECHNIQUE = MixedPrecision()
