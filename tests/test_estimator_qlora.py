"""LoRA / QLoRA model states against outside oracles: the adapters peft actually adds to the
transformers model (trainable parameters counted on the model), the linear weights the job
quantizes (every ``nn.Linear`` but the head, counted on the model), and the bytes per weight the
papers give: NF4 is 4 bits plus one fp32 absmax per block of 64 (4.5 bits, Dettmers et al.
2023, section 3), LLM.int8() 1 byte plus one fp32 scale per output row (Dettmers et al. 2022)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from autotune.estimator.states import model_states
from autotune.models import REGISTRY
from trials.quantization import add_lora

SMALL = {
    "tiny-llama": REGISTRY["tiny-llama"].config,
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
    quantized = rows = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            continue
        if isinstance(module, nn.Linear):  # what trials.quantization.replace_linears swaps
            quantized += module.weight.numel()
            rows += module.out_features
    adapted = add_lora(model, rank=rank)
    lora = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    return total, quantized, rows, lora


#: GPT-2's linear layers are ``Conv1D`` modules, which the job's ``replace_linears`` does not swap
#: (it quantizes ``nn.Linear`` only), so its QLoRA trials train an fp32 base while the estimator
#: counts those weights as quantized. Strict: fixing either side makes this pass.
GPT2_GAP = pytest.mark.xfail(strict=True, reason="Conv1D is not quantized by the job")


@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=GPT2_GAP) if n == "gpt2" else n for n in SMALL]
)
def test_qlora_states_match_the_adapted_model(name: str, rank: int) -> None:
    model_cfg = SMALL[name]
    total, quantized, rows, lora = _counted(model_cfg, rank)
    assert lora > 0 and 0 < quantized < total
    frozen_fp32 = 4 * (total - quantized)  # embeddings, norms, biases and the head stay fp32
    for quant, base in (
        ("nf4", quantized * 4.5 / 8),
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
