"""``autotune estimate`` and what the console prints of an estimate study (the banner, the
analytical-vs-traced breakdown, the best of each class); the backend itself is
``autotune/estimate_backend.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import optuna
from rich.console import Console
from rich.table import Table

from autotune.errors import UserError
from autotune.estimate_backend import (
    HOST_FRONTIER,
    estimate_space,
    frontier_json,
    hardware_for,
    host_budget,
    study_gpu,
    target_gpu,
)
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import PARTS, Estimate
from autotune.estimator.exhaustive import (
    ClassBest,
    best_per_class,
    headline,
    host_frontier,
    score,
)
from autotune.estimator.gpus import GPUS, GpuSpec
from autotune.estimator.paging import apply_budget
from autotune.estimator.speed import MODEL_ERROR
from autotune.estimator.traced import TracedEstimator
from autotune.models import check_seq_len, resolve_model
from autotune.study import StudySettings
from autotune.terminal import make_console, printable
from autotune.units import format_size, parse_size
from autotune.yaml_limits import load_yaml


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
    training (exact or mixed precision) - with its traced breakdown next to the analytical one."""
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
        console.print("[yellow]no full-training (exact or mixed) configuration fits[/yellow]")
        return
    kw: dict[str, Any] = {
        "seq_len": settings.seq_len,
        "global_batch_size": settings.global_batch_size,
        "nproc": settings.nproc,
        "gpu": gpu,
        "documents": settings.trial_documents(),  # variable-length data: as the scores had it
    }
    config = head.best.config
    an = head.best.estimate
    tr = TracedEstimator().estimate(settings.model_config, config, **kw)
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


def _load_config(path: str, global_batch_size: int) -> dict[str, Any]:
    """One configuration: each value a plain choice; the micro-batch divides the batch (per
    process), as a trial requires."""
    data = load_yaml(Path(path), "config")
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must be a mapping of dimension: choice")
    if isinstance(data.get("config"), dict):  # a trial exported by `autotune show --json`
        data = data["config"]
    for key, value in data.items():
        if not isinstance(value, str | int | float | bool) or value is None:
            raise UserError(f"config: {printable(str(key))} is {type(value).__name__}, "
                            "not one choice")  # fmt: skip
    micro = data.get("micro_batch_size")
    if micro is not None:
        if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
            raise UserError(f"config: micro_batch_size {printable(repr(micro))}: a whole "
                            "number >= 1")  # fmt: skip
        if global_batch_size % micro:
            raise UserError(
                f"config: micro_batch_size {micro} does not divide the global batch "
                f"{global_batch_size} (per process); choose a divisor or --global-batch-size"
            )
    return data


@click.command("estimate")
@click.option("--model", required=True, help="Registered model name or a path to a config.json.")
@click.option("--budget", required=True, help="Memory budget per GPU, e.g. 24GB.")
@click.option(
    "--gpu", default=None, help=f"Target GPU (default: by budget). One of: {', '.join(GPUS)}."
)
@click.option("--config", "config_path", default=None, help="YAML/JSON file of one configuration.")
@click.option("--nproc", type=click.IntRange(min=1, max=MAX_GPUS), default=1, show_default=True)
@click.option(
    "--nodes",
    type=click.IntRange(min=1, max=1024),
    default=1,
    show_default=True,
    help="Nodes the --nproc GPUs span (ZeRO's collectives then cross the nodes' network).",
)
@click.option("--seq-len", type=click.IntRange(min=8, max=MAX_SEQ_LEN), default=None)
@click.option("--global-batch-size", type=click.IntRange(min=1, max=MAX_BATCH), default=None)
@click.option(
    "--host-memory",
    default=None,
    help="Host RAM per machine the configuration may use (default: unlimited, always shown).",
)
@click.option(
    "--trace/--no-trace",
    default=False,
    show_default=True,
    help="Also trace the answer on fake tensors (about 10 s for a 7B model, cached).",
)
def estimate_cmd(
    model: str,
    budget: str,
    gpu: str | None,
    config_path: str | None,
    nproc: int,
    nodes: int,
    seq_len: int | None,
    global_batch_size: int | None,
    host_memory: str | None,
    trace: bool,
) -> None:
    """Predict peak memory, host memory and speed: one configuration, or the best of each
    fidelity class over every configuration of the space."""
    import time

    from autotune.display import describe

    console = make_console()
    console.width = 110
    budget_bytes = parse_size(budget)
    host_bytes = host_budget(host_memory, "estimate")
    entry = resolve_model(model)
    check_seq_len(seq_len, entry.config, entry.name)
    if nproc % nodes:
        raise UserError(f"--nproc {nproc} GPUs do not split evenly over --nodes {nodes}")
    spec = target_gpu(gpu, budget_bytes)
    if nodes > 1:
        spec = spec.spanning(nodes, nproc // nodes)
    kw: dict[str, Any] = {
        "seq_len": seq_len or entry.seq_len,
        "global_batch_size": global_batch_size or entry.global_batch_size,
        "nproc": nproc,
        "gpu": spec,
    }
    analytical, traced = AnalyticalEstimator(), TracedEstimator()
    if config_path:
        config = _load_config(config_path, kw["global_batch_size"])
        space = estimate_space()
        known = {d.name for d in space.dimensions}
        unknown = sorted(set(config) - known)
        if unknown:
            raise UserError(f"config: unknown dimension '{unknown[0]}' (known: {', '.join(known)})")
        rows = [
            ("analytical", analytical.estimate(entry.config, config, **kw)),
            ("traced", traced.estimate(entry.config, config, **kw)),
        ]
        for _, est in rows:  # a paged optimizer's states beyond the budget on the host
            apply_budget(est, entry.config, config, budget_bytes, spec)
        console.print(breakdown_table(rows, budget_bytes, f"{entry.name}: {describe(config)}"))
        for note in rows[1][1].notes:
            console.print(f"[dim]{note}[/dim]")
        return
    t0 = time.perf_counter()
    configs = estimate_space().resolve(kw["global_batch_size"], hardware_for(spec, nproc)).grid()
    scored = score(
        entry.config, configs, budget_bytes=budget_bytes, host_budget_bytes=host_bytes, **kw
    )
    fitting = sum(s.fits for s in scored)
    layout = f"{nodes} nodes x{nproc // nodes}" if nodes > 1 else f"x{nproc}"
    host_label = format_size(host_bytes) if host_bytes is not None else "unlimited"
    console.print(
        f"{entry.name} on {spec.name} {layout}, budget {format_size(budget_bytes)}, host memory "
        f"{host_label}: {fitting} of {len(scored)} configurations predicted to fit (every "
        f"configuration scored, analytical, {time.perf_counter() - t0:.1f} s)"
    )
    if not fitting:
        raise UserError(f"no configuration of {entry.name} is predicted to fit {budget}")
    per_class = best_per_class(scored)
    console.print(f"best per fidelity class (speeds within {MODEL_ERROR:.0%} are ties):")
    for line in class_lines(per_class, budget_bytes):
        console.print(line)
    for line in frontier_lines(frontier_json(host_frontier(scored))):
        console.print(line, markup=False)
    head = headline(per_class)
    rows = []
    if head is not None:
        if trace:
            rows.append(
                (f"{head.cls} (traced)", traced.estimate(entry.config, head.best.config, **kw))
            )
        rows.append((f"{head.cls} (analytical)", head.best.estimate))
        console.print(
            f"[bold green]predicted best full training ({head.cls})[/bold green]: "
            f"{describe(head.best.config)}"
        )
    if "adapters" in per_class:
        rows.append(("adapters", per_class["adapters"].best.estimate))
    console.print(breakdown_table(rows, budget_bytes, f"predicted for {spec.name}"))
    if head is not None:
        for note in rows[0][1].notes:
            console.print(f"[dim]{note}[/dim]")
        console.print(json.dumps(head.best.config))
