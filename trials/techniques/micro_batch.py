"""Micro-batch size and gradient accumulation: the global batch (per process) trained as
``accumulation`` micro-batches of ``micro_batch_size``; exact at a fixed global batch. The one
place the batch arithmetic is written."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trials.techniques.base import Choice, Config, Knob, Run, Technique

#: the dimension (a trial config's key)
MICRO_BATCH = "micro_batch_size"


def micro_and_accumulation(
    config: Config, global_batch_size: int, *, strict: bool = True
) -> tuple[int, int]:
    """(micro-batch, accumulation steps) of a config at this global batch (per process); the
    micro-batch defaults to the whole batch and must divide it (``strict=False``, for the
    estimator's what-ifs: at least one accumulation step, the remainder ignored)."""
    micro = int(config.get(MICRO_BATCH, global_batch_size))
    if not strict and micro >= 1:
        return micro, max(1, global_batch_size // micro)
    if micro < 1 or global_batch_size % micro:
        raise ValueError(
            f"micro_batch_size {micro} does not divide global_batch_size {global_batch_size}"
        )
    return micro, global_batch_size // micro


def micro_batch_problem(config: Config, global_batch_size: int) -> str | None:
    """What is wrong with a hand-written config's micro-batch at this global batch (per
    process), or None: a whole number >= 1 that divides the batch, as a trial requires."""
    micro = config.get(MICRO_BATCH)
    if micro is None:
        return None
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        return f"config: {MICRO_BATCH} {micro!r}: a whole number >= 1"
    if global_batch_size % micro:
        return (
            f"config: {MICRO_BATCH} {micro} does not divide the global batch "
            f"{global_batch_size} (per process); choose a divisor or --global-batch-size"
        )
    return None


def _divides(choice: Choice, global_batch_size: int) -> bool:
    return isinstance(choice, int) and global_batch_size % choice == 0


def _whole_batch(choices: Sequence[Choice], global_batch_size: int) -> Choice:
    """Plain training's micro-batch: the whole global batch in one step (else the largest)."""
    sizes = [int(c) for c in choices]
    return global_batch_size if global_batch_size in sizes else max(sizes)


class MicroBatch(Technique):
    family = "micro_batch"
    knobs = (
        Knob(
            MICRO_BATCH,
            None,
            baseline_of=_whole_batch,
            memory_order=float,  # a bigger micro-batch keeps more activations
            fits_batch=_divides,
            probe_plain=True,  # the loss probe's whole batch in one step
            short=lambda v: f"mb={v}",
        ),
    )

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "train_micro_batch_size_per_gpu": run.micro_batch,
            "gradient_accumulation_steps": run.accumulation,
            "train_batch_size": run.micro_batch * run.accumulation * run.processes,
        }

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "per_device_train_batch_size": run.micro_batch,
            "gradient_accumulation_steps": run.accumulation,
        }

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "micro_batch_size": run.micro_batch,
            "gradient_accumulation_steps": run.accumulation,
        }

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {
            "micro_batch_size": run.micro_batch,
            "gradient_accumulation_steps": run.accumulation,
        }


TECHNIQUE = MicroBatch()
