"""The attention kernel: transformers' ``attn_implementation``; all are exact (same math)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique

if TYPE_CHECKING:
    from trials.hardware import Hardware
    from trials.techniques.terms import SpeedStep

#: search value -> transformers ``attn_implementation``
ATTENTION: dict[str, str] = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash_attention_2",
}

#: fused attention kernels' efficiency relative to the GEMMs (FlashAttention-2 reaches about the
#: GEMM efficiency on A100/H100; sdpa's CUDA path dispatches to the same flash kernels)
#: given a mask sdpa falls back to the memory-efficient (xformers/cutlass) kernel, about half
#: FlashAttention-2's speed (Dao 2023, FlashAttention-2, figure 4: 2x over xformers' cutlass
#: kernel on A100)
FLASH_EFFICIENCY = {"flash_attention_2": 1.0, "sdpa": 0.9, "sdpa_masked": 0.5}


def attn_implementation(config: Config) -> str:
    """The ``attn_implementation`` the config's model is built with (the job builds it so)."""
    return ATTENTION[str(config.get("attention", "sdpa"))]


def saves_attention_probs(config: Config) -> bool:
    """The eager kernel: the softmax's probabilities kept for backward (the fused ones keep
    only their output and log-sum-exp)."""
    return attn_implementation(config) == "eager"


def _flash_attn(hw: Hardware) -> str | None:
    if hw.backend != "cuda":
        return "needs a CUDA GPU"
    if not hw.ampere_or_newer:
        return f"needs SM80+ (this GPU is SM{''.join(map(str, hw.cuda_capability or ()))})"
    if not hw.has_flash_attn:
        return "flash_attn is not installed (pip install 'autotune[gpu]')"
    return None


class Attention(Technique):
    family = "attention"
    knobs = (
        Knob(
            "attention",
            tuple(ATTENTION),
            baseline="sdpa",
            probe_plain=True,  # the loss probe's kernel: the reference's
            short=str,
            requires={"flash_attention_2": _flash_attn},
        ),
    )

    def operators(self, step: SpeedStep) -> None:
        # fused kernels: the causal half skipped, backward recomputes the scores (2.5x the
        # forward); sdpa given a mask (packed or padded rows) runs the memory-efficient kernel.
        # Eager attention is the plain math the roofline starts from
        kernel = str(step.config.get("attention", "sdpa"))
        if kernel == "eager":
            return
        if kernel == "sdpa" and step.documents:
            kernel = "sdpa_masked"
        step.attn_fwd = step.attn_flops / 2 / (step.peak * FLASH_EFFICIENCY.get(kernel, 1.0))
        step.attn_bwd = 2.5 * step.attn_fwd

    # the job applies it when it builds the model (``trials.build``: the kernel is a
    # construction argument), not on the built model

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        # keyword arguments of AutoModelForCausalLM.from_pretrained / from_config
        return {"model_kwargs": {"attn_implementation": attn_implementation(config)}}

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return {"attn_implementation": attn_implementation(config)}  # axolotl >= 0.19's key


TECHNIQUE = Attention()
