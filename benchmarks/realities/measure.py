"""Regenerate the measured reality: every configuration of a reduced space, run for real on CPU.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/realities/measure.py [--passes 3]

Each configuration of ``measured_space.yaml`` (resolved for this machine's CPU) runs as the real
trial a study runs (``trials.job.run_trial``: the model built from its config, the techniques
applied, DeepSpeed's engine for ZeRO 0-3 and optimizer/parameter offload, the CPU memory
tracker), *without* a budget, so the stored peak is the true one; the benchmark applies a budget
when it replays the table (over it: an OOM). By default every trial runs in this one process
(torch, transformers and DeepSpeed are imported once: on a shared 2-core machine the imports
cost more than the trial); ``--subprocess`` launches ``python -m trials.job`` per trial exactly as
a study does. The file is rewritten after every trial and configurations already in it are
skipped, so an interrupted run continues where it stopped.

Speeds: each trial times ``MEASURED_STEPS`` steps (the job's median step); the whole grid is
walked ``--passes`` times, one pass after the other, so a burst of load on the machine lands on
a few trials of one pass, and the row keeps the median of its passes (every pass's speed beside
it). One thread pinned to one core: the speeds are those of an idle core, not of whatever else
the machine ran. The peaks and the losses are deterministic: every pass must reproduce them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.availability import Hardware
from autotune.runner import SubprocessRunner
from autotune.space import SearchSpace
from autotune.strategy import config_key
from trials.spec import TrialResult, TrialSpec

HERE = Path(__file__).resolve().parent
SPACE = HERE / "measured_space.yaml"
DEFAULT_OUT = HERE / "measured_mini_llama.json"
MODEL = "mini-llama"
#: a LLaMA (RMSNorm, SwiGLU, rotary attention) smaller than the registry's tiny-llama, so that
#: its 192 real trials (x 3 passes) fit in half an hour of one core: ~0.9M parameters
MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "use_cache": False,
}
SEQ_LEN = 64
GLOBAL_BATCH = 4
#: 2 warm-up steps as a study runs (memory, budget); 8 timed steps (a study's default is 2): at
#: ~50 ms a step, two steps are too few to time on a machine that runs anything else
WARMUP_STEPS = 2
MEASURED_STEPS = 8
#: the grid walked this many times; a row's speed is the median of its passes
PASSES = 3
SEED = 0
LR = 3e-3
#: keys of every row of the table (tests check the file against them)
ROW_KEYS = (
    "config",
    "status",
    "peak_bytes",
    "tokens_per_s",
    "tokens_per_s_passes",
    "losses",
    "wall_s",
    "wall_s_passes",
    "error",
)
HEADER_KEYS = (
    "schema",
    "made_by",
    "space",
    "model",
    "model_config",
    "seq_len",
    "global_batch_size",
    "warmup_steps",
    "measured_steps",
    "seed",
    "lr",
    "in_process",
    "passes",
    "threads",
    "machine",
    "versions",
    "measured_at",
    "rows",
)
SCHEMA_VERSION = 2


def space(global_batch: int = GLOBAL_BATCH) -> SearchSpace:
    return SearchSpace.load(SPACE).resolve(global_batch, Hardware.detect("cpu"))


def spec_for(config: dict[str, Any], seq_len: int, global_batch: int) -> TrialSpec:
    return TrialSpec(
        model_config=MODEL_CONFIG,
        config=config,
        seq_len=seq_len,
        global_batch_size=global_batch,
        budget_bytes=None,  # unbounded: the true peak; the replay applies the budget
        backend="cpu",
        warmup_steps=WARMUP_STEPS,
        measured_steps=MEASURED_STEPS,
        seed=SEED,
        lr=LR,
    )


def header(seq_len: int, global_batch: int, in_process: bool, passes: int) -> dict[str, Any]:
    import deepspeed
    import torch
    import transformers

    return {
        "schema": SCHEMA_VERSION,
        "made_by": "OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/realities/measure.py"
        + f" --passes {passes}"
        + ("" if in_process else " --subprocess"),
        "space": "benchmarks/realities/measured_space.yaml",
        "model": MODEL,
        "model_config": MODEL_CONFIG,
        "seq_len": seq_len,
        "global_batch_size": global_batch,
        "warmup_steps": WARMUP_STEPS,
        "measured_steps": MEASURED_STEPS,
        "seed": SEED,
        "lr": LR,
        "in_process": in_process,
        "passes": passes,
        "threads": {
            "torch": torch.get_num_threads(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        },
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [],
    }


def run_in_process(spec: TrialSpec) -> TrialResult:
    """The job's own function, with the job's own handling of a crash (``failed``)."""
    from trials.job import run_trial

    start = time.perf_counter()
    try:
        result = run_trial(spec)
    except Exception as exc:
        result = TrialResult(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
    result.wall_s = result.wall_s or time.perf_counter() - start
    gc.collect()
    return result


def merge(
    row: dict[str, Any] | None, config: dict[str, Any], result: TrialResult
) -> dict[str, Any]:
    """One pass's trial folded into its row: the speeds so far and their median; the peak,
    status and losses must be what the earlier passes measured."""
    speeds = [*(row["tokens_per_s_passes"] if row else []), result.tokens_per_s]
    walls = [*(row["wall_s_passes"] if row else []), round(result.wall_s, 3)]
    if row is not None and (
        (row["status"], row["peak_bytes"]) != (result.status, result.peak_bytes)
        or len(row["losses"]) != len(result.losses)
        or any(
            abs(a - b) > 1e-6 * abs(a) for a, b in zip(row["losses"], result.losses, strict=True)
        )
    ):
        raise RuntimeError(f"a pass did not reproduce {config}: {row} vs {result}")
    return {
        "config": config,
        "status": result.status,
        "peak_bytes": result.peak_bytes,
        "tokens_per_s": statistics.median(speeds),
        "tokens_per_s_passes": speeds,
        "losses": result.losses,
        # the first pass pays the imports and DeepSpeed's op build: the median is the trial's
        "wall_s": statistics.median(walls),
        "wall_s_passes": walls,
        "error": result.error[:300],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--limit", type=int, default=0, help="measure at most this many (0: all)")
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--subprocess", action="store_true", help="one job process per trial")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    args = parser.parse_args()
    grid = space(args.global_batch).grid()
    todo = grid[: args.limit] if args.limit else grid  # what runs; every row is written back
    table: dict[str, Any] = (
        json.loads(args.out.read_text())
        if args.out.is_file()
        else header(args.seq_len, args.global_batch, not args.subprocess, args.passes)
    )
    if (table.get("schema"), table.get("passes")) != (SCHEMA_VERSION, args.passes):
        print(
            f"{args.out} is schema {table.get('schema')} with {table.get('passes')} passes: "
            f"continuing it needs schema {SCHEMA_VERSION} and --passes {table.get('passes')}",
            file=sys.stderr,
        )
        sys.exit(2)
    rows = {config_key(r["config"]): r for r in table["rows"]}
    with tempfile.TemporaryDirectory(prefix="autotune-measure-") as tmp:
        runner = SubprocessRunner(Path(tmp), timeout_s=600)
        for p in range(table["passes"]):
            for n, config in enumerate(todo, 1):
                key = config_key(config)
                if key in rows and len(rows[key]["tokens_per_s_passes"]) > p:
                    continue
                spec = spec_for(config, table["seq_len"], table["global_batch_size"])
                result = runner.run(spec, f"c{n}") if args.subprocess else run_in_process(spec)
                rows[key] = merge(rows.get(key), config, result)
                table["rows"] = [r for c in grid if (r := rows.get(config_key(c)))]
                args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
                print(
                    f"[pass {p + 1}, {n}/{len(todo)}] {result.status} "
                    f"{result.peak_bytes / 2**20:.1f} MiB {result.tokens_per_s:,.0f} tok/s "
                    f"{result.wall_s:.1f}s {config}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
