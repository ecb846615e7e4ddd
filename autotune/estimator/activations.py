"""Bytes a decoder layer keeps for backward, per micro-batch: shared by the memory estimate
(what is live at the peak) and the speed model (what memory-bound ops read and write)."""

from __future__ import annotations

from typing import Any

from autotune.estimator.states import (
    adapted_16bit,
    adapter_shapes,
    model_in_16_bits,
    pure_outside_deepspeed,
)
from autotune.models import ModelStats
from trials.techniques.attention import saves_attention_probs
from trials.techniques.checkpointing import saved_ops
from trials.techniques.compile import compiles
from trials.techniques.precision import computes_in_16_bits
from trials.techniques.quantization import quantizes


def layer_activation_bytes(
    st: ModelStats, config: dict[str, Any], seq_len: int, micro: int, cuda: bool = True
) -> int:
    """Bytes one decoder layer keeps for backward (no checkpointing).

    The MLP keeps four ``I``-wide tensors when gated (gate, up, act(gate), product), two
    otherwise (the up projection and its activation); an MoE layer runs ``top_k`` experts per
    token (balanced routing) and keeps its router logits. ``cuda``: on a GPU a dropout keeps a
    1-byte mask; on the CPU (the CPU trial backend) its mask is in the input's dtype.
    """
    h, d = st.hidden, st.head_dim
    q, kvw = st.heads * d, st.kv_heads * d
    tokens = seq_len * micro
    saved = (4 if st.gated_mlp else 2) + ACT_EXTRA_SAVED.get(st.hidden_act, 0)
    mlp_w = saved * st.intermediate * max(1, st.top_k)
    half = computes_in_16_bits(config)
    pure16 = model_in_16_bits(config)
    # DeepSpeed (and pure bf16) run the model in 16 bits: only the norms upcast (fitted to traces)
    if pure16:
        per_token = 15 * h + 2 * (3 * q + 2 * kvw) + 2 * mlp_w
    elif half:
        per_token = 24 * h + 4 * h + 2 * (3 * q + 2 * kvw) + 2 * mlp_w
    else:
        per_token = 4 * (6 * h + 3 * q + 2 * kvw + mlp_w)
    # the layouts the formula above was not fitted on (llama's) differ by what they keep
    # (measured with saved-tensor hooks, tests/test_estimator_activation_oracle.py)
    mode = "pure16" if pure16 else "autocast" if half else "fp32"
    norm_bytes = NORM_BYTES[st.norm][mode] * h
    per_token += st.norms * norm_bytes - 2 * NORM_BYTES["rms"][mode] * h
    if st.shared_norm_input:  # parallel residual: one input for both norms
        per_token -= NORM_INPUT_BYTES[mode] * h
    if st.qk_norm:
        per_token += NORM_BYTES["rms"]["pure16" if half else "fp32"] * (q + kvw)
    if mode == "autocast":  # each projection casts its own copy of its input: fused ones once
        per_token -= 2 * h * (3 - st.qkv_projections + 2 - st.mlp_in_projections)
    eager = saves_attention_probs(config)
    if st.qkv_projections == 1 and not eager:
        # q, k, v as views of one fused output: without rotary q keeps all of it alive and the
        # CPU's attention kernel copies k and v; with it v keeps it (q and k are rewritten).
        # Eager attention's batched matmuls copy all three, as the formula counts.
        per_token += (2 if half else 4) * (q + kvw if st.rotary else 2 * kvw)
    if st.experts:
        per_token += 4 * 2 * st.experts + 4 * h  # router logits and softmax, routed copy
        if _fp32_experts(config):
            per_token += 2 * mlp_w
    per_token -= compiled_saving(st, config)
    mask = dropout_mask_bytes(2 if half else 4, cuda)
    if st.resid_dropout > 0:  # two residual dropouts: a mask each (the residual add keeps none)
        per_token += 2 * mask * h
    total = per_token * tokens
    scores = micro * st.heads * seq_len * seq_len
    if not eager and not cuda and st.attn_dropout > 0:
        # The CPU's sdpa has no kernel with dropout: its math path (16-bit q, k, v upcast to
        # fp32) keeps the fp32 softmax, the dropout's noise and its output per score, and no
        # log-sum-exp; the q-wide terms as measured on GPT-2's fused q/k/v (to the byte at three
        # shapes, tests/test_estimator_activation_oracle.py). A GPU's kernels fuse the dropout.
        total += 12 * scores - 4 * st.heads * tokens + (2 if half else -8) * q * tokens
    if eager:
        # the softmax in fp32 and its 16-bit copy (a 16-bit model's plain softmax: one copy)
        cast_copy = half and (st.softmax_fp32 or mode == "autocast")
        total += (4 if not half else 6 if cast_copy else 2) * scores
        if kvw < q:  # grouped-query heads: repeat_kv copies k and v to every query head
            total += (2 if half else 4) * 2 * (q - kvw) * tokens
        if st.attn_softcap:  # tanh(scores / cap) keeps its output
            total += (2 if half else 4) * scores
        if st.attn_dropout > 0:
            # dropout on the probabilities keeps its mask, and its output where the next matmul
            # would otherwise have kept the softmax's own output (a 16-bit copy it replaces)
            total += (mask + (0 if cast_copy else 2 if half else 4)) * scores
    return total


def compiled_saving(st: ModelStats, config: dict[str, Any]) -> int:
    """Bytes per token a compiled layer (``trials.techniques.compile``) does not keep that the
    eager one does: AOTAutograd's partitioner recomputes the cheap element-wise results in
    backward (the residual after attention, the norms' outputs, SiLU(gate)) where eager
    autograd saves them, and inductor fuses autocast's casts. For the LLaMA layer (RMSNorm,
    gated SiLU MLP, three projections, no dropout), measured with saved-tensor hooks on a
    compiled layer: fp32 two h-wide and one I-wide tensor (``4 (2h + I)``); under autocast three
    fp32 and two 16-bit h-wide, one 16-bit I-wide (``16h + 2I``), with sdpa and eager attention
    alike; a 16-bit model (pure bf16, DeepSpeed's) ``8h + 2I`` (the norms' fp32 upcasts and
    the 16-bit residual, normalised copy and SiLU(gate)). Other layouts are counted as eager
    (0: an over-estimate).
    """
    llama = (
        st.norm == "rms"
        and st.gated_mlp
        and st.hidden_act == "silu"
        and not st.experts
        and st.resid_dropout == 0
        and st.attn_dropout == 0
        and st.qkv_projections == 3
        and st.mlp_in_projections == 2
        and not st.qk_norm
        and not st.shared_norm_input
    )
    if not compiles(config) or not llama:
        return 0
    h, i = st.hidden, st.intermediate
    if model_in_16_bits(config):  # adapters' layers were not measured: counted as eager
        return 8 * h + 2 * i if pure_outside_deepspeed(config) and not adapted_16bit(config) else 0
    autocast = computes_in_16_bits(config)
    return 16 * h + 2 * i if autocast else 4 * (2 * h + i)


def dropout_mask_bytes(width: int, cuda: bool) -> int:
    """Bytes per element a dropout keeps for backward: CUDA's fused ``native_dropout`` a bool
    mask; the CPU's ``dropout`` (no fused kernel) multiplies by a noise tensor of the input's
    dtype and keeps that."""
    return 1 if cuda else width


def _fp32_experts(config: dict[str, Any]) -> bool:
    """Under autocast over fp32 weights an MoE layer's experts compute in fp32: their grouped
    matmul (``aten._grouped_mm``, transformers 5) has no autocast rule on CPU or CUDA. DeepSpeed's
    model and a quantized model's base are 16-bit."""
    autocast = computes_in_16_bits(config) and not model_in_16_bits(config)
    return autocast and not quantizes(config)


#: bytes per hidden unit one norm keeps per token: llama's RMSNorm its input and the normalised
#: copy (the input in fp32, the copy in the model's dtype), Gemma's both in fp32, a LayerNorm its
#: input only (fp32 under autocast: the residual stream stays fp32)
NORM_BYTES = {
    "rms": {"fp32": 8, "autocast": 8, "pure16": 6},
    "rms_fp32": {"fp32": 8, "autocast": 8, "pure16": 8},
    "layer": {"fp32": 4, "autocast": 4, "pure16": 2},
}
NORM_INPUT_BYTES = {"fp32": 4, "autocast": 4, "pure16": 2}

#: I-wide tensors an activation keeps beyond its input and output: GPT-2's ``gelu_new`` is
#: written out in Python (tanh, 0.5x and 1 + tanh are saved for backward)
ACT_EXTRA_SAVED = {"gelu_new": 3}


def saved_op_bytes(st: ModelStats, config: dict[str, Any], seq_len: int, micro: int) -> int:
    """Bytes a checkpointed layer keeps besides its input under ``checkpoint_save``: the
    attention kernel's output (and its fp32 log-sum-exp per head), and with ``matmuls`` every
    projection's output too (q, k, v, o; gate and up, or up alone, per routed expert; down; the
    router's logits)."""
    save = saved_ops(config)
    if save == "none":
        return 0
    half = computes_in_16_bits(config)
    width = 2 if half else 4
    q, kvw = st.heads * st.head_dim, st.kv_heads * st.head_dim
    per_token = width * q + 4 * st.heads
    if save == "matmuls":
        mlp = ((2 if st.gated_mlp else 1) * st.intermediate + st.hidden) * max(1, st.top_k)
        per_token += width * (q + 2 * kvw + st.hidden + mlp + st.experts)  # and router logits
        if st.experts and _fp32_experts(config):
            per_token += 2 * mlp
    return per_token * seq_len * micro


#: DoRA's bytes per adapted output feature per token kept for backward beyond LoRA's, under
#: a 16-bit base: peft's ``DoraLinearLayer.forward`` keeps the base layer's output and the
#: adapter's (16-bit, 2 + 2) to scale them by the magnitude over the weight's norm; that fp32
#: scale promotes the layer's output to fp32, which the ops after it keep (measured: 6.49 B on
#: tiny-llama, every linear adapted, bf16); under fp32, the two outputs (4 + 4)
DORA_BYTES = {True: 6.5, False: 8.0}


def adapter_activation_bytes(st: ModelStats, config: dict[str, Any], tokens: int) -> int:
    """How much more (or less) LoRA/DoRA adapters keep for backward than full training of the
    model's layers, over every layer: each adapter's rank-wide A output (B's input, in the
    compute dtype) and, for DoRA, ``DORA_BYTES`` per adapted output feature; less what frozen
    weights' gradients would have needed: with attention-only adapters the MLP's output
    projection's input (its weight frozen, nothing reads it in backward), and in fp32 each
    norm's normalised input (its frozen scale needs no gradient; in 16 bits the fitted norm
    terms stand)."""
    from trials.techniques.adapter import adapter_of, attention_only, rank_of

    shapes, outputs = adapter_shapes(st, config)
    half = computes_in_16_bits(config)
    width = 2 if half else 4
    adapted = sum(1 for s in shapes if len(s) == 2) // 2
    total = adapted * rank_of(config) * width * tokens
    if adapter_of(config) == "dora":
        total += int(DORA_BYTES[half] * outputs * tokens)
    if attention_only(config):
        total -= st.layers * width * st.intermediate * max(1, st.top_k) * tokens
    if not half:
        total -= st.layers * st.norms * 4 * st.hidden * tokens
    return total
