"""How good are the estimators? Real CPU trials vs the traced and analytical predictions.

    python benchmarks/estimator_accuracy.py                 # tiny-llama and small-llama, measured
    python benchmarks/estimator_accuracy.py --model llama-7b --no-measure   # traced vs analytical
    python benchmarks/estimator_accuracy.py --measured-table  # the search benchmark's 192 trials

For each configuration it runs the real trial job (``trials.job.run_trial``, CPU tracker: live
tensor bytes from model construction through two optimizer steps), the traced estimator (the
same loop on fake tensors) and the analytical one, and prints the peaks and the errors:
traced vs measured, analytical vs traced. Not a test: it takes minutes. ``--measured-table``
instead prices every row of the search benchmark's measured reality (192 real DeepSpeed/CPU
trials, ``benchmarks/realities/measured_mini_llama.json``) with the analytical estimator and
prints its errors per ZeRO stage and the worst rows (a second).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from trials.job import run_trial
from trials.spec import TrialSpec

MIB = 2**20

BASE = {
    "gradient_checkpointing": "off",
    "precision": "fp32",
    "attention": "sdpa",
    "optimizer": "adamw",
}
#: a spread over every dimension the trial job runs on a CPU
CONFIGS: list[dict[str, Any]] = [
    {"micro_batch_size": 1},
    {"micro_batch_size": 4},
    {"micro_batch_size": 4, "precision": "bf16"},
    {"micro_batch_size": 4, "attention": "eager"},
    {"micro_batch_size": 2, "attention": "eager", "precision": "bf16"},
    {"micro_batch_size": 4, "gradient_checkpointing": "full"},
    {"micro_batch_size": 4, "gradient_checkpointing": "full", "precision": "bf16"},
    {"micro_batch_size": 4, "gradient_checkpointing": "selective", "checkpoint_every": 2},
    {"micro_batch_size": 2, "optimizer": "adafactor"},
    {"micro_batch_size": 2, "optimizer": "lion", "precision": "bf16"},
]
#: (seq_len, global batch) per model: small enough for 2 CPU cores
SHAPES = {"tiny-llama": (128, 8), "small-llama": (256, 4), "llama-7b": (2048, 8)}


def pct(a: float, b: float) -> float:
    return 100.0 * (a - b) / b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="default: tiny-llama and small-llama")
    ap.add_argument("--no-measure", action="store_true", help="traced vs analytical only")
    ap.add_argument(
        "--measured-table",
        action="store_true",
        help="the analytical estimator against the search benchmark's measured table",
    )
    args = ap.parse_args(argv)
    if args.measured_table:
        return measured_table()
    models = args.model or ["tiny-llama", "small-llama"]
    traced, analytical = TracedEstimator(use_cache=False), AnalyticalEstimator()
    trace_err: list[float] = []
    anal_err: list[float] = []
    print(
        "| model | config | measured MiB | traced MiB | analytical MiB | traced vs measured "
        "| analytical vs traced |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in models:
        entry = MODELS[name]
        seq, gbs = SHAPES.get(name, (entry.seq_len, entry.global_batch_size))
        for extra in CONFIGS:
            config = {**BASE, **extra}
            kw = {"seq_len_tokens": seq, "global_batch_sequences": gbs}
            t0 = time.perf_counter()
            tr = traced.estimate(Workload(entry.config, **kw), config).peak_bytes
            an = analytical.estimate(Workload(entry.config, **kw), config).peak_bytes
            measured = "-"
            e_tr = ""
            if not args.no_measure:
                spec = TrialSpec(entry.config, config, seq, gbs, measured_steps=1, lr=3e-3)
                result = run_trial(spec)
                if result.status != "ok":
                    print(f"| {name} | {_short(config)} | {result.status} | | | | |")
                    continue
                measured = f"{result.peak_bytes / MIB:,.1f}"
                trace_err.append(pct(tr, result.peak_bytes))
                e_tr = f"{trace_err[-1]:+.1f}%"
            anal_err.append(pct(an, tr))
            print(
                f"| {name} | {_short(config)} | {measured} | {tr / MIB:,.1f} | {an / MIB:,.1f} "
                f"| {e_tr} | {anal_err[-1]:+.1f}% |",
                flush=True,
            )
            _ = time.perf_counter() - t0
    for label, errs in (("traced vs measured", trace_err), ("analytical vs traced", anal_err)):
        if errs:
            absolute = [abs(e) for e in errs]
            print(
                f"{label}: median |error| {statistics.median(absolute):.1f}%, "
                f"max {max(absolute):.1f}% over {len(errs)} configs"
            )
    return 0


def measured_table(worst: int = 6) -> int:
    from benchmarks.realities.measure import DEFAULT_OUT

    table = json.loads(DEFAULT_OUT.read_text())
    analytical = AnalyticalEstimator()
    rows: list[tuple[float, dict[str, Any]]] = []
    for row in table["rows"]:
        predicted = analytical.estimate(
            Workload(
                table["model_config"],
                seq_len_tokens=table["seq_len"],
                global_batch_sequences=table["global_batch_size"],
                processes=1,
            ),
            row["config"],
        ).peak_bytes
        rows.append((pct(predicted, row["peak_bytes"]), row["config"]))
    print("| ZeRO stage | rows | median abs error | most under | most over |")
    print("|---|---:|---:|---:|---:|")
    for stage in sorted({int(c.get("zero_stage", 0)) for _, c in rows}):
        errs = [e for e, c in rows if int(c.get("zero_stage", 0)) == stage]
        print(
            f"| {stage} | {len(errs)} | {statistics.median(abs(e) for e in errs):.2f}% "
            f"| {min(errs):+.1f}% | {max(errs):+.1f}% |"
        )
    absolute = [abs(e) for e, _ in rows]
    print(
        f"analytical vs measured: median |error| {statistics.median(absolute):.2f}%, "
        f"max {max(absolute):.1f}% over {len(rows)} trials"
    )
    shown = ("zero_stage", "precision", "gradient_checkpointing", "micro_batch_size")
    offloads = ("offload_optimizer", "offload_param")
    for err, config in sorted(rows, key=lambda r: -abs(r[0]))[:worst]:
        described = [f"{k}={config.get(k)}" for k in shown]
        described += [k for k in offloads if config.get(k, "none") != "none"]
        print(f"  {err:+.1f}%  {' '.join(described)}")
    return 0


def _short(config: dict[str, Any]) -> str:
    parts = [f"mb={config['micro_batch_size']}", config["precision"], config["attention"]]
    ckpt = config["gradient_checkpointing"]
    if ckpt != "off":
        parts.append(
            f"ckpt/{ckpt}" + (f"/k={config['checkpoint_every']}" if ckpt == "selective" else "")
        )
    if config["optimizer"] != "adamw":
        parts.append(config["optimizer"])
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
