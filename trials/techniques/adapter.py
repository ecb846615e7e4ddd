"""LoRA and DoRA adapters on a 16-bit (or fp32) base (peft): the base weights frozen, in the
precision's 16-bit dtype under bf16/fp16 (fp32 otherwise), low-rank adapters of rank
``lora_rank`` trained on the attention projections or on every linear layer of the decoder
(``lora_targets``). DoRA (Liu et al. 2024) adds a trainable magnitude per output row of each
adapted layer and normalises the adapted weight by its column norms in every forward.

Trainable: 2 x rank x (in + out) per adapted layer (+ out for DoRA's magnitude); the adapters
train in fp32 (peft upcasts them over a 16-bit base) with the config's optimizer. The
``adapters`` class: a different training problem, judged apart by the loss guard.

``quantization: int8/nf4`` stays QLoRA (``trials.techniques.quantization``: rank 8 on every
linear layer); the space forbids an ``adapter`` beside it. Without peft the choices are
dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Forbid, Knob, Run, Technique, When

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.hardware import Hardware
    from trials.techniques.terms import SpeedStep, TraceStep

ADAPTERS = ("none", "lora", "dora")
LORA_RANKS = (4, 8, 16, 32, 64, 128)
#: ``lora_targets`` -> peft's ``target_modules``: a LLaMA-family decoder's attention projections,
#: or peft's "all-linear" (every linear layer but the output head)
TARGETS: dict[str, list[str] | str] = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all_linear": "all-linear",
}
#: the attention projections by name (torchtune's ``lora_attn_modules``)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_RANK = 8
DEFAULT_TARGETS = "all_linear"


def adapter_of(config: Config) -> str:
    return str(config.get("adapter", "none") or "none")


def adapts(config: Config) -> bool:
    return adapter_of(config) != "none"


def rank_of(config: Config) -> int:
    return int(config.get("lora_rank", DEFAULT_RANK))


def targets_of(config: Config) -> str:
    return str(config.get("lora_targets", DEFAULT_TARGETS))


def attention_only(config: Config) -> bool:
    """The adapters sit on the attention projections alone (the MLP's weights all frozen)."""
    return targets_of(config) == "attention"


def alpha_of(config: Config) -> int:
    """LoRA's alpha: twice the rank (the scale alpha / rank = 2, as QLoRA's 16 over 8)."""
    return 2 * rank_of(config)


def lora_kwargs(config: Config) -> dict[str, Any]:
    """peft's ``LoraConfig`` keyword arguments for the config's adapters (the job's and the
    peft/TRL export's)."""
    return {
        "r": rank_of(config),
        "lora_alpha": alpha_of(config),
        "lora_dropout": 0.0,  # dropout would make the loss depend on the RNG
        "target_modules": TARGETS[targets_of(config)],
        "use_dora": adapter_of(config) == "dora",
        "task_type": "CAUSAL_LM",
    }


def adapted_16bit(config: Config) -> bool:
    """Adapters over a 16-bit base (bf16/fp16 precision): the frozen model itself is 16-bit."""
    return adapts(config) and str(config.get("precision", "fp32")) in ("bf16", "fp16")


def adapted_shapes(
    layers: int, hidden: int, attention: tuple[int, int], mlp: int, config: Config
) -> tuple[list[tuple[int, int]], int]:
    """The (out, in) of every layer the config adapts, over ``layers`` LLaMA-family decoder
    layers (hidden size, (q width, k/v width), MLP width): q, k, v and o, and under
    ``all_linear`` gate, up and down; with the sum of their output widths."""
    q, kv = attention
    per_layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)]
    if targets_of(config) == "all_linear":
        per_layer += [(mlp, hidden), (mlp, hidden), (hidden, mlp)]
    shapes = per_layer * layers
    return shapes, sum(out for out, _ in shapes)


def freeze_base(step: SpeedStep) -> None:
    """A frozen base under adapters (LoRA, DoRA, QLoRA's): the matmuls compute no weight
    gradient, and the optimizer steps an A and a B of the config's rank per adapted linear
    (seven per layer)."""
    st = step.stats
    step.frozen = True
    step.trainable = (
        2 * rank_of(step.config) * (st.layers * (st.layer_matrix_params // max(1, st.hidden)) + 1)
    )
    step.tensors = 2 * st.layers * 7


def _needs_peft(hw: Hardware) -> str | None:
    return None if hw.has_peft else "peft is not installed (pip install peft)"


class Adapter(Technique):
    family = "adapter"
    untraced = ("adapter", "lora_rank", "lora_targets")  # by formula beside the trace
    knobs = (
        Knob(
            "adapter",
            ADAPTERS,
            baseline="none",
            fidelity={"lora": "adapters", "dora": "adapters"},
            requires={"lora": _needs_peft, "dora": _needs_peft},
            short=lambda v: "" if v == "none" else str(v),
        ),
        # a higher rank never needs less memory (more trainable parameters, states, activations)
        Knob("lora_rank", LORA_RANKS, memory_order=float, short=lambda v: f"r{v}"),
        Knob(
            "lora_targets",
            tuple(TARGETS),
            memory_order=lambda v: {"attention": 0.0, "all_linear": 1.0}[v],
            short=str,
        ),
    )
    whens = (
        When("lora_rank", {"adapter": ("lora", "dora")}, "the adapters' rank"),
        When("lora_targets", {"adapter": ("lora", "dora")}, "the layers the adapters wrap"),
        # the adapters train under the torch engine
        When("fsdp", {"adapter": "none"}, "FSDP2 shards the whole model, no adapters"),
        When("zero_stage", {"adapter": "none"}, "DeepSpeed trains the whole model, no adapters"),
    )
    forbids = (
        Forbid(
            {"adapter": ("lora", "dora"), "master_weights": ("bf16", "bf16_stochastic")},
            "the adapters train in fp32 over the frozen base: no pure bf16 adapters",
        ),
        Forbid({"adapter": ("lora", "dora"), "compile": True}, "the adapters train eagerly"),
        Forbid(
            {"quantization": ("int8", "nf4"), "adapter": ("lora", "dora")},
            "an adapter or QLoRA's quantized base (which has its own adapters), not both",
        ),
    )

    def model_in_16_bits(self, config: Config) -> bool:
        return adapted_16bit(config)  # the frozen base in 16 bits

    def operators(self, step: SpeedStep) -> None:
        if adapts(step.config):
            freeze_base(step)

    def traced_states(self, step: TraceStep) -> None:
        # the trace trained every weight of the frozen model: its step and the end of its
        # backward (every gradient, AdamW's temporaries) are not the adapters'. Its
        # activations and logits at the start of backward (before or at its first gradient
        # hook, or after it) beside the formula's states, the adapters' step being small
        if not adapts(step.config) or step.taken:
            return
        step.taken = True
        peak, breakdown = -1, {}
        for prefix in ("bwd:", "first_hook:", "hook:"):
            net, parts_at = step.net(prefix)
            if net > peak:
                peak, breakdown = net, parts_at
        step.peak = peak + sum(step.states.parts.values())
        step.breakdown = {k: breakdown.get(k, 0) for k in step.roles} | step.states.parts

    def traced_activations(self, step: TraceStep) -> None:
        # the trace trains the frozen model: what the adapters keep beside (or spare)
        if not adapts(step.config):
            return
        delta = step.formulas.adapter_activation_bytes(step.stats, step.config, step.tokens)
        if step.breakdown["activations"] > 0:
            delta = max(delta, -step.breakdown["activations"])
            step.breakdown["activations"] += delta
            step.peak += delta
        step.notes.append("adapters' activations added to the frozen model's trace by formula")

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        if not adapts(config):
            return model
        import torch
        from peft import LoraConfig, get_peft_model

        from trials.techniques.precision import PRECISIONS

        for p in model.parameters():
            p.requires_grad_(False)
        half = PRECISIONS[str(config.get("precision", "fp32"))].autocast_dtype
        if half is not None and any(p.dtype != half for p in model.parameters()):
            # the frozen base in 16 bits (autocast would cast it to the same per use); peft
            # keeps the adapters in fp32 (``autocast_adapter_dtype``)
            model.to(half)
        peft_model = get_peft_model(model, LoraConfig(**lora_kwargs(config)))  # type: ignore[arg-type]
        for p in peft_model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        return peft_model  # type: ignore[no-any-return]

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        if not adapts(config):
            return {}
        keys: dict[str, Any] = {
            "adapter": "lora",
            "lora_r": rank_of(config),
            "lora_alpha": alpha_of(config),
            "lora_dropout": 0.0,
            "peft_use_dora": adapter_of(config) == "dora",
        }
        if targets_of(config) == "all_linear":
            keys["lora_target_linear"] = True
        else:
            keys["lora_target_modules"] = list(ATTENTION_MODULES)
        return keys

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        if not adapts(config):
            return {}
        return {
            # peft.LoraConfig(**lora_config) (TRL's SFTTrainer takes it as peft_config)
            "lora_config": lora_kwargs(config),
            # a torchtune LoRA recipe's model keys (its lora_* builders)
            "torchtune": torchtune_keys(config),
        }


def torchtune_keys(config: Config) -> dict[str, Any]:
    """The model section's LoRA keys of a torchtune LoRA/DoRA recipe config
    (``torchtune.models.llama3_1.lora_llama3_1_8b``'s arguments)."""
    every = targets_of(config) == "all_linear"
    return {
        # torchtune names the attention's output projection output_proj
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"],
        "apply_lora_to_mlp": every,
        "apply_lora_to_output": False,
        "lora_rank": rank_of(config),
        "lora_alpha": alpha_of(config),
        "lora_dropout": 0.0,
        "use_dora": adapter_of(config) == "dora",
    }


TECHNIQUE = Adapter()
