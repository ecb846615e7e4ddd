"""A plain Hugging Face Trainer script, as a user writes one: every training setting comes from
the command line (HfArgumentParser) or ``TrainingArguments.from_json``; nothing from autotune.

Used by the export tests as the consumer of ``--format hf`` (under torchrun) and as the stand-in
``train.py`` of ``--format command``. It trains a few steps of a LLaMA built from a config file
on random tokens and writes what the Trainer actually used to ``--report``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


@dataclass
class ScriptArguments:
    model_config: str = field(metadata={"help": "a LlamaConfig as JSON"})
    report: str = field(metadata={"help": "where to write what the Trainer used"})
    model_kwargs: str | None = field(default=None, metadata={"help": "autotune's companion"})
    seq_len: int = 64


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, seq_len: int, n: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = HfArgumentParser((TrainingArguments, ScriptArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):  # one JSON file of everything
        args, script = parser.parse_json_file(sys.argv[1])
    else:
        args, script = parser.parse_args_into_dataclasses()
    model_kwargs = {}
    if script.model_kwargs:  # the attention kernel TrainingArguments cannot carry
        with open(script.model_kwargs) as f:
            model_kwargs = json.load(f)["model_kwargs"]
    with open(script.model_config) as f:
        config = LlamaConfig(**json.load(f), **model_kwargs)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * 8
    data = RandomTokens(config.vocab_size, script.seq_len, n)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ds = trainer.accelerator.state.deepspeed_plugin
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if args.process_index == 0:
        with open(script.report, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "steps": trainer.state.global_step,
                    "world_size": args.world_size,
                    "device": str(args.device),
                    "deepspeed": ds.deepspeed_config if ds is not None else None,
                    "zero_stage": trainer.model_wrapped.zero_optimization_stage()
                    if ds is not None
                    else None,
                    "optimizer": type(getattr(inner, "optimizer", inner)).__name__,
                    "attn_implementation": model.config._attn_implementation,
                    "checkpointed_layers": [bool(m.gradient_checkpointing) for m in layers],
                    "max_grad_norm": args.max_grad_norm,
                    "learning_rate": args.learning_rate,
                    "weight_decay": args.weight_decay,
                    "bf16": args.bf16,
                    "fp16": args.fp16,
                    "per_device_train_batch_size": args.per_device_train_batch_size,
                    "gradient_accumulation_steps": args.gradient_accumulation_steps,
                },
                f,
                default=str,
            )


if __name__ == "__main__":
    main()
