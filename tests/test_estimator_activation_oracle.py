"""A decoder layer's activations against what torch keeps for backward in a real forward pass.

The oracle is measured, not computed: a transformers model is run forward on the CPU and every
tensor autograd saves for backward is caught by ``torch.autograd.graph.saved_tensors_hooks``
(counted once per storage, the weights left out). The bytes of one layer for one sequence are
a double difference, (2 layers - 1 layer) x (micro-batch 3 - micro-batch 2), so the embedding,
the head, the logits and the weight casts that do not grow with the batch cancel (from a
micro-batch of 2: at 1 some reshapes are views that larger batches copy, GPT-2's eager q). A
checkpointed layer keeps what the checkpoint stores (its input and, per op, the saved ops'
outputs), which no saved-tensor hook outside it sees: there the oracle is the live tensor bytes
the forward leaves behind (the CPU trial backend's tracker; it agrees with the hooks to the byte
on the plain layer, checked below).

``layer_activation_bytes`` is a per-token formula of the layer's widths; the agreement measured
for each case is stated in the table and the test allows twice it (at least 1%). Checkpointed
layers agree to the byte. The oracle runs the CPU's kernels, so the estimate is asked for the
CPU (``cuda=False``: dropout keeps its noise in the input's dtype, and sdpa with attention
dropout takes its math path); what a GPU keeps instead is checked against CUDA's kernels under
fake tensors.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from autotune.estimator.activations import layer_activation_bytes, saved_op_bytes
from autotune.models import MODELS, stats_of
from tests.test_estimator_models import FAMILIES
from trials.build import build_model
from trials.memory import CpuMemoryMonitor
from trials.techniques.checkpointing import TECHNIQUE as CHECKPOINTING

SEQ = 32
TINY = MODELS["tiny-llama"].config
QWEN = {
    "model_type": "qwen2",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 2, "n_head": 4}
GPT2_NO_DROPOUT = {**GPT2, "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0}
MIXTRAL = {**QWEN, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
ARCHITECTURES = {
    "tiny-llama": TINY,
    "qwen2": QWEN,
    "gpt2": GPT2,
    "gpt2-no-dropout": GPT2_NO_DROPOUT,
    "mixtral": MIXTRAL,
    # the other layouts: fused q/k/v and gate/up with rotary (phi3), LayerNorm with a parallel
    # residual (gpt_neox), four fp32 norms and capped scores (gemma2, eager only), q/k norms
    **{n: {**FAMILIES[n], "vocab_size": 300} for n in ("phi3", "gpt_neox", "gemma2", "qwen3")},
}
ARCHITECTURES["phi3-gqa"] = {
    **ARCHITECTURES["phi3"],
    "num_key_value_heads": 2,
}  # v keeps the fused q/k/v
BF16 = {"precision": "bf16"}  # autocast over fp32 weights
FP16 = {"precision": "fp16"}
PURE16 = {"precision": "bf16", "zero_stage": 2}  # DeepSpeed's 16-bit model
EAGER = {"attention": "eager"}

#: every model in each of these configurations (plain fp32, autocast, DeepSpeed's 16-bit model,
#: and each with eager attention)
LAYER_CONFIGS = [{}, BF16, PURE16, EAGER, {**BF16, **EAGER}, {**PURE16, **EAGER}]
#: estimate / measured - 1 per model for each of LAYER_CONFIGS, as measured at seq 32 (torch 2.13
#: CPU, transformers 5). None: a gap (below), or Gemma 2's sdpa, which transformers refuses.
ERRORS: dict[str, tuple[float | None, ...]] = {
    "tiny-llama": (+0.0470, +0.0703, +0.0199, +0.0467, +0.0678, +0.0200),
    "qwen2": (+0.0600, +0.0817, +0.0182, +0.0537, +0.0667, +0.0182),
    "mixtral": (-0.0926, -0.0775, -0.0793, -0.0808, -0.0655, -0.0601),
    "gpt2": (+0.0243, +0.0371, +0.0069, +0.0260, +0.0467, +0.0121),
    "gpt2-no-dropout": (+0.0290, +0.0543, +0.0104, +0.0312, +0.0519, +0.0146),
    "phi3": (-0.0020, +0.0325, -0.0230, +0.0452, +0.0709, +0.0182),
    "gpt_neox": (-0.0035, +0.0458, -0.0328, +0.0604, None, +0.0260),
    "gemma2": (None, None, None, +0.0362, +0.0487, +0.0119),
    "phi3-gqa": (-0.0021, +0.0344, -0.0244, None, None, None),
    "qwen3": (+0.0397, +0.0577, +0.0118, +0.0378, +0.0530, +0.0123),
}
CASES: list[tuple[str, dict[str, Any], float]] = [
    (name, config, error)
    for name, errors in ERRORS.items()
    for config, error in zip(LAYER_CONFIGS, errors, strict=True)
    if error is not None
] + [("tiny-llama", FP16, +0.0703)]

#: measured gaps beyond 10%: GPT-NeoX's eager attention under autocast, 10.2% over. Strict: an
#: estimator that closes a gap makes its case pass and this list must shrink.
GAPS: list[tuple[str, dict[str, Any]]] = [("gpt_neox", {**BF16, **EAGER})]


def _kept(model_cfg: dict[str, Any], config: dict[str, Any], layers: int, micro: int) -> int:
    """Bytes the forward pass leaves for backward (weights excluded)."""
    cfg = dict(model_cfg)
    cfg["n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"] = layers
    half = config.get("precision", "fp32") != "fp32"
    model16 = half and "zero_stage" in config  # DeepSpeed trains the 16-bit model itself
    model = build_model(
        cfg, config.get("attention", "sdpa"), 0, dtype=torch.bfloat16 if model16 else torch.float32
    )
    model.train()
    CHECKPOINTING.apply(model, config, torch.device("cpu"))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 256, (micro, SEQ), generator=torch.Generator().manual_seed(0))
    dtype = torch.float16 if config.get("precision") == "fp16" else torch.bfloat16
    autocast = (
        torch.autocast("cpu", dtype=dtype) if half and not model16 else contextlib.nullcontext()
    )
    if config.get("gradient_checkpointing", "off") != "off":
        with CpuMemoryMonitor(None) as monitor, autocast:
            out = model(input_ids=ids)
            kept = monitor.live_bytes
        del out
        return kept
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = model(input_ids=ids)
    del out
    return sum(saved.values())


def _one_layer_one_sequence(model_cfg: dict[str, Any], config: dict[str, Any]) -> int:
    def at(layers: int, micro: int) -> int:
        return _kept(model_cfg, config, layers, micro)

    return (at(2, 3) - at(2, 2)) - (at(1, 3) - at(1, 2))


@pytest.mark.parametrize(
    ("name", "config", "measured_error"),
    CASES,
    ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'fp32'}" for n, c, _ in CASES],
)
def test_layer_activations_against_saved_tensors(
    name: str, config: dict[str, Any], measured_error: float
) -> None:
    model_cfg = ARCHITECTURES[name]
    measured = _one_layer_one_sequence(model_cfg, config)
    estimate = layer_activation_bytes(stats_of(model_cfg), config, SEQ, 1, cuda=False)
    # linear in the micro-batch, as the measured double difference is
    assert layer_activation_bytes(stats_of(model_cfg), config, SEQ, 3, cuda=False) == 3 * estimate
    tolerance = max(0.01, 2 * abs(measured_error))
    assert estimate == pytest.approx(measured, rel=tolerance), estimate / measured - 1


@pytest.mark.parametrize(
    ("name", "config"), [pytest.param(n, c, marks=pytest.mark.xfail(strict=True)) for n, c in GAPS]
)
def test_known_gaps_beyond_ten_percent(name: str, config: dict[str, Any]) -> None:
    model_cfg = ARCHITECTURES[name]
    measured = _one_layer_one_sequence(model_cfg, config)
    estimate = layer_activation_bytes(stats_of(model_cfg), config, SEQ, 1, cuda=False)
    assert estimate == pytest.approx(measured, rel=0.10)


CHECKPOINTED = [
    {"gradient_checkpointing": "full"},
    {"gradient_checkpointing": "full", "checkpoint_save": "attention"},
    {"gradient_checkpointing": "full", "checkpoint_save": "matmuls"},
    {"gradient_checkpointing": "full", "checkpoint_save": "matmuls", **BF16},
    {"gradient_checkpointing": "full", "checkpoint_save": "attention", **BF16},
    {"gradient_checkpointing": "full", "checkpoint_save": "matmuls", **FP16},
]


def _checkpointed_cases() -> list[Any]:
    cases = []
    for name in ("tiny-llama", "qwen2", "gpt2-no-dropout", "mixtral", "phi3", "gpt_neox", "qwen3"):
        for config in CHECKPOINTED:
            label = f"{name}-" + "-".join(map(str, config.values()))
            cases.append(pytest.param(name, config, id=label))
    return cases


@pytest.mark.parametrize(("name", "config"), _checkpointed_cases())
def test_checkpointed_layer_keeps_its_input_and_the_saved_ops(
    name: str, config: dict[str, Any]
) -> None:
    model_cfg = ARCHITECTURES[name]
    st = stats_of(model_cfg)
    measured = _one_layer_one_sequence(model_cfg, config)
    layer_input = 4 * st.hidden * SEQ  # the residual stream stays fp32 under autocast
    assert layer_input + saved_op_bytes(st, config, SEQ, 1) == measured
    assert saved_op_bytes(st, config, SEQ, 2) == 2 * saved_op_bytes(st, config, SEQ, 1)


def test_saved_ops_need_checkpointing() -> None:
    st = stats_of(TINY)
    assert saved_op_bytes(st, {"checkpoint_save": "matmuls"}, SEQ, 1) == 0
    assert saved_op_bytes(st, {"gradient_checkpointing": "full"}, SEQ, 1) == 0


def test_the_tracker_sees_what_the_hooks_see() -> None:
    """The checkpointed cases' oracle, checked on a plain layer against the hooks."""
    hooks = _one_layer_one_sequence(TINY, {})

    def live(layers: int, micro: int) -> int:
        cfg = {**TINY, "num_hidden_layers": layers}
        model = build_model(cfg, "sdpa", 0)
        model.train()
        ids = torch.randint(0, 256, (micro, SEQ), generator=torch.Generator().manual_seed(0))
        with CpuMemoryMonitor(None) as monitor:
            out = model(input_ids=ids)
            kept = monitor.live_bytes
        del out
        return kept

    assert (live(2, 2) - live(2, 1)) - (live(1, 2) - live(1, 1)) == hooks


@pytest.mark.parametrize("precision", [{}, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-llama", "qwen2", "mixtral", "qwen3"])
def test_what_eager_attention_adds(name: str, precision: dict[str, Any]) -> None:
    """Eager minus sdpa, measured and estimated: the scores (fp32 softmax and its 16-bit copy)
    and, with grouped-query heads, k and v repeated to every query head. The whole-layer test's
    tolerance (twice each case's error) is wider than these terms; their difference is not
    (measured within 3.2%: the estimate leaves sdpa's log-sum-exp in)."""
    model_cfg, st = ARCHITECTURES[name], stats_of(ARCHITECTURES[name])
    eager = {**precision, **EAGER}
    measured = _one_layer_one_sequence(model_cfg, eager) - _one_layer_one_sequence(
        model_cfg, precision
    )
    estimate = layer_activation_bytes(st, eager, SEQ, 1) - layer_activation_bytes(
        st, precision, SEQ, 1
    )
    assert estimate == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("precision", [{}, BF16, PURE16], ids=["fp32", "bf16", "pure16"])
def test_what_capped_scores_add(precision: dict[str, Any]) -> None:
    """Gemma 2's eager attention with and without its logit soft-capping: the tanh keeps its
    output, one score-sized tensor in the scores' dtype (measured: to the byte)."""
    capped = ARCHITECTURES["gemma2"]
    plain = {**capped, "attn_logit_softcapping": None}
    config = {**precision, **EAGER}
    measured = _one_layer_one_sequence(capped, config) - _one_layer_one_sequence(plain, config)
    estimate = layer_activation_bytes(stats_of(capped), config, SEQ, 1) - layer_activation_bytes(
        stats_of(plain), config, SEQ, 1
    )
    assert estimate == measured > 0


DROPOUTS = {"residual": {"attn_pdrop": 0.0}, "attention": {"resid_pdrop": 0.0}}


@pytest.mark.parametrize("shape", [{}, {"n_embd": 128, "n_head": 2}], ids=["h64x4", "h128x2"])
@pytest.mark.parametrize("config", LAYER_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("kind", sorted(DROPOUTS))
def test_what_dropout_adds_on_the_cpu(kind: str, config: dict[str, Any], shape: dict) -> None:
    """GPT-2 with one kind of dropout minus none, to the byte: each residual dropout keeps its
    noise (the add after it keeps nothing); attention dropout under sdpa takes the CPU's math
    path (fp32 scores, noise and output, no log-sum-exp), under eager it keeps its noise and,
    where it does not replace a 16-bit copy of the softmax, its output."""
    plain = {**GPT2_NO_DROPOUT, **shape}
    dropped = {**plain, "resid_pdrop": 0.1, "attn_pdrop": 0.1, **DROPOUTS[kind]}
    measured = _one_layer_one_sequence(dropped, config) - _one_layer_one_sequence(plain, config)
    estimate = layer_activation_bytes(
        stats_of(dropped), config, SEQ, 1, cuda=False
    ) - layer_activation_bytes(stats_of(plain), config, SEQ, 1, cuda=False)
    assert estimate == measured != 0  # fp32 math attention can keep less than the CPU's flash


def test_dropout_keeps_a_bool_mask_on_cuda_and_its_dtype_on_the_cpu() -> None:
    """What each device's dropout keeps, from torch itself: on CUDA ``dropout`` dispatches to
    the fused ``native_dropout``, whose mask is bool (run on fake CUDA tensors: no GPU here);
    on the CPU autograd saves a noise tensor of the input's dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.estimator.activations import dropout_mask_bytes

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.masks: list[torch.Tensor] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.native_dropout.default:
                self.masks.append(out[1])
            return out

    with FakeTensorMode(allow_non_fake_inputs=True), Ops() as ops:
        torch.nn.functional.dropout(torch.empty(4, 8, device="cuda", dtype=torch.bfloat16), 0.1)
    assert [m.element_size() for m in ops.masks] == [dropout_mask_bytes(2, cuda=True)]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(64, 8, dtype=dtype, requires_grad=True)
        saved: list[int] = []

        def pack(t: torch.Tensor, into: list[int] = saved) -> torch.Tensor:
            into.append(t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.dropout(x, 0.1)
        assert saved == [dropout_mask_bytes(x.element_size(), cuda=False)]
