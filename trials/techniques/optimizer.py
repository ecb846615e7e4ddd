"""The optimizer: AdamW (the reference), or one with less state or another update rule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trials.hardware import needs_bitsandbytes, needs_torchao
from trials.techniques.base import Config, Forbid, Knob, Run, Technique
from trials.techniques.offload import offloads_optimizer
from trials.techniques.precision import STOCHASTIC_OPTIMIZERS, stochastic_rounding
from trials.techniques.zero import zero_stage

if TYPE_CHECKING:
    from trials.techniques.terms import SpeedStep

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


def _torchao_bits(bits: int, fallback: int = 8) -> StateBytes:
    """torchao's OptimState8bit/4bit: per moment ``bits`` per value (uint8 codes, two 4-bit
    codes a byte), one fp32 scale per block and its own fp32 code book (2^bits entries) where
    ``torchao_quantizes``; for the others two moments like the parameter (``fallback`` bytes a
    value: 8 for fp32 weights, 4 for bf16) (``subclass_8bit.py``, ``subclass_4bit.py``)."""
    block, qmap = TORCHAO_BLOCK[bits], 4 * 2**bits

    def state(shapes: Sequence[Shape]) -> int:
        total = 0
        for s in shapes:
            n = _numel(s)
            quantized = torchao_quantizes(n, bits)
            total += 2 * (n * bits // 8 + 4 * (n // block) + qmap) if quantized else fallback * n
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
    #: pure bf16 (bf16 weights, gradients and states): its state bytes (None: half of
    #: ``state_bytes``, every state made like its parameter) and the fp32 copies its eager step
    #: makes (None: ``step_copies`` in bf16, half the bytes: torch's optimizers compute in the
    #: parameter's dtype)
    pure_state_bytes: StateBytes | None = None
    pure_step_copies: float | None = None

    def step_temporaries(self, numel: int, cuda: bool, pure: bool = False) -> int:
        """Bytes of the temporaries its step makes for a tensor of ``numel`` values, on CUDA
        (``cuda``) or on the CPU backend; ``pure``: the tensor is bf16 (pure bf16)."""
        copies = self.step_copies
        if cuda and self.compiled_step_copies is not None:
            copies = self.compiled_step_copies
        elif pure:
            copies = self.pure_step_copies if self.pure_step_copies is not None else copies / 2
        return round(copies * 4 * numel)

    def states_of(self, shapes: Sequence[Shape], pure: bool = False) -> int:
        """State bytes for parameters of these shapes (``pure``: bf16 parameters)."""
        if not pure:
            return self.state_bytes(shapes)
        if self.pure_state_bytes is not None:
            return self.pure_state_bytes(shapes)
        return self.state_bytes(shapes) // 2


#: bits -> (eager, compiled) fp32 copies of the largest tensor torchao's step makes at once,
#: measured by the CPU allocator (``CpuMemoryMonitor.allocator_counted``) on one tensor of
#: 2,097,152 values with its states in place: eager, the dequantized moments, the update, their
#: intermediates and the new codes (in tiny-llama, whose largest tensor has that size, the
#: tracker and the allocator agree to the byte: 111,181,832 B for 8 bits); compiled by
#: inductor (as torchao's ``single_param_adam`` is on CUDA), the two moments in fp32 for 8 bits
#: and more for 4 bits, whose codes pack two to a byte (16,842,752 and 54,657,024 B)
TORCHAO_STEP_COPIES = {8: (13.25, 2.0), 4: (13.25, 6.5)}
#: the same, eager, over bf16 weights (pure bf16, with or without stochastic rounding: the same
#: peak): one fp32 copy of the weight more (measured on the same tensor in bf16: 14.254 and
#: 14.258 copies)
TORCHAO_PURE_STEP_COPIES = 14.25


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
        pure_state_bytes=_torchao_bits(bits, fallback=4),
        pure_step_copies=TORCHAO_PURE_STEP_COPIES,
    )


OPTIMIZERS: dict[str, OptimizerChoice] = {
    "adamw": OptimizerChoice(_adamw, lossy=False, hf_name="adamw_torch", state_bytes=_per_param(8)),
    "adafactor": OptimizerChoice(
        _adafactor, lossy=True, hf_name="adafactor", state_bytes=_factored
    ),
    "lion": OptimizerChoice(_lion, lossy=True, hf_name="lion_32bit", state_bytes=_per_param(4)),
    "adamw_8bit": OptimizerChoice(
        _adamw_8bit,
        lossy=True,
        hf_name="adamw_bnb_8bit",
        state_bytes=_bnb_8bit,
        pure_state_bytes=_bnb_8bit,
    ),
    "paged_adamw_8bit": OptimizerChoice(
        _paged_adamw_8bit,
        lossy=True,
        hf_name="paged_adamw_8bit",
        state_bytes=_bnb_8bit,
        pure_state_bytes=_bnb_8bit,  # its 32-bit states below 4096 values are fp32 always
    ),
    "adamw_torchao_8bit": _torchao_choice(8),
    "adamw_torchao_4bit": _torchao_choice(4),
}

#: optimizer choice -> DeepSpeed ``optimizer.type``; others are passed to DeepSpeed as a client
#: optimizer (the JSON then has no ``optimizer`` section) and cannot be offloaded.
DS_OPTIMIZERS: dict[str, str] = {"adamw": "AdamW"}
ADAM_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which the reference uses
ADAM_EPS = 1e-8


#: the roofline's optimizer step: bytes moved per parameter on the device: fp32 weight read and
#: written, its gradient read, the states read and written (8-bit: a byte per moment, 4-bit half
#: of it)
OPTIMIZER_STEP_BYTES = {
    "adamw": 28,
    "adafactor": 16,
    "lion": 20,
    "adamw_8bit": 16,
    "paged_adamw_8bit": 16,
    "adamw_torchao_8bit": 16,
    "adamw_torchao_4bit": 14,
}

#: launches per parameter tensor of the optimizer's step: torch's AdamW steps every tensor with
#: foreach kernels over the whole list (none per tensor) unless each tensor is stepped alone
#: (the step in backward: about 12 ops each, torch's single-tensor AdamW); bitsandbytes' 8-bit
#: optimizers run one kernel per tensor behind about 200 us of Python (``Optimizer8bit.step``:
#: the per-tensor config lookup, ``prefetch_state``, the ctypes call of
#: ``optimizer_update_8bit_blockwise`` with its argument checks): 20 launches' worth; torchao's
#: compiled per-tensor step about 3
TENSOR_STEP_OPS = {
    "adamw": 0,
    "adafactor": 0,
    "lion": 0,
    "adamw_8bit": 20,
    "paged_adamw_8bit": 20,
    "adamw_torchao_8bit": 3,
    "adamw_torchao_4bit": 3,
}
#: block-wise (de)quantisation of low-bit optimizer states in the step, as HBM-equivalent bytes
#: per parameter beyond the bytes the step moves: each moment's code looked up (dequantised to
#: fp32) and its new value searched in the 256-entry code book, with a block's absmax reduced
#: first (bitsandbytes' ``kOptimizerStatic8bit2StateBlockwise``): about the cost of moving the
#: two moments in fp32 once more (16 B) plus the block reductions (8 B); with the per-tensor
#: Python above, torchtune's Llama 3.2 3B table's +8-bit AdamW rung (7,309 -> 6,960 tokens/s,
#: 4.8% slower) comes out slower, where the bytes alone would make it faster. 4-bit (two codes
#: a byte, 128-value blocks) taken 1.25x the 8-bit cost (no published figure)
QUANT_STEP_BYTES = {
    "adamw_8bit": 24,
    "paged_adamw_8bit": 24,
    "adamw_torchao_8bit": 24,
    "adamw_torchao_4bit": 30,
}


def optimizer_of(config: Config) -> str:
    return str(config.get("optimizer", "adamw"))


#: torchao's ``_AdamW`` with ``bf16_stochastic_round`` over bf16 weights (``bf16_stochastic``
#: with AdamW): bf16 moments; its eager step (the CPU backend) computes in fp32 and draws the
#: rounding noise: 10.25 fp32 copies of the tensor at once (measured by the CPU tracker on one
#: bf16 tensor of 2,097,152 values, 85,983,232 B beyond its weight, gradient and states, the
#: same in a tiny-llama trial); compiled on CUDA (torchao's ``single_param_adam``) taken as
#: torchao's 8-bit step: two fp32 copies (not measured here)
STOCHASTIC_ADAMW = OptimizerChoice(
    _adamw,
    lossy=True,
    hf_name="adamw_torch",
    state_bytes=_per_param(8),
    step_copies=10.25,
    compiled_step_copies=2.0,
    pure_step_copies=10.25,
)


def step_choice(config: Config) -> OptimizerChoice:
    """The optimizer entry whose states and step temporaries the config's step has (torchao's
    AdamW under ``bf16_stochastic`` with AdamW)."""
    name = optimizer_of(config)
    if name == "adamw" and stochastic_rounding(config):
        return STOCHASTIC_ADAMW
    return OPTIMIZERS[name]


def optimizer_factory(config: Config) -> OptimizerFactory:
    """The config's optimizer; under ``master_weights: bf16_stochastic`` torchao's class of it
    with ``bf16_stochastic_round`` (fp32 math, the new bf16 weights rounded stochastically)."""
    name = optimizer_of(config)
    if not stochastic_rounding(config):
        return OPTIMIZERS[name].factory
    cls = STOCHASTIC_OPTIMIZERS.get(name)
    if cls is None:
        raise ValueError(
            f"{name} has no bf16 stochastic rounding (torchao's {', '.join(STOCHASTIC_OPTIMIZERS)}"
            " have)"
        )

    def make(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        from torchao import optim as ao

        return getattr(ao, cls)(  # type: ignore[no-any-return]
            params, lr=lr, weight_decay=0.0, bf16_stochastic_round=True
        )

    return make


def hand_back(ds_config: dict[str, Any], lr: float | str, weight_decay: float | str) -> None:
    """The DeepSpeed JSON's optimizer section (``Optimizer.deepspeed``) as an export gives it to
    the user: their learning rate and weight decay (or ``"auto"``), betas and eps left out so
    AdamW's defaults apply (the trial's, torch's and the Trainer's)."""
    section = ds_config.get("optimizer")
    if section is None:
        return  # a client optimizer: the training script makes it
    params = section["params"]
    for key in ("betas", "eps"):
        params.pop(key)
    params["lr"] = lr
    params["weight_decay"] = weight_decay


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
    forbids = (
        # not measured under ZeRO: stage 0 only
        Forbid(
            {
                "optimizer": ("paged_adamw_8bit", "adamw_torchao_8bit", "adamw_torchao_4bit"),
                "zero_stage": (1, 2, 3),
            },
            "torchao's and paged bitsandbytes' low-bit states are kept per parameter tensor; "
            "ZeRO hands a client optimizer its flat partitions instead",
        ),
    )

    def operators(self, step: SpeedStep) -> None:
        name = optimizer_of(step.config)
        step.step_bytes += OPTIMIZER_STEP_BYTES.get(name, 28) + QUANT_STEP_BYTES.get(name, 0)
        step.per_tensor_ops = TENSOR_STEP_OPS.get(name, 0)

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
