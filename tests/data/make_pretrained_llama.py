"""Makes ``tests/data/pretrained-llama/``: a tiny LLaMA-architecture model trained to convergence,
saved with ``save_pretrained`` (config.json, model.safetensors), for the tests of pretrained
weights and of the loss probe on them.

Its pretraining task is the trial data's (``trials.data``: arithmetic progressions) with another
modulus (``MODULUS`` instead of 256), so the trial data is a fine-tuning task close to what the
model knows: most next tokens it already predicts, the wrap-around it must relearn.

    python tests/data/make_pretrained_llama.py   # about a minute on one CPU core
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

OUT = Path(__file__).parent / "pretrained-llama"
MODULUS = 241
SEQ = 32
BATCH = 32
STEPS = 2000
LR = 3e-3
CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    use_cache=False,
)


def batch(gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, MODULUS, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 16, (BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ).unsqueeze(0)) % MODULUS


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    for step in range(STEPS):
        ids = batch(gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == STEPS - 1:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(OUT)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
