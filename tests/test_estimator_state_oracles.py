"""Model states against outside oracles: the optimizer's own state after a real step, the
paper's 16 bytes per parameter for plain AdamW training, and for LoRA / QLoRA the adapters peft
actually adds to the transformers model (trainable parameters counted on the model), the linear
weights the job quantizes (every ``nn.Linear`` but the head, counted on the model), and the bytes
per weight the papers give: NF4 is 4 bits plus one absmax per block of 64, double-quantized
as bitsandbytes' ``Params4bit`` does by default (8 bits, and an fp32 absmax per 256 blocks:
4.127 bits, Dettmers et al. 2023, section 3), LLM.int8() 1 byte plus one fp32 scale per output row
(Dettmers et al. 2022)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from autotune.estimator.states import model_states
from autotune.models import MODELS
from trials.techniques.quantization import add_lora, as_linear, replace_linears

SMALL = {
    "tiny-llama": MODELS["tiny-llama"].config,
    "gqa-llama": {
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 96,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
    },
    "gpt2": {"model_type": "gpt2", "vocab_size": 300, "n_embd": 64, "n_layer": 2, "n_head": 4},
}


def _counted(model_cfg: dict, rank: int) -> tuple[int, int, int, int]:
    """(all parameters, quantized linear weights, their output rows, LoRA parameters), counted
    on the model transformers builds and peft adapts (meta device: no memory)."""
    config = transformers.AutoConfig.for_model(**model_cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    swapped: list[nn.Linear] = []

    def record(linear: nn.Linear) -> nn.Linear:
        swapped.append(linear)
        return linear

    replace_linears(model, record)  # the layers the job quantizes (GPT-2's Conv1D included)
    quantized = sum(linear.weight.numel() for linear in swapped)
    rows = sum(linear.out_features for linear in swapped)
    adapted = add_lora(model, rank=rank)
    lora = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    return total, quantized, rows, lora


@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("name", list(SMALL))
def test_qlora_states_match_the_adapted_model(name: str, rank: int) -> None:
    model_cfg = SMALL[name]
    total, quantized, rows, lora = _counted(model_cfg, rank)
    assert lora > 0 and 0 < quantized < total
    frozen_fp32 = 4 * (total - quantized)  # embeddings, norms, biases and the head stay fp32
    for quant, base in (
        ("nf4", quantized * (4 + 8 / 64 + 32 / (64 * 256)) / 8),
        ("int8", quantized * 1 + rows * 4),
    ):
        states = model_states(
            model_cfg, {"quantization": quant, "lora_r": rank, "optimizer": "adamw"}, 1
        )
        # AdamW keeps two fp32 moments per trainable (LoRA) parameter; fp32 gradients of them
        assert states.parts["gradients"] == 4 * lora
        assert states.parts["optimizer_states"] == 8 * lora
        assert states.parts["parameters"] == pytest.approx(base + frozen_fp32 + 4 * lora, abs=2), (
            quant
        )
        assert states.host_bytes == pytest.approx(4 * total * 1.5, abs=4)  # fp32 load copy
        # in bf16, autocast's 16-bit copy of each quantized weight (2 B each) is what a trace
        # of the unquantized model saw and the quantized one never makes; none in fp32
        bf16_cfg = {
            "quantization": quant,
            "lora_r": rank,
            "optimizer": "adamw",
            "precision": "bf16",
        }
        bf16 = model_states(model_cfg, bf16_cfg, 1)
        assert (states.frozen_copies, bf16.frozen_copies) == (0, 2 * quantized)
        fp16 = model_states(model_cfg, {**bf16_cfg, "precision": "fp16"}, 1)
        assert fp16.frozen_copies == 2 * quantized
        assert states.replaces_trace and bf16.parts == states.parts
        # nothing is offloaded: the host holds the fp32 model the job loads first
        assert states.host["offloaded states"] == 0
        assert states.notes == [
            f"{quant} base weights + LoRA r={rank} ({lora / 1e6:.1f}M trainable) by formula"
        ]


def test_lora_rank_defaults_to_the_jobs() -> None:
    """A config without ``lora_r`` is estimated at the rank the job adapts with."""
    from trials.techniques.quantization import LORA_RANK

    cfg = SMALL["tiny-llama"]
    base = {"quantization": "nf4", "optimizer": "adamw"}
    assert model_states(cfg, base, 1) == model_states(cfg, {**base, "lora_r": LORA_RANK}, 1)
    assert model_states(cfg, base, 1) != model_states(cfg, {**base, "lora_r": LORA_RANK * 2}, 1)


@pytest.mark.parametrize("name", ["adamw", "adafactor", "lion"])
@pytest.mark.parametrize("model", ["tiny-llama", "gpt2"])
def test_optimizer_state_bytes_are_what_the_optimizer_keeps(name: str, model: str) -> None:
    """The estimator's optimizer-state bytes against the real optimizer's state after one step
    (torch's AdamW and Adafactor, lion-pytorch's Lion, as the job builds them), step counters
    (0-dimensional tensors) aside."""
    from autotune.estimator.states import model_optimizer_bytes
    from autotune.models import stats_of
    from trials.techniques import OPTIMIZERS

    model_cfg = MODELS["tiny-llama"].config if model == "tiny-llama" else SMALL["gpt2"]
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**model_cfg)
    )
    opt = OPTIMIZERS[name].factory(net.parameters(), 1e-3)
    ids = torch.randint(0, 200, (2, 16))
    net(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    kept = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    assert kept > 0 or name == "adafactor"
    assert model_optimizer_bytes(stats_of(model_cfg), name) == kept


def test_plain_training_states_are_sixteen_bytes_per_parameter() -> None:
    """The trial job's own loop (no ZeRO), with every default: fp32 weights and gradients and
    AdamW's two fp32 moments, 4 + 4 + 8 bytes per parameter (Rajbhandari et al. 2020, sec. 3.1),
    the same under autocast (mixed precision keeps the fp32 master weights); nothing offloaded,
    the host holds the fp32 copy each process builds at load (times DeepSpeed's 1.5 factor)."""
    from autotune.models import stats_of

    cfg = MODELS["tiny-llama"].config
    psi = stats_of(cfg).n_params
    for config in ({}, {"precision": "bf16"}, {"zero_stage": 0, "offload_optimizer": "cpu"}):
        states = model_states(cfg, config, 1)
        assert states.parts == {
            "parameters": 4 * psi,
            "gradients": 4 * psi,
            "optimizer_states": 8 * psi,
        }, config
        assert states.host == {
            "offloaded states": 0,
            "model copy at load": 4 * psi,
            "pinned buffers and slack": 2 * psi,
        }
    # two processes on one host build two copies
    assert model_states(cfg, {}, 2).host["model copy at load"] == 8 * psi
    assert model_states(cfg, {}, 2, nodes=2).host["model copy at load"] == 4 * psi


def test_a_conv1d_becomes_the_same_linear_layer() -> None:
    """GPT-2's ``Conv1D`` (weight stored (in, out)) as the ``nn.Linear`` the job quantizes:
    the same outputs and gradients."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(12, 8)  # 8 in, 12 out
    torch.nn.init.normal_(conv.bias)
    linear = as_linear(conv)
    assert isinstance(linear, nn.Linear) and (linear.in_features, linear.out_features) == (8, 12)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(linear(x), conv(x), rtol=0, atol=1e-6)
    model = nn.Sequential(conv)
    assert replace_linears(model, lambda lin: lin, skip=()) == 1
    assert isinstance(model[0], nn.Linear)
