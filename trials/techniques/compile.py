"""``torch.compile`` of the model's blocks: each decoder layer compiled once (dynamo traces one
layer and every other reuses the graph, as torchtune's ``compile_model`` does), the loss and
the optimizer left eager. Inductor fuses the element-wise chains (norms, SiLU, residual adds,
RoPE) into kernels that keep fewer intermediates for backward and read memory fewer times;
the math is the same up to float reordering (exact). The first steps pay the compilation
(``TrialResult.compile_s``, kept apart from the step time, which is measured after it).

On the CPU backend the memory tracker's dispatch mode would stop dynamo (it does not trace
under one) and inductor's buffers are allocated below the dispatcher, so a compiled trial's
steps are counted by the CPU allocator itself (``CpuMemoryMonitor.allocator_counted``); on
CUDA the caching allocator sees them as any other. Compiled blocks run under the torch engine
only (not DeepSpeed or FSDP2, whose hooks on the blocks dynamo would have to trace) and not
with quantized weights. On a CPU inductor needs a C++ compiler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Forbid, Knob, Run, Technique, When

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.hardware import Hardware
    from trials.techniques.terms import SpeedStep, TraceStep

#: of the operators a decoder layer launches, what a compiled layer still launches: the linears
#: and the attention kernel stay, each element-wise chain becomes one Triton kernel (inductor)
COMPILED_OPS = 0.35
#: reads + writes of the kept activations by compiled (fused) element-wise code: one read and
#: one write per fused chain; fitted to the published gains of compiling the model, 1.16-1.27x
#: (torchtune's Llama 3.2 3B memory table: +compile 7,075 -> 8,998 tokens/s, 1.27x)
COMPILED_ELEMENTWISE_PASSES = 1.5

COMPILE = "compile"


def compiles(config: Config) -> bool:
    return bool(config.get(COMPILE, False))


def _inductor(hw: Hardware) -> str | None:
    if hw.backend == "cpu" and not hw.has_cxx:
        return "inductor needs a C++ compiler on a CPU (apt install g++)"
    return None


def compile_blocks(model: nn.Module) -> nn.Module:
    """Each repeated block's ``forward`` compiled in place (names and state dict unchanged, so
    checkpointing, the exports and the loss see the same model). A compiled block runs compiled
    even under the CPU monitor's ``force_eager`` stance (which keeps what else compiles, such
    as torchao's optimizer step, eager as in every other trial): it sets the default stance for
    its own call."""
    import functools

    import torch

    from trials.techniques.fsdp import blocks

    for block in blocks(model):
        compiled = torch.compile(block.forward)

        @functools.wraps(block.forward)
        def forward(*args: Any, _compiled: Any = compiled, **kwargs: Any) -> Any:
            with torch.compiler.set_stance("default"):
                return _compiled(*args, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
    return model


class Compile(Technique):
    family = "compile"
    traced = False  # the fake step traces the eager model: the estimator's terms say the rest
    knobs = (
        Knob(
            COMPILE,
            (False, True),
            baseline=False,
            from_bool=(True, False),
            short=lambda v: "compiled" if v else "",
            requires={True: _inductor},
        ),
    )
    # torchao's low-bit AdamW compiles its own step (eager under the CPU tracker, counted as the
    # allocator counts it): no rule, it runs beside compiled blocks
    #: compiled layers run under the torch engine only
    whens = (
        When("fsdp", {COMPILE: False}, "FSDP2 wraps the eager layers"),
        When("zero_stage", {COMPILE: False}, "DeepSpeed wraps the eager layers"),
    )
    forbids = (
        Forbid(
            {"quantization": ("int8", "nf4"), COMPILE: True},
            "torch.compile does not trace bitsandbytes' quantized modules",
        ),
        # measured: 2.5x slower, no memory saved
        Forbid(
            {"activation_offload": "cpu", COMPILE: True},
            "activation offloading's saved-tensor hooks break the compiled graphs",
        ),
    )

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        return compile_blocks(model) if compiles(config) else model

    def kernels(self, step: SpeedStep) -> None:
        if compiles(step.config):
            step.elementwise_passes = COMPILED_ELEMENTWISE_PASSES
            step.ops_factor = COMPILED_OPS

    def traced_activations(self, step: TraceStep) -> None:
        # fake tensors run the layers eagerly: what the compiled layers do not keep is the
        # analytical model's difference (measured with saved-tensor hooks on a compiled one)
        if not compiles(step.config):
            return
        eager = step.analytical_peak({**step.config, COMPILE: False})
        saving = eager - step.analytical_peak(step.config)
        cut = max(0, min(saving, step.breakdown["activations"]))
        step.breakdown["activations"] -= cut
        step.peak -= cut
        step.notes.append(
            f"compiled layers traced eagerly; the analytical saving taken off ({cut} B)"
        )

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        # the Trainer compiles the whole model (``model = torch.compile(model)``) with inductor
        return {"torch_compile": True} if compiles(config) else {}

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return {"torch_compile": True} if compiles(config) else {}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {"compile": "each decoder layer (nn.Module.compile)" if compiles(config) else None}


TECHNIQUE = Compile()
