"""How well does the speed model predict published training throughputs?

    python benchmarks/speed_calibration.py            # the table and the median error
    python benchmarks/speed_calibration.py --fit      # also the matmul efficiency that fits best

Each row is a published measurement (source, model shape, GPU, parallelism, micro-batch,
checkpointing, attention kernel) run through ``autotune.estimator.speed``; the figure is
converted to tokens/s per GPU where the source gives FLOPs. Where a source leaves a setting out,
the row says what was assumed. Not a test: it is how ``MATMUL_EFFICIENCY`` and ``MODEL_ERROR``
in ``autotune/estimator/speed.py`` were chosen.

Sources:

* MosaicML llm-foundry, ``scripts/train/benchmarking/README.md`` (MPT models, FSDP FULL_SHARD
  = ZeRO-3, amp_bf16, flash attention, 8 GPUs per node): throughput in tokens/s/GPU.
* Dao-AILab/flash-attention, ``training/README.md``: GPT3-1.3B and 2.7B on 8 x A100 80GB with
  FlashAttention, tokens/s for the node (assumed: DDP, micro-batch 8, no checkpointing).
* ZeRO-Offload (Ren et al., USENIX ATC 2021, abstract): 40 TFLOPS on one V100 for a 10B GPT-2
  (hidden 4096, 50 layers, 16 heads, as DeepSpeed's tutorial; assumed seq 1024, micro-batch 8,
  full checkpointing), against 30 TFLOPS for a 1.4B model with PyTorch alone (assumed hidden 2048,
  28 layers, DDP on one GPU, checkpointing). FLOPs as Megatron-LM counts them with recompute:
  96 B s l h^2 (1 + s/6h + V/16lh) per iteration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.estimator import speed
from autotune.estimator.activations import layer_activation_bytes
from autotune.estimator.gpus import GPUS
from autotune.estimator.workload import Workload
from autotune.models import stats_of


def mpt(d: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "model_type": "mpt",
        "d_model": d,
        "n_layers": layers,
        "n_heads": heads,
        "expansion_ratio": 4,
        "vocab_size": 50368,
        "max_seq_len": 2048,
        "use_cache": False,
    }


def gpt(h: int, layers: int, heads: int, vocab: int = 50257) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "n_embd": h,
        "n_layer": layers,
        "n_head": heads,
        "vocab_size": vocab,
        "n_positions": 2048,
        "use_cache": False,
    }


@dataclass
class Figure:
    source: str
    label: str
    model: dict[str, Any]
    gpu: str
    nproc: int
    seq: int
    micro: int
    accum: int
    config: dict[str, Any]
    tokens_per_s_per_gpu: float
    note: str = ""


FOUNDRY = "llm-foundry"
FSDP = {"zero_stage": 3, "precision": "bf16", "attention": "flash_attention_2"}
CKPT = {**FSDP, "gradient_checkpointing": "full"}
DDP_FLASH = {"precision": "bf16", "attention": "flash_attention_2"}


def megatron_tokens_per_s(tflops: float, h: int, layers: int, seq: int, vocab: int) -> float:
    """Megatron-LM's FLOPs with recompute (96 B s l h^2 (...)) per token -> tokens/s."""
    per_token = 96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    return tflops * 1e12 / per_token


FIGURES: list[Figure] = [
    Figure(
        FOUNDRY, "MPT-7b s2048 mb6x2", mpt(4096, 32, 32), "a100-80gb", 8, 2048, 6, 2, FSDP, 4641
    ),
    Figure(
        FOUNDRY, "MPT-13b s2048 mb2x3", mpt(5120, 40, 40), "a100-80gb", 8, 2048, 2, 3, FSDP, 2262
    ),
    Figure(
        FOUNDRY,
        "MPT-30b s2048 mb3x21 ckpt",
        mpt(7168, 48, 56),
        "a100-80gb",
        8,
        2048,
        3,
        21,
        CKPT,
        916,
    ),
    Figure(
        FOUNDRY, "MPT-3b s2048 mb10x2", mpt(2560, 32, 20), "a100-80gb", 8, 2048, 10, 2, FSDP, 10811
    ),
    Figure(
        FOUNDRY, "MPT-1b s2048 mb14x4", mpt(2048, 24, 16), "a100-80gb", 8, 2048, 14, 4, FSDP, 20513
    ),
    Figure(
        FOUNDRY,
        "MPT-7b s4096 mb16x2 ckpt",
        mpt(4096, 32, 32),
        "a100-80gb",
        8,
        4096,
        16,
        2,
        CKPT,
        3684,
    ),
    Figure(FOUNDRY, "MPT-7b s2048 mb6x1", mpt(4096, 32, 32), "h100", 8, 2048, 6, 1, FSDP, 10643),
    Figure(FOUNDRY, "MPT-13b s2048 mb2x1", mpt(5120, 40, 40), "h100", 8, 2048, 2, 1, FSDP, 4792),
    Figure(
        FOUNDRY, "MPT-30b s2048 mb3x21 ckpt", mpt(7168, 48, 56), "h100", 8, 2048, 3, 21, CKPT, 2002
    ),
    Figure(FOUNDRY, "MPT-1b s2048 mb14x1", mpt(2048, 24, 16), "h100", 8, 2048, 14, 1, FSDP, 45455),
    Figure(FOUNDRY, "MPT-3b s4096 mb5x6", mpt(2560, 32, 20), "h100", 8, 4096, 5, 6, FSDP, 20964),
    Figure(
        "flash-attention",
        "GPT3-1.3B s2048",
        gpt(2048, 24, 16),
        "a100-80gb",
        8,
        2048,
        8,
        1,
        DDP_FLASH,
        169_000 / 8,
        "assumed DDP, micro-batch 8",
    ),
    Figure(
        "flash-attention",
        "GPT3-2.7B s2048",
        gpt(2560, 32, 20),
        "a100-80gb",
        8,
        2048,
        8,
        1,
        DDP_FLASH,
        85_000 / 8,
        "assumed DDP, micro-batch 8",
    ),
    Figure(
        "ZeRO-Offload",
        "GPT-2 10B, 1 GPU, offload",
        gpt(4096, 50, 16),
        "v100",
        1,
        1024,
        8,
        1,
        {
            "zero_stage": 2,
            "offload_optimizer": "cpu",
            "precision": "fp16",
            "attention": "eager",
            "gradient_checkpointing": "full",
        },
        megatron_tokens_per_s(40, 4096, 50, 1024, 50257),
        "40 TFLOPS; assumed seq 1024, mb 8",
    ),
    Figure(
        "ZeRO-Offload",
        "GPT-2 1.4B, PyTorch",
        gpt(2048, 28, 16),
        "v100",
        1,
        1024,
        8,
        1,
        {"precision": "fp16", "attention": "eager", "gradient_checkpointing": "full"},
        megatron_tokens_per_s(30, 2048, 28, 1024, 50257),
        "30 TFLOPS; assumed shape and mb 8",
    ),
]


def predict(f: Figure) -> float:
    st = stats_of(f.model)
    config = {"optimizer": "adamw", "micro_batch_size": f.micro, "gradient_checkpointing": "off"}
    config.update(f.config)
    gbs = f.micro * f.accum
    acts = layer_activation_bytes(st, config, f.seq, f.micro)
    t = speed.step_time(Workload(f.model, f.seq, gbs, f.nproc, gpu=GPUS[f.gpu]), config, acts)
    return gbs * f.seq / t.total


def errors() -> list[float]:
    return [100 * (predict(f) - f.tokens_per_s_per_gpu) / f.tokens_per_s_per_gpu for f in FIGURES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="grid-search MATMUL_EFFICIENCY first")
    args = ap.parse_args(argv)
    if args.fit:  # each GPU generation on its own rows
        for major in sorted({GPUS[f.gpu].sm[0] for f in FIGURES}):
            rows = [i for i, f in enumerate(FIGURES) if GPUS[f.gpu].sm[0] == major]
            best = min(
                (statistics.median(abs(_with(major, eff)[i]) for i in rows), eff)
                for eff in [x / 100 for x in range(30, 81, 2)]
            )
            print(f"SM {major}.x: best efficiency {best[1]:.2f}, median |error| {best[0]:.1f}%")
            speed.MATMUL_EFFICIENCY[major] = best[1]
    print("| source | run | GPU | published tok/s/GPU | predicted | error | assumptions |")
    print("|---|---|---|---:|---:|---:|---|")
    errs = errors()
    for f, e in zip(FIGURES, errs, strict=True):
        print(
            f"| {f.source} | {f.label} | {f.nproc}x {f.gpu} | {f.tokens_per_s_per_gpu:,.0f} "
            f"| {predict(f):,.0f} | {e:+.1f}% | {f.note} |"
        )
    absolute = [abs(e) for e in errs]
    print(
        f"median |error| {statistics.median(absolute):.1f}%, max {max(absolute):.1f}% over "
        f"{len(errs)} published figures (matmul efficiency by CUDA major: "
        f"{speed.MATMUL_EFFICIENCY})"
    )
    return 0


def _with(major: int, eff: float) -> list[float]:
    old = speed.MATMUL_EFFICIENCY.get(major, speed.DEFAULT_MATMUL_EFFICIENCY)
    speed.MATMUL_EFFICIENCY[major] = eff
    try:
        return errors()
    finally:
        speed.MATMUL_EFFICIENCY[major] = old


if __name__ == "__main__":
    sys.exit(main())
