"""How fast the estimate backend scores a whole search space: the llama-70b estimate space on
8 H100s (global batch 32, 2,048 tokens), the question `autotune run --backend estimate` answers
by scoring every configuration. Goal: under 10 s of CPU time, so that the answer without a GPU
comes in seconds. CPU time, not wall time, so that a loaded machine moves it less.

    python benchmarks/estimate_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import time

from autotune.estimate_backend import estimate_space, hardware_for
from autotune.estimator.exhaustive import score
from autotune.estimator.gpus import GPUS
from autotune.estimator.workload import Workload
from autotune.models import MODELS

GOAL_CPU_S = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs; the least CPU time counts")
    args = parser.parse_args()
    gpu = GPUS["h100"]
    configs = estimate_space().resolve(32, hardware_for(gpu, 8)).grid()
    kw = {"seq_len_tokens": 2048, "global_batch_sequences": 32, "processes": 8, "gpu": gpu}
    model = MODELS["llama-70b"].config
    # the per-model quantities (the model built on the meta device) once, before the clock
    score(Workload(model, **kw), configs[:1], budget_bytes=80 * 10**9)
    times = []
    for _ in range(max(1, args.repeat)):
        t0 = time.process_time()
        score(Workload(model, **kw), configs, budget_bytes=80 * 10**9)
        times.append(time.process_time() - t0)
    best = min(times)
    print(f"llama-70b estimate space on 8x H100: {len(configs):,} configurations scored")
    print(
        f"CPU time: best {best:.2f} s of {len(times)} runs ({', '.join(f'{t:.2f}' for t in times)})"
    )
    print(f"per configuration: {1e6 * best / len(configs):.0f} us")
    print(f"goal under {GOAL_CPU_S:.0f} s of CPU: {'met' if best < GOAL_CPU_S else 'NOT met'}")


if __name__ == "__main__":
    main()
