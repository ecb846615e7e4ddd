"""Quantized training: the base model's linear layers in 8 or 4 bits (bitsandbytes, CUDA only),
frozen, with trainable LoRA adapters on top (peft), i.e. LoRA / QLoRA fine-tuning.

``quantization: none`` trains every weight in full precision (no adapters). The space offers
``int8`` and ``nf4`` only where ``autotune.availability`` finds CUDA, bitsandbytes and peft.
``add_lora`` is the part that runs anywhere; the tests run it on a tiny model on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trials.hardware import needs_bitsandbytes
from trials.techniques.adapter import freeze_base
from trials.techniques.base import Config, Forbid, Knob, Run, Technique

if TYPE_CHECKING:
    from trials.hardware import Hardware
    from trials.techniques.terms import SpeedStep, TraceStep

#: LoRA on every linear layer but the output head (QLoRA's recipe, Dettmers et al. 2023)
LORA_RANK = 8
LORA_ALPHA = 16
#: stored bytes per quantized base weight, as ``_int8_linear``/``_nf4_linear`` make them
#: (bitsandbytes: int8 at 1 B plus an fp32 scale per output row, ``ROW_SCALE_BYTES``, LLM.int8();
#: nf4 at 4 bits in blocks of 64 with double quantization, ``Params4bit``'s default
#: ``compress_statistics``: each block's absmax in 8 bits, and an fp32 absmax per 256 blocks,
#: 4.127 bits, the QLoRA paper's figure, section 3); the analytical estimator's terms
WEIGHT_BYTES = {"int8": 1.0, "nf4": (4 + 8 / 64 + 32 / (64 * 256)) / 8}
ROW_SCALE_BYTES = {"int8": 4, "nf4": 0}
#: bytes per weight the roofline's dequantisation pass reads (any other base: 1)
DEQUANT_READ_BYTES = {"int8": 1.0, "nf4": 0.53}


def add_lora(model: nn.Module, rank: int = LORA_RANK, alpha: int = LORA_ALPHA) -> nn.Module:
    """Freeze ``model`` and add trainable LoRA adapters to its linear layers (peft)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,  # dropout would make the loss depend on the RNG, not the technique
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)  # type: ignore[arg-type]


def _int8_linear(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    q = bnb.nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=6.0,
    )
    q.weight = bnb.nn.Int8Params(
        linear.weight.data.cpu(), requires_grad=False, has_fp16_weights=False
    )
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.cpu(), requires_grad=False)
    return q  # quantized when moved to the GPU


def _nf4_linear(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.bfloat16,
        quant_type="nf4",
    )
    q.weight = bnb.nn.Params4bit(linear.weight.data.cpu(), requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.cpu(), requires_grad=False)
    return q


def replace_linears(
    model: nn.Module, make: Callable[[nn.Linear], nn.Module], skip: tuple[str, ...] = ("lm_head",)
) -> int:
    """Swap every linear layer (except ``skip``) for ``make(linear)``; return how many. GPT-2's
    ``Conv1D`` (transformers' linear layer with the weight stored transposed) is one too."""
    found = _linears(model, skip)
    for module, name, linear in found:
        setattr(module, name, make(linear))
    return len(found)


def linear_shapes(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[int, int]]:
    """(out, in) of every layer ``replace_linears`` swaps: what QLoRA quantizes and adapts. Not
    an MoE's experts, which transformers 5 keeps in 3-D tensors, nor its router: bitsandbytes'
    conversion replaces ``nn.Linear`` modules only and leaves them in full precision
    (bitsandbytes issue #1849), as the job does."""
    return [(linear.out_features, linear.in_features) for _, _, linear in _linears(model, skip)]


def _linears(model: nn.Module, skip: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Linear]]:
    found = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            linear = None if name in skip else as_linear(child)
            if linear is not None:
                found.append((module, name, linear))
    return found


def as_linear(module: nn.Module) -> nn.Linear | None:
    """``module`` as an ``nn.Linear`` computing the same thing, or None if it is no linear layer:
    a ``Conv1D`` (``x @ W + b``, ``W`` stored (in, out)) becomes the linear layer of ``W.T``."""
    if isinstance(module, nn.Linear):
        return module
    if type(module).__name__ != "Conv1D":
        return None
    w, bias = module.weight, module.bias
    assert isinstance(w, torch.Tensor)
    n_in, n_out = int(w.shape[0]), int(w.shape[1])
    linear = nn.Linear(n_in, n_out, bias=bias is not None, device=w.device, dtype=w.dtype)
    linear.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
    if isinstance(bias, torch.Tensor):
        linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    return linear


def _quantized(
    make: Callable[[nn.Linear], nn.Module],
) -> Callable[[nn.Module, torch.device], nn.Module]:
    def apply(model: nn.Module, device: torch.device) -> nn.Module:
        for p in model.parameters():
            p.requires_grad_(False)
        replace_linears(model, make)
        return add_lora(model.to(device))

    return apply


def quantization_of(config: Config) -> str:
    """The base's quantization (``none``: full precision)."""
    return str(config.get("quantization") or "none")


def quantizes(config: Config) -> bool:
    """A quantized frozen base (int8 or nf4) with LoRA adapters."""
    return str(config.get("quantization") or "none") != "none"


def builds_on_host(config: Config) -> bool:
    """Quantized runs build the full-precision model in host memory: bitsandbytes quantizes the
    weights as they move to the GPU, so the device never holds a full-precision copy."""
    return str(config.get("quantization", "none")) != "none"


def _full_precision(model: nn.Module, device: torch.device) -> nn.Module:
    return model


QUANTIZATION: dict[str, Callable[[nn.Module, torch.device], nn.Module]] = {
    "none": _full_precision,
    "int8": _quantized(_int8_linear),
    "nf4": _quantized(_nf4_linear),
}


def _quantized_needs(hw: Hardware) -> str | None:
    reason = needs_bitsandbytes(hw)
    if reason is None and not hw.has_peft:
        return "peft is not installed"
    return reason


#: ``quantization`` choice -> axolotl's ``adapter`` and its quantized-base-weight keys
AXOLOTL_QUANTIZATION: dict[str, tuple[str | None, dict[str, bool]]] = {
    "none": (None, {"load_in_4bit": False}),
    "int8": ("lora", {"load_in_8bit": True, "load_in_4bit": False}),
    "nf4": ("qlora", {"load_in_4bit": True}),
}
#: the trial's LoRA recipe (``add_lora``) in axolotl's keys
AXOLOTL_LORA = {
    "lora_r": LORA_RANK,
    "lora_alpha": LORA_ALPHA,
    "lora_dropout": 0.0,
    "lora_target_linear": True,
}


class Quantization(Technique):
    family = "quantization"
    untraced = ("quantization",)  # by formula beside the trace
    knobs = (
        Knob(
            "quantization",
            tuple(QUANTIZATION),
            baseline="none",
            # "lora" (full-precision base weights with adapters) is the estimator's
            fidelity={"int8": "adapters", "nf4": "adapters", "lora": "adapters"},
            requires={"int8": _quantized_needs, "nf4": _quantized_needs},
            short=lambda v: "" if v == "none" else f"{v}+lora",
        ),
    )
    forbids = (
        Forbid(
            {"quantization": ("int8", "nf4"), "master_weights": ("bf16", "bf16_stochastic")},
            "a quantized base is frozen: its adapters train in fp32, no pure bf16",
        ),
        Forbid(
            {"quantization": ("int8", "nf4"), "zero_stage": 3},
            "ZeRO-3 does not partition bitsandbytes' quantized weights",
        ),
    )

    def operators(self, step: SpeedStep) -> None:
        # the weights dequantised to 16 bits before every use, forward and backward (a
        # memory-bound pass over the linears', not the experts', each time: read and write),
        # which the matmuls then read; the base frozen under its adapters
        quant = str(step.config.get("quantization", "none"))
        if quant == "none":
            return
        qbytes = DEQUANT_READ_BYTES.get(quant, 1.0)
        step.weight_bytes = 2
        step.dequant = 2 * (qbytes + 2) * step.stats.linear_params / step.hbm
        freeze_base(step)

    def traced_activations(self, step: TraceStep) -> None:
        # the trace trains the base weights, so autocast kept 16-bit copies of them; frozen
        # quantized weights are dequantized per use instead
        if not step.states.frozen_copies:
            return
        cut = min(step.states.frozen_copies, step.breakdown["activations"])
        step.breakdown["activations"] -= cut
        step.peak -= cut
        step.notes.append("16-bit copies of the (frozen, quantized) base weights removed")

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        return QUANTIZATION[str(config.get("quantization", "none"))](model, device)

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        adapter, quantized = AXOLOTL_QUANTIZATION[str(config.get("quantization", "none"))]
        if adapter is None:
            return dict(quantized)
        return {**quantized, "adapter": adapter, **AXOLOTL_LORA}


TECHNIQUE = Quantization()
