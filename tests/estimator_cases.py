"""The cases the estimators' recorded outputs cover (``tests/data/estimator_outputs.json``) and
how one case's output is computed: a seeded sample of the estimate space for a small model and
of the default space for full-size ones, on several GPUs (and the CPU trial backend), process
counts, batches and variable-length data, paged optimizers priced under a budget.

``python -m tests.estimator_cases`` records the outputs the estimators give now; the test
``tests/test_estimator_outputs.py`` computes them again and compares them exactly.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import PARTS, Estimate
from autotune.estimator.gpus import GPUS
from autotune.estimator.paging import apply_budget
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.models import MODELS
from autotune.space import SearchSpace
from trials.data import Documents

FIXTURE = Path(__file__).parent / "data" / "estimator_outputs.json"
SPACES = Path(__file__).parent.parent / "search_spaces"

#: (GPU or None for the CPU trial backend, processes, sequence length, global batch, documents)
SETTINGS: list[tuple[str | None, int, int, int, list[int] | None]] = [
    ("h100", 1, 512, 16, None),
    ("h100", 8, 1024, 32, None),
    ("a100-40gb", 2, 256, 16, [32, 256]),
    ("v100", 4, 512, 16, None),
    ("rtx4090", 1, 256, 8, [16, 200]),
    ("h200", 16, 2048, 64, None),
    (None, 1, 128, 4, None),
    (None, 2, 64, 8, [8, 64]),
]

#: (model, space, analytical cases)
SAMPLES: list[tuple[str, str, int]] = [
    ("tiny-llama", "estimate.yaml", 1000),
    ("llama-7b", "default.yaml", 250),
    ("llama-70b", "default.yaml", 200),
    ("mixtral-8x7b", "default.yaml", 60),
    ("gpt2-xl", "estimate.yaml", 60),
]

#: the traced estimator's cases (tiny-llama, 128 tokens, batch 8): one trace each for the
#: plain step, DeepSpeed's, FSDP2's, adapters' and a sampled one; each of the accountings the
#: trace is combined with (ZeRO 1-3 with offload, FSDP2, LoRA, QLoRA, compile, activation
#: offload) over the trace of its kind
_PLAIN = {
    "gradient_checkpointing": "full",
    "precision": "bf16",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 2,
}
TRACED: list[tuple[dict[str, Any], str | None, int]] = [
    (_PLAIN, "h100", 1),
    ({**_PLAIN, "quantization": "nf4"}, "h100", 1),
    ({**_PLAIN, "zero_stage": 2, "offload_optimizer": "cpu"}, "h100", 4),
    ({**_PLAIN, "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}, None, 2),
    ({**_PLAIN, "zero_stage": 1}, "a100-40gb", 2),
    ({**_PLAIN, "fsdp": "full_shard"}, "h100", 8),
    ({**_PLAIN, "adapter": "lora", "lora_rank": 16, "lora_targets": "all_linear"}, "h100", 1),
    (
        {
            **_PLAIN,
            "gradient_checkpointing": "selective",
            "checkpoint_every": 2,
            "cross_entropy": "chunked",
            "activation_offload": "cpu",
            "compile": True,
        },
        None,
        1,
    ),
]


def _sample(space: SearchSpace, rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [space.sample(lambda _name, choices: rng.choice(choices)) for _ in range(n)]


def cases() -> list[dict[str, Any]]:
    """Every case, in order: its method, model, config and setting."""
    out: list[dict[str, Any]] = []
    rng = random.Random(20261207)
    for model, space_file, n in SAMPLES:
        space = SearchSpace.load(SPACES / space_file)
        for config in _sample(space, rng, n):
            gpu, nproc, seq, gbs, docs = rng.choice(SETTINGS)
            out.append(
                {
                    "method": "analytical",
                    "model": model,
                    "config": config,
                    "gpu": gpu,
                    "nproc": nproc,
                    "seq_len": seq,
                    "global_batch_size": gbs,
                    "documents": docs,
                }
            )
    for config, gpu, nproc in TRACED:
        out.append(
            {
                "method": "traced",
                "model": "tiny-llama",
                "config": config,
                "gpu": gpu,
                "nproc": nproc,
                "seq_len": 128,
                "global_batch_size": 8,
                "documents": None,
            }
        )
    return out


def output(case: dict[str, Any], traced: TracedEstimator) -> list[Any]:
    """One case's estimate as a compact list: peak, the parts of the peak (``PARTS`` order),
    host bytes by part, step time, tokens/s, step time by part, notes; and under a budget of
    three quarters of that peak (a paged optimizer's states spill) the same again; a case the
    GPU cannot price, the error's name."""
    estimator = traced if case["method"] == "traced" else AnalyticalEstimator()
    gpu = GPUS[case["gpu"]] if case["gpu"] else None
    docs = Documents.of(case["documents"])
    model_config = MODELS[case["model"]].config
    try:
        workload = Workload(
            model_config=model_config,
            seq_len_tokens=case["seq_len"],
            global_batch_sequences=case["global_batch_size"],
            processes=case["nproc"],
            gpu=gpu,
            documents=docs,
        )
        est = estimator.estimate(workload, dict(case["config"]))
    except ArithmeticError as e:  # a precision the GPU has no rate for (bf16 on a V100)
        return ["error", type(e).__name__]
    row = _row(est)
    if apply_budget(est, workload, case["config"], est.peak_bytes * 3 // 4):
        row.append(_row(est))
    return row


def _row(est: Estimate) -> list[Any]:
    return [
        est.peak_bytes,
        [est.breakdown.get(k, 0) for k in PARTS],
        sorted(est.host_breakdown.items()),
        est.step_time_s,
        est.tokens_per_s,
        sorted(est.time_breakdown.items()),
        est.gpu,
        list(est.notes),
    ]


def outputs(all_cases: list[dict[str, Any]]) -> list[list[Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        traced = TracedEstimator(cache=Path(tmp))
        # through JSON, as the fixture stores them (tuples become lists)
        return json.loads(json.dumps([output(c, traced) for c in all_cases]))


def main() -> None:
    all_cases = cases()
    data = {"cases": all_cases, "outputs": outputs(all_cases)}
    FIXTURE.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{len(all_cases)} cases, {FIXTURE.stat().st_size} bytes -> {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    main()
