"""The optimizer: AdamW (the reference), or one with less state or another update rule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trials.hardware import needs_bitsandbytes, needs_torchao
from trials.techniques.base import Config, Knob, Run, Technique
from trials.techniques.offload import offloads_optimizer
from trials.techniques.zero import zero_stage

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


def _paged_adamw_8bit(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    import bitsandbytes as bnb  # CUDA only: states in unified memory, paged out under pressure

    return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=0.0)  # type: ignore[no-any-return]


def _torchao(name: str) -> OptimizerFactory:
    """torchao's low-bit AdamW (``torchao.optim``): both moments quantized block-wise."""

    def make(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        from torchao import optim as ao

        return getattr(ao, name)(params, lr=lr, weight_decay=0.0)  # type: ignore[no-any-return]

    return make


Shape = tuple[int, ...]
#: parameter shapes -> the optimizer's state bytes for them (the estimator's term)
StateBytes = Callable[[Sequence[Shape]], int]


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _per_param(nbytes: float) -> StateBytes:
    return lambda shapes: int(nbytes * sum(_numel(s) for s in shapes))


def _factored(shapes: Sequence[Shape]) -> int:
    """Adafactor's factored second moment: a row and a column vector per matrix (fp32)."""
    return sum(4 * (s[-2] + s[-1]) if len(s) >= 2 else 4 * _numel(s) for s in shapes)


def _bnb_8bit(shapes: Sequence[Shape]) -> int:
    """bitsandbytes: two 8-bit states (and an fp32 absmax per 256) from 4096 values, fp32
    below."""
    return sum(
        2 * _numel(s) + 8 * ((_numel(s) + 255) // 256) if _numel(s) >= 4096 else 8 * _numel(s)
        for s in shapes
    )


#: torchao's block size per bit width (``AdamW8bit``'s and ``AdamW4bit``'s ``block_size``)
TORCHAO_BLOCK = {8: 256, 4: 128}


def torchao_quantizes(numel: int, bits: int) -> bool:
    """Whether torchao keeps a tensor's moments quantized: at least 4096 values, a whole number
    of blocks (``torchao/optim/adam.py``); fp32 moments otherwise."""
    return numel >= 4096 and numel % TORCHAO_BLOCK[bits] == 0


def _torchao_bits(bits: int) -> StateBytes:
    """torchao's OptimState8bit/4bit: per moment ``bits`` per value (uint8 codes, two 4-bit
    codes a byte), one fp32 scale per block and its own fp32 code book (2^bits entries) where
    ``torchao_quantizes``; fp32 moments for the others (``subclass_8bit.py``,
    ``subclass_4bit.py``)."""
    block, qmap = TORCHAO_BLOCK[bits], 4 * 2**bits

    def state(shapes: Sequence[Shape]) -> int:
        total = 0
        for s in shapes:
            n = _numel(s)
            quantized = torchao_quantizes(n, bits)
            total += 2 * (n * bits // 8 + 4 * (n // block) + qmap) if quantized else 8 * n
        return total

    return state


@dataclass(frozen=True)
class OptimizerChoice:
    factory: OptimizerFactory
    lossy: bool  # differs numerically from the AdamW reference
    hf_name: str  # TrainingArguments.optim
    state_bytes: StateBytes  # for the estimators (step counters ignored)
    #: fp32 copies of a tensor its step makes at once (the estimators' step temporaries, for
    #: the largest tensor): torch's single-tensor AdamW 2
    step_copies: float = 2.0
    #: the same where the step is compiled (torchao's on CUDA; on the CPU backend it runs
    #: eagerly under the tracker): None, the same as eager
    compiled_step_copies: float | None = None

    def step_temporaries(self, numel: int, cuda: bool) -> int:
        """Bytes of the temporaries its step makes for a tensor of ``numel`` values, on CUDA
        (``cuda``) or on the CPU backend."""
        copies = self.step_copies
        if cuda and self.compiled_step_copies is not None:
            copies = self.compiled_step_copies
        return round(copies * 4 * numel)


#: bits -> (eager, compiled) fp32 copies of the largest tensor torchao's step makes at once,
#: measured by the CPU allocator (``CpuMemoryMonitor.allocator_counted``) on one tensor of
#: 2,097,152 values with its states in place: eager, the dequantized moments, the update, their
#: intermediates and the new codes (in tiny-llama, whose largest tensor has that size, the
#: tracker and the allocator agree to the byte: 111,181,832 B for 8 bits); compiled by
#: inductor (as torchao's ``single_param_adam`` is on CUDA), the two moments in fp32 for 8 bits
#: and more for 4 bits, whose codes pack two to a byte (16,842,752 and 54,657,024 B)
TORCHAO_STEP_COPIES = {8: (13.25, 2.0), 4: (13.25, 6.5)}


def _torchao_choice(bits: int) -> OptimizerChoice:
    """torchao's ``AdamW{bits}bit`` (transformers' ``adamw_torch_{bits}bit``)."""
    eager, compiled = TORCHAO_STEP_COPIES[bits]
    return OptimizerChoice(
        _torchao(f"AdamW{bits}bit"),
        lossy=True,
        hf_name=f"adamw_torch_{bits}bit",
        state_bytes=_torchao_bits(bits),
        step_copies=eager,
        compiled_step_copies=compiled,
    )


OPTIMIZERS: dict[str, OptimizerChoice] = {
    "adamw": OptimizerChoice(_adamw, lossy=False, hf_name="adamw_torch", state_bytes=_per_param(8)),
    "adafactor": OptimizerChoice(
        _adafactor, lossy=True, hf_name="adafactor", state_bytes=_factored
    ),
    "lion": OptimizerChoice(_lion, lossy=True, hf_name="lion_32bit", state_bytes=_per_param(4)),
    "adamw_8bit": OptimizerChoice(
        _adamw_8bit, lossy=True, hf_name="adamw_bnb_8bit", state_bytes=_bnb_8bit
    ),
    "paged_adamw_8bit": OptimizerChoice(
        _paged_adamw_8bit, lossy=True, hf_name="paged_adamw_8bit", state_bytes=_bnb_8bit
    ),
    "adamw_torchao_8bit": _torchao_choice(8),
    "adamw_torchao_4bit": _torchao_choice(4),
}

#: optimizer choice -> DeepSpeed ``optimizer.type``; others are passed to DeepSpeed as a client
#: optimizer (the JSON then has no ``optimizer`` section) and cannot be offloaded.
DS_OPTIMIZERS: dict[str, str] = {"adamw": "AdamW"}
ADAM_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which the reference uses
ADAM_EPS = 1e-8


def optimizer_of(config: Config) -> str:
    return str(config.get("optimizer", "adamw"))


class Optimizer(Technique):
    family = "optimizer"
    knobs = (
        Knob(
            "optimizer",
            tuple(OPTIMIZERS),
            baseline="adamw",
            short=str,
            fidelity={
                "adamw_8bit": "reduced_state",
                "paged_adamw_8bit": "reduced_state",
                "adamw_torchao_8bit": "reduced_state",
                "adamw_torchao_4bit": "reduced_state",
                "adafactor": "other_optimizer",
                "lion": "other_optimizer",
            },
            requires={
                "adamw_8bit": needs_bitsandbytes,
                "paged_adamw_8bit": needs_bitsandbytes,
                "adamw_torchao_8bit": needs_torchao,
                "adamw_torchao_4bit": needs_torchao,
            },
        ),
    )

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        """DeepSpeed's own AdamW where it has one (``torch_adam``: it then builds
        ``torch.optim.AdamW`` itself, the reference's optimizer, unless offloaded, where it
        insists on DeepSpeedCPUAdam); other optimizers are passed in as client optimizers."""
        optimizer = optimizer_of(config)
        if optimizer in DS_OPTIMIZERS:
            params: dict[str, Any] = {
                "lr": run.lr,
                "betas": list(ADAM_BETAS),
                "eps": ADAM_EPS,
                "weight_decay": 0.0,
            }
            if not offloads_optimizer(config):
                params["torch_adam"] = True
            return {"optimizer": {"type": DS_OPTIMIZERS[optimizer], "params": params}}
        if zero_stage(config) > 0:
            return {"zero_allow_untested_optimizer": True}
        return {}

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        return {"optim": OPTIMIZERS[optimizer_of(config)].hf_name}

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return {"optimizer": OPTIMIZERS[optimizer_of(config)].hf_name}


TECHNIQUE = Optimizer()
