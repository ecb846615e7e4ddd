"""Bytes a decoder layer keeps for backward, per micro-batch: shared by the memory estimate
(what is live at the peak) and the speed model (what memory-bound ops read and write)."""

from __future__ import annotations

from typing import Any

from autotune.estimator.states import deepspeed_states
from autotune.models import ModelStats
from trials.techniques.checkpointing import saved_ops


def layer_activation_bytes(st: ModelStats, config: dict[str, Any], seq_len: int, micro: int) -> int:
    """Bytes one decoder layer keeps for backward (no checkpointing).

    The MLP keeps four ``I``-wide tensors when gated (gate, up, act(gate), product), two
    otherwise (the up projection and its activation); an MoE layer runs ``top_k`` experts per
    token (balanced routing) and keeps its router logits.
    """
    h, d = st.hidden, st.head_dim
    q, kvw = st.heads * d, st.kv_heads * d
    tokens = seq_len * micro
    saved = (4 if st.gated_mlp else 2) + ACT_EXTRA_SAVED.get(st.hidden_act, 0)
    mlp_w = saved * st.intermediate * max(1, st.top_k)
    half = config.get("precision", "fp32") in ("bf16", "fp16")
    pure16 = half and deepspeed_states(config)
    if pure16:  # DeepSpeed runs the model in 16 bits: only the norms upcast (fitted to traces)
        per_token = 15 * h + 2 * (3 * q + 2 * kvw) + 2 * mlp_w
    elif half:
        per_token = 24 * h + 4 * h + 2 * (3 * q + 2 * kvw) + 2 * mlp_w
    else:
        per_token = 4 * (6 * h + 3 * q + 2 * kvw + mlp_w)
    if st.experts:
        per_token += 4 * 2 * st.experts + 4 * h  # router logits and softmax, routed copy
    if st.resid_dropout > 0:  # two residual dropouts: their output and a 1-byte mask each
        per_token += 2 * ((2 if half else 4) + 1) * h
    total = per_token * tokens
    if config.get("attention", "sdpa") == "eager":
        scores = micro * st.heads * seq_len * seq_len
        total += (6 if half else 4) * scores
        if st.attn_dropout > 0:  # dropout on the probabilities: output and mask
            total += ((2 if half else 4) + 1) * scores
    return total


#: I-wide tensors an activation keeps beyond its input and output: GPT-2's ``gelu_new`` is
#: written out in Python (tanh, 0.5x and 1 + tanh are saved for backward)
ACT_EXTRA_SAVED = {"gelu_new": 3}


def saved_op_bytes(st: ModelStats, config: dict[str, Any], seq_len: int, micro: int) -> int:
    """Bytes a checkpointed layer keeps besides its input under ``checkpoint_save``: the
    attention kernel's output (and its fp32 log-sum-exp per head), and with ``matmuls`` every
    projection's output too (q, k, v, o; gate and up, or up alone, per routed expert; down)."""
    save = saved_ops(config)
    if save == "none":
        return 0
    half = config.get("precision", "fp32") in ("bf16", "fp16")
    width = 2 if half else 4
    q, kvw = st.heads * st.head_dim, st.kv_heads * st.head_dim
    per_token = width * q + 4 * st.heads
    if save == "matmuls":
        mlp = ((2 if st.gated_mlp else 1) * st.intermediate + st.hidden) * max(1, st.top_k)
        per_token += width * (q + 2 * kvw + st.hidden + mlp)
    return per_token * seq_len * micro
