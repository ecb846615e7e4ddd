"""Regenerate the traced reality: every configuration of ``traced_space.yaml``, traced.

    nice -n 10 python benchmarks/realities/trace.py [--out FILE]

Memory: the traced estimator (``autotune.estimator.traced``: the trial's own step run on fake
tensors, with ZeRO/offload model states from ``autotune.estimator.states``), and the larger of
that and the *construction peak*: the trial builds the fp32 model on the device before the
engine shards or offloads it (4 B/param), except under ZeRO-3, where ``zero.Init`` builds it
partitioned (its largest tensor gathered). Speed: the roofline for the GPU. Cost: a fixed setup
plus the trial's steps (an OOM: the setup and one step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.availability import Hardware
from autotune.estimator.gpus import gpu_spec
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.models import MODELS, stats_of
from autotune.space import SearchSpace

HERE = Path(__file__).resolve().parent
SPACE = HERE / "traced_space.yaml"
DEFAULT_OUT = HERE / "traced_small_llama.json"
MODEL = "small-llama"
GPU = "rtx4090"
NPROC = 4
SETUP_S = 60.0
STEPS = 4  # 2 warm-up + 2 measured, as a study


def hardware() -> Hardware:
    return Hardware(
        backend="cuda",
        cuda_capability=gpu_spec(GPU).sm,
        gpu_count=NPROC,
        has_flash_attn=True,
        has_bitsandbytes=True,
        has_peft=True,
        has_deepspeed=True,
    )


def construction_bytes(model_config: dict[str, Any], config: dict[str, Any]) -> int:
    st = stats_of(model_config)
    if config.get("zero_stage") == 3:
        return 4 * st.largest_param
    return 4 * st.n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    entry = MODELS[MODEL]
    space = SearchSpace.load(SPACE).resolve(entry.global_batch_size, hardware())
    est = TracedEstimator()
    gpu = gpu_spec(GPU)
    rows = []
    for n, c in enumerate(space.grid(), 1):
        e = est.estimate(
            Workload(
                entry.config,
                seq_len_tokens=entry.seq_len,
                global_batch_sequences=entry.global_batch_size,
                processes=NPROC,
                gpu=gpu,
            ),
            c,
        )
        build = construction_bytes(entry.config, c)
        step_s = e.step_time_s
        rows.append(
            {
                "config": c,
                "status": "ok",
                "peak_bytes": max(e.peak_bytes, build),
                "step_peak_bytes": e.peak_bytes,
                "construction_bytes": build,
                "tokens_per_s": e.tokens_per_s,
                "losses": [],
                "wall_s": SETUP_S + STEPS * step_s,
                "oom_wall_s": SETUP_S + step_s,
                "error": "",
            }
        )
        print(f"[{n}] {e.peak_bytes / 2**20:,.0f} MiB {e.tokens_per_s:,.0f} tok/s {c}", flush=True)
    table = {
        "schema": 1,
        "made_by": "nice -n 10 python benchmarks/realities/trace.py",
        "space": "benchmarks/realities/traced_space.yaml",
        "model": MODEL,
        "model_config": entry.config,
        "seq_len": entry.seq_len,
        "global_batch_size": entry.global_batch_size,
        "nproc": NPROC,
        "gpu": GPU,
        "measured_steps": 2,
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
