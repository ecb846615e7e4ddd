"""A decoder layer's activation bytes, to the byte, for tiny synthetic layouts.

``tests/test_estimator_activation_oracle.py`` measures whole layers against what torch saves for
backward and allows each layout its measured error (up to ~9%): a wrong coefficient inside that
band passes there. Here every term of the per-token model is pinned by hand arithmetic on a
layout whose widths all differ (hidden 8, 4 heads of 3, 2 kv heads: q 12 wide, k and v 6 each;
MLP 10 wide), over 2 sequences of 3 tokens (6 tokens, 2 x 4 x 3 x 3 = 72 attention scores), so
a term counted with the wrong width, dtype or sign lands on a different number.

The rules, per token, as the estimator documents them (measured with saved-tensor hooks):

- the layer's core, llama's layout: in fp32, 4 bytes x (6 hidden-wide + 3 q-wide + 2 kv-wide);
  under autocast 28 bytes per hidden unit (the fp32 residual stream and norms) and the 16-bit
  projections' outputs, 2 x (3 q-wide + 2 kv-wide); DeepSpeed's 16-bit model 15 per hidden unit
  and the same 16-bit projections;
- the MLP: 4 I-wide tensors when gated, 2 otherwise, 3 more for GPT-2's ``gelu_new``, in the
  compute dtype (4 bytes fp32, 2 in 16 bits), times ``top_k`` experts for an MoE layer;
- attention scores (eager only, or the CPU's sdpa with dropout), per score of 72.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from autotune.estimator.activations import layer_activation_bytes
from autotune.models import ModelStats

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 8, 4, 2, 3, 10
Q, KVW = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # 12, 6
SEQ, MICRO = 3, 2
TOKENS = SEQ * MICRO  # 6
SCORES = MICRO * HEADS * SEQ * SEQ  # 72

#: (mode, config): plain fp32 (DeepSpeed over fp32 weights included), autocast over fp32
#: weights, DeepSpeed's 16-bit model (a ``zero_stage``, or the traced estimator's marker)
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("fp32", {}),
    ("fp32", {"precision": "fp32"}),
    ("fp32", {"zero_stage": 2}),
    ("autocast", {"precision": "bf16"}),
    ("autocast", {"precision": "fp16"}),
    ("pure16", {"precision": "bf16", "zero_stage": 2}),
    ("pure16", {"precision": "fp16", "zero_stage": 3}),
    ("pure16", {"precision": "bf16", "deepspeed": True}),
]
IDS = [f"{mode}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'default'}" for mode, c in CONFIGS]
MODES = {"fp32": {}, "autocast": {"precision": "bf16"}, "pure16": CONFIGS[5][1]}

#: the core per token (no MLP), by hand from the rules above
CORE = {
    "fp32": 4 * (6 * H + 3 * Q + 2 * KVW),  # 4 x (48 + 36 + 12) = 384
    "autocast": 24 * H + 4 * H + 2 * (3 * Q + 2 * KVW),  # 224 + 96 = 320
    "pure16": 15 * H + 2 * (3 * Q + 2 * KVW),  # 120 + 96 = 216
}
#: bytes per element of the 16-bit-or-not tensors (MLP, projections, copies)
WIDTH = {"fp32": 4, "autocast": 2, "pure16": 2}


def _stats(**changes: Any) -> ModelStats:
    """A llama-like layer (gated SiLU MLP, two RMSNorms, rotary, separate projections)."""
    base = ModelStats(
        n_params=0,
        shapes=(),
        largest_module_params=0,
        largest_param=0,
        layer_params=0,
        layer_matrix_params=0,
        expert_params=0,
        experts=0,
        top_k=0,
        hidden=H,
        layers=1,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate=INTER,
        vocab=300,
        gated_mlp=True,
        tied=False,
        model_type="llama",
    )
    return dataclasses.replace(base, **changes)


def _bytes(st: ModelStats, config: dict[str, Any], cuda: bool = True) -> int:
    return layer_activation_bytes(st, config, SEQ, MICRO, cuda=cuda)


@pytest.mark.parametrize(("mode", "config"), CONFIGS, ids=IDS)
def test_llama_layer_core_and_gated_mlp(mode: str, config: dict[str, Any]) -> None:
    """Core plus four I-wide tensors (gate, up, act(gate), product), per token, 6 tokens."""
    expected = (CORE[mode] + WIDTH[mode] * 4 * INTER) * TOKENS
    assert _bytes(_stats(), config) == expected
    assert layer_activation_bytes(_stats(), config, SEQ, MICRO) == expected  # cuda by default
    # linear in the tokens: one sequence of 3 keeps half of two
    assert layer_activation_bytes(_stats(), config, SEQ, 1) * 2 == expected


MLPS = [(True, "silu", 4), (False, "silu", 2), (False, "gelu_new", 5), (True, "gelu_new", 7)]


@pytest.mark.parametrize(("gated", "act", "kept"), MLPS, ids=lambda v: str(v))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_mlp_keeps_its_i_wide_tensors(mode: str, gated: bool, act: str, kept: int) -> None:
    """Gated: gate, up, act(gate), product; plain: up and its activation; ``gelu_new`` (written
    out in Python) keeps tanh, 0.5x and 1 + tanh besides."""
    st = _stats(gated_mlp=gated, hidden_act=act)
    assert _bytes(st, MODES[mode]) == (CORE[mode] + WIDTH[mode] * kept * INTER) * TOKENS


@pytest.mark.parametrize(
    ("mode", "config", "fp32_experts"),
    [
        ("fp32", {}, False),
        ("autocast", {"precision": "bf16"}, True),
        ("autocast", {"precision": "bf16", "quantization": "none"}, True),
        ("autocast", {"precision": "bf16", "quantization": None}, True),  # None: no quantization
        ("autocast", {"precision": "fp16", "quantization": ""}, True),
        ("autocast", {"precision": "bf16", "quantization": "nf4"}, False),  # 16-bit base
        ("autocast", {"precision": "bf16", "quantization": "int8"}, False),
        ("pure16", {"precision": "bf16", "zero_stage": 2}, False),
    ],
    ids=lambda v: str(v),
)
def test_moe_layer_runs_top_k_experts_and_keeps_its_router(
    mode: str, config: dict[str, Any], fp32_experts: bool
) -> None:
    """4 experts, 2 per token: the MLP's four I-wide tensors twice, the router's fp32 logits and
    softmax (2 x 4 bytes per expert) and the routed copy of the input (4 bytes per hidden unit).
    Under autocast over unquantized fp32 weights the experts' grouped matmul has no autocast
    rule: their tensors are fp32, 2 bytes more per element than the 16-bit count."""
    st = _stats(experts=4, top_k=2)
    mlp = WIDTH[mode] * 4 * INTER * 2
    router = 2 * 4 * 4 + 4 * H
    upcast = 2 * 4 * INTER * 2 if fp32_experts else 0
    assert _bytes(st, config) == (CORE[mode] + mlp + router + upcast) * TOKENS


#: (layout, its ModelStats fields, extra bytes per hidden unit per token by mode relative to
#: llama's two RMSNorms, which keep 8 bytes each in fp32 and under autocast and 6 in DeepSpeed's
#: 16-bit model): Gemma's fp32 RMSNorm keeps 8 in every mode, a LayerNorm its input only (4, 2
#: in the 16-bit model), a parallel residual one input for both norms (4, or 2)
NORMS = [
    ("layernorm", {"norm": "layer"}, {"fp32": 2 * 4 - 16, "autocast": 2 * 4 - 16, "pure16": -8}),
    (
        "gemma-four-fp32-rms",
        {"norm": "rms_fp32", "norms": 4},
        {"fp32": 32 - 16, "autocast": 32 - 16, "pure16": 32 - 12},
    ),
    ("four-rms", {"norms": 4}, {"fp32": 32 - 16, "autocast": 32 - 16, "pure16": 24 - 12}),
    (
        "parallel-residual-layernorm",
        {"norm": "layer", "shared_norm_input": True},
        {"fp32": -8 - 4, "autocast": -8 - 4, "pure16": -8 - 2},
    ),
    (
        "parallel-residual-rms",
        {"shared_norm_input": True},
        {"fp32": -4, "autocast": -4, "pure16": -2},
    ),
]


@pytest.mark.parametrize(("layout", "fields", "extra"), NORMS, ids=[n[0] for n in NORMS])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_norm_layouts(mode: str, layout: str, fields: dict[str, Any], extra: dict) -> None:
    """What each norm layout keeps beyond llama's two RMSNorms, per hidden unit per token."""
    expected = (CORE[mode] + WIDTH[mode] * 4 * INTER + extra[mode] * H) * TOKENS
    assert _bytes(_stats(**fields), MODES[mode]) == expected


@pytest.mark.parametrize("mode", sorted(MODES))
def test_qk_norms_keep_q_and_k_wide_copies(mode: str) -> None:
    """Qwen3's RMSNorm on q and k: 8 bytes per q- and kv-wide unit in fp32, 6 in 16 bits (the
    16-bit projections' outputs, upcast), under autocast as in DeepSpeed's model."""
    per_unit = 8 if mode == "fp32" else 6
    expected = (CORE[mode] + WIDTH[mode] * 4 * INTER + per_unit * (Q + KVW)) * TOKENS
    assert _bytes(_stats(qk_norm=True), MODES[mode]) == expected


#: (qkv_projections, mlp_in_projections, rotary)
FUSED = [(1, 1, True), (1, 1, False), (1, 2, True), (1, 2, False), (3, 1, True)]


@pytest.mark.parametrize(("qkv", "mlp_in", "rotary"), FUSED, ids=lambda v: str(v))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_fused_projections(mode: str, attention: str, qkv: int, mlp_in: int, rotary: bool) -> None:
    """Fused projections (GPT-2's c_attn, phi3's qkv_proj and gate_up_proj). Under autocast each
    linear layer casts its own 16-bit copy of its input (2 bytes per hidden unit): a fused one
    casts once, so 2 x hidden less per projection saved. Under sdpa, q, k and v are views of one
    fused output: with rotary v keeps it alive beside the rewritten q and k (q + kv wide more),
    without it the kernel copies k and v (2 kv-wide more), in the compute dtype. Eager
    attention's matmuls copy all three, which the core counts already."""
    st = _stats(qkv_projections=qkv, mlp_in_projections=mlp_in, rotary=rotary)
    plain = _stats(rotary=rotary)
    config = {**MODES[mode], "attention": attention}
    extra = 0
    if mode == "autocast":
        extra -= 2 * H * ((3 - qkv) + (2 - mlp_in))
    if qkv == 1 and attention == "sdpa":
        extra += WIDTH[mode] * (Q + KVW if rotary else 2 * KVW)
    expected = (CORE[mode] + WIDTH[mode] * 4 * INTER + extra) * TOKENS
    if attention == "sdpa":
        assert _bytes(st, config) == expected
    # eager: the same difference from the unfused layer (eager's own terms: below)
    assert _bytes(st, config) - _bytes(plain, config) == extra * TOKENS


#: bytes per score eager attention keeps: fp32's softmax (4); a 16-bit model's softmax taken in
#: fp32 and cast back (4 + 2), or under autocast always; a 16-bit model's plain softmax (2)
EAGER_SCORE_BYTES = [
    ("fp32", True, 4),
    ("fp32", False, 4),
    ("autocast", True, 6),
    ("autocast", False, 6),
    ("pure16", True, 6),
    ("pure16", False, 2),
]


@pytest.mark.parametrize(("mode", "softmax_fp32", "per_score"), EAGER_SCORE_BYTES)
@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS], ids=["gqa", "mha"])
def test_eager_attention_keeps_the_scores(
    mode: str, softmax_fp32: bool, per_score: int, kv_heads: int
) -> None:
    """Eager attention adds its softmax per score and, with grouped-query heads, repeat_kv's
    copies of k and v widened to every query head (2 x (q - kv) wide, compute dtype)."""
    st = _stats(softmax_fp32=softmax_fp32, kv_heads=kv_heads)
    kvw = kv_heads * HEAD_DIM
    core = 4 * (6 * H + 3 * Q + 2 * kvw)
    if mode != "fp32":
        core = (28 if mode == "autocast" else 15) * H + 2 * (3 * Q + 2 * kvw)
    per_token = core + WIDTH[mode] * 4 * INTER
    repeat = WIDTH[mode] * 2 * (Q - kvw) * TOKENS
    expected = per_token * TOKENS + per_score * SCORES + repeat
    assert _bytes(st, {**MODES[mode], "attention": "eager"}) == expected
    assert _bytes(st, {**MODES[mode], "attention": "sdpa"}) == per_token * TOKENS


@pytest.mark.parametrize("mode", sorted(MODES))
def test_capped_scores_keep_the_tanh_output(mode: str) -> None:
    """Gemma 2's soft-capping: tanh(scores / cap) keeps one score-sized tensor in the compute
    dtype under eager attention (the oracle file measures it to the byte)."""
    capped, plain = _stats(attn_softcap=True), _stats()
    eager = {**MODES[mode], "attention": "eager"}
    assert _bytes(capped, eager) - _bytes(plain, eager) == WIDTH[mode] * SCORES
    # bf16 halves what fp32 keeps for the same op
    if mode != "fp32":
        fp32 = _bytes(capped, {"attention": "eager"}) - _bytes(plain, {"attention": "eager"})
        assert 2 * (_bytes(capped, eager) - _bytes(plain, eager)) == fp32


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_residual_dropouts_keep_a_mask_each(mode: str, cuda: bool, attention: str) -> None:
    """Two residual dropouts, a mask each per hidden unit: CUDA's bool mask (1 byte), the CPU's
    noise in the input's dtype (4 bytes fp32, 2 in 16 bits); none at probability 0."""
    config = {**MODES[mode], "attention": attention}
    dropped = _bytes(_stats(resid_dropout=0.1), config, cuda)
    mask = 1 if cuda else WIDTH[mode]
    assert dropped - _bytes(_stats(), config, cuda) == 2 * mask * H * TOKENS
    assert _bytes(_stats(resid_dropout=0.0), config, cuda) == _bytes(_stats(), config, cuda)
    if cuda:  # the default device is a GPU
        assert layer_activation_bytes(_stats(resid_dropout=0.1), config, SEQ, MICRO) == dropped
    if attention == "sdpa":
        expected = (CORE[mode] + WIDTH[mode] * 4 * INTER + 2 * mask * H) * TOKENS
        assert dropped == expected


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_attention_dropout_under_sdpa(mode: str, cuda: bool) -> None:
    """A GPU's sdpa fuses attention dropout (nothing more kept). The CPU's has no dropout
    kernel: its math path keeps the fp32 softmax, the noise and the output per score (12 bytes),
    no log-sum-exp (4 bytes per head per token less), and its q-wide terms as measured on
    GPT-2 (2 bytes more per q unit in 16 bits, 8 fewer in fp32)."""
    dropped, plain = _stats(attn_dropout=0.1), _stats()
    extra = _bytes(dropped, MODES[mode], cuda) - _bytes(plain, MODES[mode], cuda)
    if cuda:
        assert extra == 0
    else:
        q_wide = (2 if mode != "fp32" else -8) * Q * TOKENS
        assert extra == 12 * SCORES - 4 * HEADS * TOKENS + q_wide
    # no attention dropout: the CPU's sdpa keeps what a GPU's does
    assert _bytes(plain, MODES[mode], cuda=False) == _bytes(plain, MODES[mode], cuda=True)


#: (mode, softmax_fp32, cuda, bytes per score the dropout adds): its mask (1 byte on CUDA, the
#: input's dtype on the CPU), and its output where it does not replace a 16-bit copy of the
#: softmax that the next matmul would have kept (fp32: 4; a 16-bit model's plain softmax: 2)
EAGER_DROPOUT = [
    ("fp32", True, True, 1 + 4),
    ("fp32", True, False, 4 + 4),
    ("fp32", False, True, 1 + 4),
    ("autocast", True, True, 1),
    ("autocast", False, True, 1),
    ("autocast", True, False, 2),
    ("pure16", True, True, 1),
    ("pure16", False, True, 1 + 2),
    ("pure16", False, False, 2 + 2),
]


@pytest.mark.parametrize(("mode", "softmax_fp32", "cuda", "per_score"), EAGER_DROPOUT)
def test_attention_dropout_under_eager(
    mode: str, softmax_fp32: bool, cuda: bool, per_score: int
) -> None:
    """Eager attention's dropout on the probabilities, per score (as the oracle file measures
    on GPT-2 to the byte on the CPU)."""
    dropped = _stats(attn_dropout=0.1, softmax_fp32=softmax_fp32)
    plain = _stats(softmax_fp32=softmax_fp32)
    config = {**MODES[mode], "attention": "eager"}
    extra = _bytes(dropped, config, cuda) - _bytes(plain, config, cuda)
    assert extra == per_score * SCORES
