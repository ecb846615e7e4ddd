"""How fast the estimate backend scores a whole search space: the llama-70b estimate space on
8 H100s (global batch 32, 2,048 tokens), the question `autotune run --backend estimate` answers
by scoring every configuration. Goal: under 10 s of CPU time for the full-training grid (every
configuration without LoRA/DoRA adapters), so that the answer without a GPU comes in seconds;
the adapters' own grid (LoRA/DoRA on a 16-bit base over the dimensions that apply to them) is
timed apart and reported beside it. CPU time, not wall time, so that a loaded machine moves it
less.

    python benchmarks/estimate_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from autotune.estimate_backend import estimate_space, hardware_for
from autotune.estimator.exhaustive import score
from autotune.estimator.gpus import GPUS
from autotune.estimator.workload import Workload
from autotune.models import MODELS

GOAL_CPU_S = 10.0


def cpu_times(configs: list[dict[str, Any]], repeat: int, workload: Workload) -> list[float]:
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.process_time()
        score(workload, configs, budget_bytes=80 * 10**9)
        times.append(time.process_time() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs; the least CPU time counts")
    args = parser.parse_args()
    gpu = GPUS["h100"]
    configs = estimate_space().resolve(32, hardware_for(gpu, 8)).grid()
    workload = Workload(
        MODELS["llama-70b"].config,
        seq_len_tokens=2048,
        global_batch_sequences=32,
        processes=8,
        gpu=gpu,
    )
    # the per-model quantities (the model built on the meta device) once, before the clock
    score(workload, configs[:1], budget_bytes=80 * 10**9)
    full = [c for c in configs if c.get("adapter", "none") == "none"]
    adapters = [c for c in configs if c.get("adapter", "none") != "none"]
    print(f"llama-70b estimate space on 8x H100: {len(configs):,} configurations")
    for label, part in (("full-training grid", full), ("adapters' grid (LoRA/DoRA)", adapters)):
        if not part:
            continue
        times = cpu_times(part, args.repeat, workload)
        best = min(times)
        print(
            f"{label}: {len(part):,} configurations, CPU time best {best:.2f} s of {len(times)} "
            f"runs ({', '.join(f'{t:.2f}' for t in times)}), "
            f"{1e6 * best / len(part):.0f} us per configuration"
        )
        if part is full:
            met = "met" if best < GOAL_CPU_S else "NOT met"
            print(f"goal under {GOAL_CPU_S:.0f} s of CPU for the full-training grid: {met}")


if __name__ == "__main__":
    main()
