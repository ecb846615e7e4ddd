"""Sequence packing: a micro-batch's documents in as few rows as hold them, not one per row.

Fine-tuning documents vary in length; one per row, each row is padded to the micro-batch's
longest, and the pads cost memory and time while training nothing. Packed, the documents fill
rows of the sequence length whole (best-fit decreasing, never split: ``trials.data.pack``),
each with its own ``position_ids`` restarting at 0, from which transformers builds a
block-causal mask (flash-attention's varlen kernel on CUDA): a document attends only to itself.
A step trains on the same documents and its loss is the mean over the same target tokens, so
packing is exact; it needs variable-length data (``--documents MIN:MAX``), and on fixed-length
data, whose rows are already full, the dimension is dropped.

This is transformers' padding-free collation (``DataCollatorWithFlattening``, TRL's
``packing_strategy="bfd"``) at a bounded row length; axolotl calls it ``sample_packing``.
The exports name it where the consumer has a key, and the companion file records it for a
training script.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique

if TYPE_CHECKING:
    from trials.techniques.terms import MemoryStep

PACKING = "packing"


def packs(config: Config) -> bool:
    return bool(config.get(PACKING, False))


#: why the dimension is dropped on fixed-length data
FIXED_LENGTH = (
    "the trial data has no padding (every sequence is --seq-len tokens); "
    "--documents MIN:MAX gives variable-length documents"
)


class Packing(Technique):
    family = "packing"
    traced = False  # the traced step takes the packed micro-batch's shape, not its tensors
    knobs = (
        Knob(
            PACKING,
            (False, True),
            baseline=False,
            from_bool=(True, False),
            short=lambda v: "packed" if v else "",
            needs_documents=FIXED_LENGTH,
            # no memory order: packed rows hold fewer positions in all, but are all as long as
            # the sequence, so eager attention's s x s scores can grow
        ),
    )

    def memory(self, step: MemoryStep) -> None:
        # packed rows: transformers builds one block-causal boolean mask (rows x s x s), which
        # every layer's attention keeps for backward (FlashAttention-2's varlen path needs none)
        attention = str(step.config.get("attention", "sdpa"))
        if step.documents and packs(step.config) and attention != "flash_attention_2":
            step.head_acts += step.micro * step.length * step.length

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        # axolotl's multipack sampler; its rows count in micro_batch_size, and its
        # flash-attention varlen patch keeps documents apart
        return {"sample_packing": True} if packs(config) else {}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        if not packs(config):
            return {"packing": None}
        return {
            "packing": {
                "strategy": "bfd",  # best-fit decreasing, documents never split
                "position_ids": "restart per document",
                "collator": "transformers.DataCollatorWithFlattening",
                "trl_sft_config": {"packing": True, "packing_strategy": "bfd"},
            }
        }


TECHNIQUE = Packing()
