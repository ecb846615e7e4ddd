"""Regenerate the measured reality: every configuration of a reduced space, run for real on CPU.

    nice -n 10 python benchmarks/realities/measure.py [--out FILE] [--subprocess]

Each configuration of ``measured_space.yaml`` (resolved for this machine's CPU) runs as the real
trial a study runs (``trials.job.run_trial``: the model built from its config, the techniques
applied, DeepSpeed's engine for ZeRO 0-3 and optimizer/parameter offload, the CPU memory
tracker), *without* a budget, so the stored peak is the true one; the benchmark applies a budget
when it replays the table (over it: an OOM). By default every trial runs in this one process
(torch, transformers and DeepSpeed are imported once: on a shared 2-core machine the imports
cost more than the trial); ``--subprocess`` launches ``python -m trials.job`` per trial exactly as
a study does. The file is rewritten after every trial and configurations already in it are
skipped, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.hardware import Hardware
from autotune.runner import SubprocessRunner
from autotune.space import SearchSpace
from autotune.strategy import config_key
from trials.spec import TrialResult, TrialSpec

HERE = Path(__file__).resolve().parent
SPACE = HERE / "measured_space.yaml"
DEFAULT_OUT = HERE / "measured_mini_llama.json"
MODEL = "mini-llama"
#: a LLaMA (RMSNorm, SwiGLU, rotary attention) smaller than the registry's tiny-llama, so that
#: its 64 real trials fit in minutes of a shared 2-core CPU: ~0.9M parameters
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
#: the study's defaults (StudySettings): 2 warm-up steps (memory, budget), 2 timed steps
WARMUP_STEPS = 2
MEASURED_STEPS = 2
SEED = 0
LR = 3e-3
#: keys of every row of the table (tests check the file against them)
ROW_KEYS = ("config", "status", "peak_bytes", "tokens_per_s", "losses", "wall_s", "error")
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
    "machine",
    "versions",
    "measured_at",
    "rows",
)
SCHEMA_VERSION = 1


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


def header(seq_len: int, global_batch: int, in_process: bool) -> dict[str, Any]:
    import deepspeed
    import torch
    import transformers

    return {
        "schema": SCHEMA_VERSION,
        "made_by": "nice -n 10 python benchmarks/realities/measure.py"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--limit", type=int, default=0, help="measure at most this many (0: all)")
    parser.add_argument("--subprocess", action="store_true", help="one job process per trial")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    args = parser.parse_args()
    grid = space(args.global_batch).grid()
    table: dict[str, Any] = (
        json.loads(args.out.read_text())
        if args.out.is_file()
        else header(args.seq_len, args.global_batch, not args.subprocess)
    )
    done = {config_key(r["config"]) for r in table["rows"]}
    todo = [c for c in grid if config_key(c) not in done]
    if args.limit:
        todo = todo[: args.limit]
    with tempfile.TemporaryDirectory(prefix="autotune-measure-") as tmp:
        runner = SubprocessRunner(Path(tmp), timeout_s=600)
        for n, config in enumerate(todo, 1):
            spec = spec_for(config, table["seq_len"], table["global_batch_size"])
            result = runner.run(spec, f"c{n}") if args.subprocess else run_in_process(spec)
            table["rows"].append(
                {
                    "config": config,
                    "status": result.status,
                    "peak_bytes": result.peak_bytes,
                    "tokens_per_s": result.tokens_per_s,
                    "losses": result.losses,
                    "wall_s": round(result.wall_s, 3),
                    "error": result.error[:300],
                }
            )
            args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            print(
                f"[{len(table['rows'])}/{len(grid)}] {result.status} "
                f"{result.peak_bytes / 2**20:.1f} MiB {result.tokens_per_s:,.0f} tok/s "
                f"{result.wall_s:.1f}s {config}",
                flush=True,
            )


if __name__ == "__main__":
    main()
