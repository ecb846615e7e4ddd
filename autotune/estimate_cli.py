"""What the console prints of estimates (the banner, the analytical-vs-traced breakdown, the
best of each class), for ``autotune estimate`` (``autotune/commands/estimate.py``) and an
estimate study; the backend itself is ``autotune/estimate_backend.py``."""

from __future__ import annotations

from typing import Any

import optuna
from rich.console import Console
from rich.table import Table

from autotune.estimate_backend import (
    HOST_FRONTIER,
    study_gpu,
    study_workload,
)
from autotune.estimator.base import PARTS, Estimate
from autotune.estimator.exhaustive import (
    ClassBest,
    headline,
)
from autotune.estimator.gpus import GpuSpec
from autotune.estimator.speed import MODEL_ERROR
from autotune.estimator.traced import TracedEstimator
from autotune.study import StudySettings
from autotune.units import format_size


def banner(model: str, n_params: int, gpu: GpuSpec) -> str:
    return (
        f"no GPU here and {model} ({n_params / 1e9:.1f}B params) is too big for CPU trials: "
        f"predicting for {gpu.name} ({format_size(gpu.memory_bytes)}) with --backend estimate; "
        "numbers are predicted, not measured, and there is no loss check"
    )


def breakdown_table(rows: list[tuple[str, Estimate]], budget: int, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for label, _ in rows:
        table.add_column(label, justify="right")
    for part in (*PARTS, "peak"):
        cells = [
            format_size(e.peak_bytes if part == "peak" else e.breakdown.get(part, 0))
            for _, e in rows
        ]
        table.add_row(part, *cells)
    table.add_row(
        "fits", *[("yes" if e.peak_bytes <= budget else "[red]no[/red]") for _, e in rows]
    )
    table.add_row("tokens/s", *[f"{e.tokens_per_s:,.0f}" for _, e in rows])
    for part in HOST_PARTS:
        table.add_row(
            f"host: {part}", *[format_size(e.host_breakdown.get(part, 0)) for _, e in rows]
        )
    table.add_row("host memory", *[format_size(e.host_bytes) for _, e in rows])
    return table


#: the parts of the host memory prediction, as ``states.model_states`` names them
#: limits of one input (docs/guide/limits.md): GPUs of one plan, tokens of one sequence or
#: document, sequences of one global batch
MAX_GPUS = 131_072
MAX_SEQ_LEN = 4_194_304
MAX_BATCH = 2**20
HOST_PARTS = ("offloaded states", "model copy at load", "pinned buffers and slack")


def class_lines(per_class: dict[str, ClassBest], budget: int) -> list[str]:
    """One line per fidelity class: its best configuration, memory, speed, and its ties."""
    from autotune.display import describe

    lines = []
    for cls, cb in per_class.items():
        e = cb.best.estimate
        tie = f" (+{len(cb.ties)} within {MODEL_ERROR:.0%}: a tie)" if cb.ties else ""
        lines.append(
            f"  {cls:<15} {describe(cb.best.config)}: peak {format_size(e.peak_bytes)} of "
            f"{format_size(budget)}, host {format_size(e.host_bytes)}, "
            f"{e.tokens_per_s:,.0f} tokens/s{tie}"
        )
    return lines


def frontier_lines(steps: list[dict[str, Any]]) -> list[str]:
    """What more host memory buys: one line per host memory size at which the best full
    training changes (``estimate_backend.frontier_json``'s entries)."""
    from autotune.display import describe

    if not steps:
        return []
    lines = ["host memory and the best full training (each size at which the answer changes):"]
    for step in steps:
        lines.append(
            f"  with {step['host_size_gb']} GB of host RAM: {describe(step['config'])} "
            f"({step['class']}): peak {format_size(step['peak_bytes'])}, host "
            f"{format_size(step['host_bytes'])}, {step['tokens_per_s']:,.0f} tokens/s"
        )
    return lines


def confirm_winner(
    study: optuna.Study,
    settings: StudySettings,
    console: Console,
    per_class: dict[str, ClassBest],
) -> None:
    """After an estimate study: the best per fidelity class, and the answer - the best full
    training (``exhaustive.HEADLINE_CLASSES``: fp32, mixed precision or pure bf16 / 8-bit
    states) - with its traced breakdown next to the analytical one."""
    from autotune.display import describe

    gpu = study_gpu(settings)
    budget = settings.budget_bytes
    console.print(f"best per fidelity class (speeds within {MODEL_ERROR:.0%} are ties):")
    for line in class_lines(per_class, budget):
        console.print(line)
    head = headline(per_class)
    for line in frontier_lines(study.user_attrs.get(HOST_FRONTIER, [])):
        console.print(line, markup=False)
    if head is None:
        console.print(
            "[yellow]no full-training configuration (fp32, mixed precision or pure bf16) "
            "fits[/yellow]"
        )
        return
    config = head.best.config
    an = head.best.estimate
    # variable-length data: as the scores had it
    tr = TracedEstimator().estimate(study_workload(settings), config)
    console.print(breakdown_table([("analytical", an), ("traced", tr)], budget, head.cls))
    console.print(
        f"[bold green]predicted best for {gpu.name}[/bold green] (full training, {head.cls}): "
        f"{describe(config)}: peak {format_size(tr.peak_bytes)} (traced; analytical "
        f"{format_size(an.peak_bytes)}) of {format_size(budget)}, host memory "
        f"{format_size(an.host_bytes)}, {an.tokens_per_s:,.0f} tokens/s"
    )
    if "adapters" in per_class:
        a = per_class["adapters"].best
        console.print(
            f"adapters (a different training problem: frozen base weights): {describe(a.config)}:"
            f" peak {format_size(a.estimate.peak_bytes)}, {a.estimate.tokens_per_s:,.0f} tokens/s"
        )
    for note in tr.notes:
        console.print(f"[dim]{note}[/dim]")
