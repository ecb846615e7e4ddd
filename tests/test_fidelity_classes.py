"""The fidelity classes (``trials/techniques``: each choice's ``Knob.fidelity``,
``fidelity_class``, ``classes_up_to``), each class read from what the library does with the
choice on the CPU: whether the whole model still trains, in which dtype the matmuls run, in
which dtype the optimizer keeps its state, whether the update rule is AdamW's.

The decisions, each with a test here that fails when it is inverted, swapped or fed the wrong
quantity:

1. a choice that changes no numerics is ``exact`` (checkpointing recomputes the same gradients);
2. 16-bit autocast (bf16, fp16) is ``mixed``: the whole model trains, matmuls in 16 bits;
3. optimizer states in 8 or 4 bits (bitsandbytes, torchao) and pure-bf16 master weights are
   ``reduced_state``: AdamW's update, its state held in fewer bits;
4. another update rule (Adafactor, Lion) is ``other_optimizer``;
5. a frozen base with LoRA adapters (int8, nf4 and ``lora``) is ``adapters``: only the adapters
   train, whatever else the configuration holds;
6. a configuration's class is its least faithful choice's (order: exact, mixed, reduced_state,
   other_optimizer, adapters);
7. ``--allow X`` searches X and every class more faithful than it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trials.techniques import (
    FIDELITY_CLASSES,
    TECHNIQUES,
    choice_fidelity,
    classes_up_to,
    fidelity_class,
    is_exact,
)
from trials.techniques.optimizer import OPTIMIZERS
from trials.techniques.quantization import _quantized


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("choice", ["int8", "nf4"])
def test_quantized_lora_trains_adapters_only_so_its_class_is_adapters(choice: str) -> None:
    """The quantized path (``_quantized``: freeze the model, swap its linears, add peft's LoRA),
    run with a frozen full-precision linear in place of bitsandbytes' (CUDA only): after it only
    LoRA's matrices train. A LoRA run is not full training, with or without other techniques."""
    model = _quantized(lambda linear: linear)(_tiny_llama(), torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj.base_layer.weight" in n for n in frozen)
    assert choice_fidelity("quantization", choice) == "adapters"
    for other in ({}, {"gradient_checkpointing": "full"}, {"precision": "bf16"}):
        assert fidelity_class({**other, "quantization": choice}) == "adapters"
    assert not is_exact({"quantization": choice})


def test_lora_on_a_full_precision_base_is_adapters() -> None:
    assert choice_fidelity("quantization", "lora") == "adapters"


def test_checkpointing_recomputes_the_same_gradients_so_it_is_exact() -> None:
    """torch's checkpoint gives the plain run's gradients bit for bit: the choice is exact."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    grads = []
    for ckpt in (False, True):
        block.zero_grad()
        y = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
        y.square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    for value in ("full", "selective"):
        assert choice_fidelity("gradient_checkpointing", value) == "exact"
    for dim, value in (("zero_stage", 2), ("offload_optimizer", "cpu"), ("attention", "eager")):
        assert choice_fidelity(dim, value) == "exact"
    assert is_exact({"gradient_checkpointing": "full", "zero_stage": 2})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_runs_the_matmuls_in_16_bits_on_the_full_model_so_it_is_mixed(
    precision: str,
) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    linear = nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=dtype):
        out = linear(torch.randn(2, 8))
    assert out.dtype == dtype and linear.weight.dtype == torch.float32
    assert choice_fidelity("precision", precision) == "mixed"


def test_low_bit_optimizer_state_is_reduced_state() -> None:
    """torchao's AdamW8bit (the project's factory) keeps each moment as uint8 codes: AdamW's
    update with its state in 8 bits."""
    p = nn.Parameter(torch.randn(64, 64))
    opt = OPTIMIZERS["adamw_torchao_8bit"].factory([p], 1e-3)
    p.grad = torch.randn_like(p)
    with torch.compiler.set_stance("force_eager"):  # as the CPU trials run it
        opt.step()
    state = opt.state[p]
    assert state["exp_avg"].codes.dtype == torch.uint8  # type: ignore[union-attr]
    for choice in ("adamw_8bit", "paged_adamw_8bit", "adamw_torchao_8bit", "adamw_torchao_4bit"):
        assert choice_fidelity("optimizer", choice) == "reduced_state", choice
    assert choice_fidelity("master_weights", "bf16") == "reduced_state"


def test_adafactor_is_another_update_rule() -> None:
    """One step on the same gradient: Adafactor (the project's factory) moves the weights
    otherwise than AdamW does, beyond a rescaling."""
    torch.manual_seed(0)
    w0 = torch.randn(32, 32)
    g = torch.randn(32, 32)
    steps = []
    for name in ("adamw", "adafactor"):
        p = nn.Parameter(w0.clone())
        opt = OPTIMIZERS[name].factory([p], 1e-3)
        p.grad = g.clone()
        opt.step()
        steps.append((p.detach() - w0).flatten())
    cos = torch.nn.functional.cosine_similarity(steps[0], steps[1], dim=0)
    assert cos < 0.99
    for choice in ("adafactor", "lion"):
        assert choice_fidelity("optimizer", choice) == "other_optimizer"


def test_a_configurations_class_is_its_least_faithful_choice() -> None:
    """By hand, every pair of one choice of each class."""
    one = {
        "exact": ("gradient_checkpointing", "full"),
        "mixed": ("precision", "bf16"),
        "reduced_state": ("optimizer", "adamw_torchao_8bit"),
        "other_optimizer": ("optimizer", "adafactor"),
        "adapters": ("quantization", "nf4"),
    }
    order = ["exact", "mixed", "reduced_state", "other_optimizer", "adapters"]
    assert list(FIDELITY_CLASSES) == order
    for a, b in itertools.combinations(order, 2):
        da, va = one[a]
        db, vb = one[b]
        if da == db:
            continue
        assert fidelity_class({da: va, db: vb}) == b, (a, b)
    assert fidelity_class({"precision": "bf16", "master_weights": "bf16"}) == "reduced_state"
    assert fidelity_class({}) == "exact"
    assert fidelity_class(TECHNIQUES.baseline()) == "exact"


def test_allow_searches_that_class_and_the_more_faithful_ones() -> None:
    assert classes_up_to("exact") == ("exact",)
    assert classes_up_to("mixed") == ("exact", "mixed")
    assert classes_up_to("other_optimizer") == (
        "exact",
        "mixed",
        "reduced_state",
        "other_optimizer",
    )
    assert classes_up_to("adapters") == tuple(FIDELITY_CLASSES)
