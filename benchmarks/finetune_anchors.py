"""How well do the estimators predict published fine-tuning runs (memory and speed)?

    python benchmarks/finetune_anchors.py          # the table, the errors, the ladder's directions

Each row is a published single-GPU fine-tuning run: its source, the configuration it ran, the
published peak memory and tokens/s, what the analytical estimator and the speed model predict
and the errors. Goals: memory within 10%, speed within 20%, and every rung of torchtune's
cumulative Llama 3.2 3B table moving in the published direction. Not a test (the fast test
``tests/test_finetune_anchors.py`` runs its arithmetic on a few rows).

A row's configuration is checked against the estimate space (``search_spaces/estimate.yaml``).
One the space does not propose is still priced, memory and speed, by the analytical estimator
directly (the configuration as a trial or ``autotune estimate --config`` would run it), and says
why the space leaves it out ("outside the estimate space"): compiled LoRA on a bf16 base (the
adapters train eagerly in the trial space, so the estimate space scores them uncompiled), pure
bf16 on the torch engine without compile or the step in backward (the space runs every other
configuration under DeepSpeed or FSDP2, and DeepSpeed's stage 0 keeps fp32 masters), compile
beside activation offloading (a space rule).

Published peak memory is the caching allocator's (torchtune's ``log_peak_memory_stats``):
paged optimizer states (unified memory) are not in it, so the prediction compared is the
allocator's peak (``autotune.estimator.paging``). On a card with room to spare the allocator
keeps what it reserved (the RTX A6000 rows report about twice the RTX 4090's memory for the same
recipe): those rows' memory is listed, not counted in the memory goal.

Sources:

* torchtune README, "Memory and training speed" (https://github.com/pytorch/torchtune,
  README.md): Llama 3.1 8B, batch 2 of packed 2,048-token sequences, compile, one GPU. Full
  fine-tune: ``recipes/configs/llama3_1/8B_full_single_device.yaml`` (bf16 weights without fp32
  masters, bitsandbytes PagedAdamW8bit, ``optimizer_in_bwd``, activation checkpointing,
  ``CEWithChunkedOutputLoss``); LoRA: ``8B_lora_single_device.yaml`` (rank 8 on the attention
  projections, AdamW, checkpointing); QLoRA: ``8B_qlora_single_device.yaml`` (NF4 base).
* torchtune docs, ``docs/source/tutorials/memory_optimizations.rst``: Llama 3.2 3B on one
  A100 80GB, batch 2 x 4,096 tokens, bf16, each rung adding a technique to the one before.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.errors import UserError
from autotune.estimate_backend import estimate_space, hardware_for
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import GPUS
from autotune.estimator.paging import apply_budget
from autotune.estimator.speed import MODEL_ERROR
from autotune.estimator.workload import Workload
from autotune.models import MODELS, stats_of
from autotune.space import SearchSpace
from trials.data import Documents

GIB = 2**30
README = "https://github.com/pytorch/torchtune/blob/main/README.md"
TUTORIAL = (
    "https://github.com/pytorch/torchtune/blob/main/docs/source/tutorials/memory_optimizations.rst"
)

#: what every torchtune single-device recipe runs: bf16 weights without fp32 masters
TORCHTUNE = {
    "precision": "bf16",
    "master_weights": "bf16",
    "attention": "sdpa",
    "optimizer": "adamw",
    "gradient_checkpointing": "off",
}
FULL_8B = {
    **TORCHTUNE,
    "optimizer": "paged_adamw_8bit",
    "optimizer_in_backward": True,
    "gradient_checkpointing": "full",
    "cross_entropy": "chunked",
    "compile": True,
    "micro_batch_size": 2,
}
LORA_8B = {
    **TORCHTUNE,
    "adapter": "lora",
    "lora_rank": 8,
    "lora_targets": "attention",
    "gradient_checkpointing": "full",
    "cross_entropy": "chunked",
    "compile": True,
    "micro_batch_size": 2,
}
#: compile left out: the space does not compile over bitsandbytes' quantized modules
QLORA_8B = {
    "precision": "bf16",
    "attention": "sdpa",
    "optimizer": "adamw",
    "quantization": "nf4",
    "gradient_checkpointing": "full",
    "cross_entropy": "chunked",
    "micro_batch_size": 2,
}


#: keys the speed model reads that are no dimension of the space (how the library runs a choice)
SPEED_ONLY = ("activation_offload_stream",)
#: a published change smaller than this is flat: a rung then keeps its direction when the
#: predicted change is within the speed model's error (``speed.MODEL_ERROR``)
FLAT = 0.02


@dataclass
class Row:
    source: str
    label: str
    model: str
    gpu: str
    seq: int
    config: dict[str, Any]
    memory_gib: float
    tokens_per_s: float
    #: variable-length data (unpacked rows padded to the longest): MIN:MAX tokens
    documents: Documents | None = None
    #: the memory figure is reserved memory without pressure, not an allocation peak
    memory_compared: bool = True
    note: str = ""
    ladder: bool = False  # a rung of the cumulative 3B table


#: Stanford Alpaca's prompt templates (its README, as torchtune's ``AlpacaToMessages`` writes
#: them), with and without an input; "Around 40% of the examples have an input"
ALPACA_TEMPLATES = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
    "\n\n### Input:\n\n\n### Response:\n",
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n\n\n### Response:\n",
)
ALPACA_WITH_INPUT = 0.4
#: the dataset's published size (Hugging Face card of its split copy with a formatted ``text``
#: column beside instruction, input and output): 47,764,738 bytes over 52,002 examples, each
#: string with a 4-byte offset in the Arrow table
ALPACA_BYTES, ALPACA_EXAMPLES, ARROW_OFFSET = 47_764_738, 52_002, 4
#: characters per token of English text under a tiktoken-style BPE (OpenAI's rule of thumb, ~4);
#: Llama 3's tokenizer extends cl100k's vocabulary, so it is no less dense
CHARS_PER_TOKEN = 4.0
#: Llama 3's chat format around one user and one assistant message: begin_of_text, two headers
#: of start_header_id, role, end_header_id and a blank line, two eot_id
CHAT_TOKENS = 11
#: the shortest row: the template without input, its chat tokens and about ten words
ALPACA_SHORTEST = 50


def alpaca_documents() -> Documents:
    """Alpaca's rows under torchtune's Llama 3 tokenizer, from published figures: the mean
    formatted row is the template plus instruction, input and output, whose characters the
    dataset's size gives (the formatted ``text`` repeats them: 2 x content + template per
    example); the spread is assumed uniform from ``ALPACA_SHORTEST`` with that mean."""
    with_input, without = (len(t) for t in ALPACA_TEMPLATES)
    template = ALPACA_WITH_INPUT * with_input + (1 - ALPACA_WITH_INPUT) * without
    per_example = ALPACA_BYTES / ALPACA_EXAMPLES - 4 * ARROW_OFFSET
    content = (per_example - template) / 2
    mean = (content + template) / CHARS_PER_TOKEN + CHAT_TOKENS
    return Documents(ALPACA_SHORTEST, round(2 * mean) - ALPACA_SHORTEST)


def _rungs() -> list[Row]:
    """torchtune's cumulative Llama 3.2 3B table on one A100: each rung adds to the last."""
    baseline = alpaca_documents()
    steps: list[tuple[str, dict[str, Any], float, float, str]] = [
        (
            "baseline",
            {},
            25.5,
            2091,
            f"unpacked alpaca rows padded to the longest of two, {baseline} tokens (mean from "
            "the dataset's published size, uniform spread assumed); eager launches and the "
            "AdamW step over ~300 tokens a step: launch-bound, where the model is least sure",
        ),
        (
            "+ packing",
            {},
            60.0,
            7075,
            "priced as causal 4,096-token rows under sdpa's flash kernel; torchtune masks each "
            "packed document (flex attention's block mask), not modelled",
        ),
        ("+ compile", {"compile": True}, 51.0, 8998, ""),
        ("+ chunked cross-entropy", {"cross_entropy": "chunked"}, 42.9, 9174, ""),
        ("+ activation checkpointing", {"gradient_checkpointing": "full"}, 24.9, 7210, ""),
        ("+ step in backward", {"optimizer_in_backward": True}, 23.1, 7309, ""),
        (
            "+ activation offload",
            {"activation_offload": "cpu", "activation_offload_stream": "side"},
            21.8,
            7301,
            "copies on a side stream",
        ),
        (
            "+ 8-bit AdamW",
            {"optimizer": "adamw_torchao_8bit"},
            17.6,
            6960,
            "torchao's AdamW8bit (bitsandbytes' PagedAdamW8bit, the config's default, keeps its "
            "states out of the allocator: 9.1 GiB); its compiled step's fp32 moments of the tied "
            "embedding, 2.9 GiB, are priced; about 1.8 GiB unexplained",
        ),
    ]
    config: dict[str, Any] = {**TORCHTUNE, "micro_batch_size": 2}
    rows = []
    for label, add, mem, tps, note in steps:
        config = {**config, **add}
        rows.append(
            Row(
                TUTORIAL,
                f"3B {label}",
                "llama-3.2-3b",
                "a100-80gb",
                4096,
                dict(config),
                mem,
                tps,
                documents=baseline if label == "baseline" else None,
                note=note,
                ladder=True,
            )
        )
    last = {k: v for k, v in config.items() if k not in ("optimizer", "optimizer_in_backward")}
    lora = {**last, "optimizer": "adamw", "adapter": "lora", "lora_rank": 8}
    lora["lora_targets"] = "attention"
    qlora = {k: v for k, v in lora.items() if k not in ("adapter", "lora_rank", "lora_targets")}
    qlora.pop("master_weights")
    qlora.update(quantization="nf4", compile=False)  # as QLORA_8B
    rows.append(Row(TUTORIAL, "3B LoRA", "llama-3.2-3b", "a100-80gb", 4096, lora, 8.5, 8210))
    rows.append(Row(TUTORIAL, "3B QLoRA", "llama-3.2-3b", "a100-80gb", 4096, qlora, 4.6, 8035))
    return rows


#: the same recipe on both cards: the RTX A6000's datasheet is slower (dense bf16 tensor
#: 154.8 against 165.2 TFLOPS, memory 768 against 1,008 GB/s), its published speed is not
A6000_RATIO = (
    "published A6000/4090 speed {:.2f}x against datasheet ratios of 0.94 (bf16 tensor) and "
    "0.76 (memory): no datasheet model meets both cards"
)

ROWS: list[Row] = [
    Row(README, "8B full, RTX 4090", "llama-3.1-8b", "rtx4090", 2048, FULL_8B, 18.9, 1650),
    Row(
        README,
        "8B full, RTX A6000",
        "llama-3.1-8b",
        "rtx-a6000",
        2048,
        FULL_8B,
        37.4,
        2579,
        memory_compared=False,
        note=f"reserved, no pressure; {A6000_RATIO.format(2579 / 1650)}",
    ),
    Row(README, "8B LoRA, RTX 4090", "llama-3.1-8b", "rtx4090", 2048, LORA_8B, 16.2, 3083),
    Row(
        README,
        "8B LoRA, RTX A6000",
        "llama-3.1-8b",
        "rtx-a6000",
        2048,
        LORA_8B,
        30.3,
        4699,
        memory_compared=False,
        note=f"reserved, no pressure; {A6000_RATIO.format(4699 / 3083)}",
    ),
    Row(
        README,
        "8B QLoRA, RTX 4090",
        "llama-3.1-8b",
        "rtx4090",
        2048,
        QLORA_8B,
        7.4,
        2413,
        note="embedding and head 3.9 GiB in fp32 here (peft's prepare_model_for_kbit_training "
        "casts what is not 4-bit to fp32, as the job and its HF/axolotl exports run it), 2.0 GiB "
        "in torchtune's bf16; not compiled here",
    ),
    *_rungs(),
]


def flops_per_token(model: str, seq: int) -> float:
    """Training FLOPs per token, forward and backward: 6 per matmul weight (the embedding's
    lookup is none) and 6 s q per layer of causal attention."""
    st = stats_of(MODELS[model].config)
    mm = st.layers * st.layer_matrix_params + st.vocab * st.hidden
    return 6 * mm + 6 * seq * st.heads * st.head_dim * st.layers


#: ``autotune run --model llama-7b --budget 24GB --host-memory 64GB``: torchtune's 8B RTX 4090
#: recipe on Llama 2 7B, against the 8B row's speed scaled by FLOPs per token (no memory figure)
HEADLINE = Row(
    README,
    "7B full, RTX 4090 (8B row scaled)",
    "llama-7b",
    "rtx4090",
    2048,
    FULL_8B,
    0.0,
    1650 * flops_per_token("llama-3.1-8b", 2048) / flops_per_token("llama-7b", 2048),
    memory_compared=False,
    note="the answer's recipe; budget 24GB",
)
ROWS.append(HEADLINE)
#: the device budget a row plans for when it is not the card's whole memory
BUDGETS = {HEADLINE.label: 24 * 10**9}


@lru_cache(maxsize=16)
def _space(gpu: str, batch: int) -> SearchSpace:
    return estimate_space().resolve(batch, hardware_for(GPUS[gpu]), documents=True)


def not_expressible(config: dict[str, Any], gpu: str, batch: int) -> str:
    """Why the estimate space rejects ``config`` ("" when it accepts it)."""
    try:
        space = _space(gpu, batch)
    except UserError as exc:
        return str(exc)
    known = {d.name for d in space.dimensions}
    unknown = [k for k in config if k not in known and k not in SPEED_ONLY]
    if unknown:
        return f"'{unknown[0]}' is not a dimension of the space yet"
    chosen: dict[str, Any] = {}

    def choose(name: str, choices: list[Any]) -> Any:
        dim = name.split("|")[0]
        value = config.get(dim, choices[0])
        if value not in choices:
            raise UserError(f"{dim}={value} is not allowed with the rest ({choices})")
        chosen[dim] = value
        return value

    try:
        space.sample(choose)
    except UserError as exc:
        return str(exc)
    dropped = [k for k in config if k not in chosen and k not in SPEED_ONLY]
    if dropped:
        return f"{dropped[0]} does not apply with the rest of the configuration"
    return ""


@dataclass
class Prediction:
    row: Row
    tokens_per_s: float
    memory_gib: float | None  # the allocator's peak
    why_not: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def speed_error(self) -> float:
        return 100 * (self.tokens_per_s - self.row.tokens_per_s) / self.row.tokens_per_s

    @property
    def memory_error(self) -> float | None:
        if self.memory_gib is None:
            return None
        if not self.row.memory_gib:
            return None
        return 100 * (self.memory_gib - self.row.memory_gib) / self.row.memory_gib


def predict(row: Row) -> Prediction:
    model = MODELS[row.model].config
    gpu = GPUS[row.gpu]
    batch = int(row.config.get("micro_batch_size", 1))
    workload = Workload(
        model,
        seq_len_tokens=row.seq,
        global_batch_sequences=batch,
        gpu=gpu,
        documents=row.documents,
    )
    est = AnalyticalEstimator().estimate(workload, row.config)
    budget = BUDGETS.get(row.label, gpu.memory_bytes)
    paging = apply_budget(est, workload, row.config, budget)
    why = not_expressible(row.config, row.gpu, batch)
    allocator = paging.allocator_peak if paging is not None else est.peak_bytes
    memory = allocator / GIB
    return Prediction(row, est.tokens_per_s, memory, why, dict(est.time_breakdown))


def directions(preds: list[Prediction]) -> list[tuple[str, bool, bool | None]]:
    """Per rung of the cumulative table after the first: (label, speed moves as published,
    memory moves as published or None where either rung has no memory prediction)."""
    ladder = [p for p in preds if p.row.ladder]
    out = []
    for before, after in pairwise(ladder):
        published = after.row.tokens_per_s / before.row.tokens_per_s - 1
        predicted = after.tokens_per_s / before.tokens_per_s - 1
        if abs(published) < FLAT:
            speed_ok = abs(predicted) <= MODEL_ERROR
        else:
            speed_ok = (predicted > 0) == (published > 0)
        mem_ok = None
        if before.memory_gib is not None and after.memory_gib is not None:
            mem_up = after.row.memory_gib > before.row.memory_gib
            mem_ok = (after.memory_gib > before.memory_gib) == mem_up
        out.append((after.row.label, speed_ok, mem_ok))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    preds = [predict(r) for r in ROWS]
    print(
        "| run | GPU | published GiB | predicted GiB | error | published tok/s | predicted | error"
        " | notes |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for p in preds:
        r = p.row
        mem = f"{p.memory_gib:.1f}" if p.memory_gib is not None else "-"
        err = f"{p.memory_error:+.0f}%" if p.memory_error is not None else "-"
        if not r.memory_compared and p.memory_error is not None:
            err += " (not counted)"
        notes = "; ".join(
            x for x in (r.note, f"outside the estimate space: {p.why_not}" * bool(p.why_not)) if x
        )
        print(
            f"| {r.label} | {r.gpu} | {r.memory_gib or '-'} | {mem} | {err} "
            f"| {r.tokens_per_s:,.0f} "
            f"| {p.tokens_per_s:,.0f} | {p.speed_error:+.0f}% | {notes} |"
        )
    speed = [abs(p.speed_error) for p in preds]
    memory = [abs(e) for p in preds if (e := p.memory_error) is not None and p.row.memory_compared]
    print(
        f"speed: median |error| {statistics.median(speed):.0f}%, max {max(speed):.0f}%, "
        f"{sum(e <= 20 for e in speed)} of {len(speed)} within 20%"
    )
    if memory:
        print(
            f"memory: median |error| {statistics.median(memory):.0f}%, max {max(memory):.0f}%, "
            f"{sum(e <= 10 for e in memory)} of {len(memory)} within 10% "
            f"({len(preds) - len(memory)} rows not compared)"
        )
    print("cumulative 3B table, each rung against the one before (published direction kept?):")
    for label, speed_ok, mem_ok in directions(preds):
        m = "-" if mem_ok is None else "yes" if mem_ok else "NO"
        print(f"  {label:<30} speed {'yes' if speed_ok else 'NO'}, memory {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
