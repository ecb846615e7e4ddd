"""A plain training loop under ``accelerate launch --config_file``, as accelerate's docs write one.

What accelerate's config file cannot carry (batch shape without DeepSpeed, the attention kernel,
checkpointing every k-th layer) it reads from autotune's companion file, as a user would.
Writes what accelerate actually used to the report path.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim
from transformers import LlamaConfig, LlamaForCausalLM


def main(model_config: str, companion_path: str, report: str, steps: int = 2) -> None:
    with open(companion_path) as f:
        companion = json.load(f)
    accum = companion["gradient_accumulation_steps"]
    micro = companion["micro_batch_size"]
    # with a DeepSpeed file, accumulation is DeepSpeed's (accelerate refuses it twice)
    accelerator = Accelerator(
        gradient_accumulation_steps=1 if companion["deepspeed_config"] else accum
    )
    with open(model_config) as f:
        config = LlamaConfig(**json.load(f), **companion["model_kwargs"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if companion["checkpoint_every_n_layers"]:
        model.activation_checkpointing_enable(every_n_layers=companion["checkpoint_every_n_layers"])
    n = micro * accum * accelerator.num_processes * steps
    ids = torch.randint(0, config.vocab_size, (n, companion["seq_len"]))
    loader = torch.utils.data.DataLoader(ids, batch_size=micro)
    ds = accelerator.state.deepspeed_plugin
    if ds is not None and "optimizer" in ds.deepspeed_config:  # DeepSpeed builds it
        optimizer = DummyOptim(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    inner = getattr(optimizer, "optimizer", optimizer)
    if accelerator.is_main_process:
        with open(report, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "distributed_type": str(accelerator.distributed_type),
                    "mixed_precision": accelerator.mixed_precision,
                    "device": str(accelerator.device),
                    "num_processes": accelerator.num_processes,
                    "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
                    "deepspeed": ds.deepspeed_config if ds is not None else None,
                    "zero_stage": model.zero_optimization_stage() if ds is not None else None,
                    "optimizer": type(getattr(inner, "optimizer", inner)).__name__,
                    "attn_implementation": accelerator.unwrap_model(
                        model
                    ).config._attn_implementation,
                    "scaler": accelerator.scaler is not None,
                },
                f,
                default=str,
            )


if __name__ == "__main__":
    main(*sys.argv[1:4])
