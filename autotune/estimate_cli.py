"""The estimator in the CLI: ``autotune estimate``, the ``estimate`` backend of ``run``, and the
pre-screen of real GPU trials."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import click
import optuna
import yaml
from rich.console import Console
from rich.table import Table

from autotune.errors import UserError
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import PARTS, Estimate
from autotune.estimator.gpus import GPUS, GpuSpec, default_gpu, gpu_spec
from autotune.estimator.runner import EstimateRunner, PrescreenRunner
from autotune.estimator.traced import TracedEstimator
from autotune.hardware import Hardware
from autotune.models import resolve_model
from autotune.runner import TrialRunner
from autotune.space import SearchSpace
from autotune.study import StudySettings
from autotune.units import format_size, parse_size

ESTIMATE_SPACE = "estimate.yaml"
#: trials of an estimate study: each is instant, so many more than real ones
ESTIMATE_TRIALS = 60
PRESCREEN_MARGIN = 0.25


def target_gpu(name: str | None, budget_bytes: int) -> GpuSpec:
    return gpu_spec(name) if name else default_gpu(budget_bytes)


def hardware_for(gpu: GpuSpec, nproc: int = 1) -> Hardware:
    """The target GPU's machine, with its CUDA packages (and DeepSpeed) assumed installed."""
    facts: dict[str, Any] = {
        "backend": "cuda",
        "cuda_capability": gpu.sm,
        "gpu_count": nproc,
        **{f.name: True for f in fields(Hardware) if f.name.startswith("has_")},
    }
    return Hardware(**{k: v for k, v in facts.items() if k in {f.name for f in fields(Hardware)}})


def estimate_space() -> SearchSpace:
    from importlib import resources

    text = resources.files("search_spaces").joinpath(ESTIMATE_SPACE).read_text()
    return SearchSpace.from_dict(yaml.safe_load(text), ESTIMATE_SPACE)


def runner_for(settings: StudySettings, real: TrialRunner) -> TrialRunner:
    """Predictions for ``estimate``; on a GPU, real trials behind the estimator's pre-screen."""
    if settings.backend == "estimate":
        return EstimateRunner(AnalyticalEstimator(), gpu_spec(settings.target_gpu or "rtx4090"))
    if settings.backend == "cuda":
        return PrescreenRunner(real, AnalyticalEstimator(), PRESCREEN_MARGIN)
    return real


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
    return table


def confirm_winner(study: optuna.Study, settings: StudySettings, console: Console) -> None:
    """After an estimate study: the winner's traced breakdown next to the analytical one."""
    from autotune.display import describe
    from autotune.selector import select

    sel = select(study)
    if sel.winner is None:
        return
    gpu = gpu_spec(settings.target_gpu)
    if settings.nodes > 1:  # ZeRO's collectives cross the nodes' network
        gpu = gpu.spanning(settings.nodes, settings.nproc // settings.nodes)
    kw: dict[str, Any] = {
        "seq_len": settings.seq_len,
        "global_batch_size": settings.global_batch_size,
        "nproc": settings.nproc,
        "gpu": gpu,
    }
    config = sel.winner.config
    an = AnalyticalEstimator().estimate(settings.model_config, config, **kw)
    tr = TracedEstimator().estimate(settings.model_config, config, **kw)
    console.print(
        breakdown_table(
            [("analytical", an), ("traced", tr)],
            settings.budget_bytes,
            f"trial {sel.winner.number}",
        )
    )
    console.print(
        f"[bold green]predicted best for {gpu.name}[/bold green]: {describe(config)}: "
        f"peak {format_size(tr.peak_bytes)} (traced; analytical {format_size(an.peak_bytes)}) "
        f"of {format_size(settings.budget_bytes)}, {tr.tokens_per_s:,.0f} tokens/s"
    )
    for note in tr.notes:
        console.print(f"[dim]{note}[/dim]")


def _load_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError:
        raise UserError(f"config file {path} is not valid YAML/JSON") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must be a mapping of dimension: choice")
    if isinstance(data.get("config"), dict):  # a trial exported by `autotune show --json`
        data = data["config"]
    return data


@click.command("estimate")
@click.option("--model", required=True, help="Registered model name or a path to a config.json.")
@click.option("--budget", required=True, help="Memory budget per GPU, e.g. 24GB.")
@click.option(
    "--gpu", default=None, help=f"Target GPU (default: by budget). One of: {', '.join(GPUS)}."
)
@click.option("--config", "config_path", default=None, help="YAML/JSON file of one configuration.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Nodes the --nproc GPUs span (ZeRO's collectives then cross the nodes' network).",
)
@click.option("--seq-len", type=click.IntRange(min=8), default=None)
@click.option("--global-batch-size", type=click.IntRange(min=1), default=None)
@click.option("--top", type=click.IntRange(min=1), default=3, show_default=True)
def estimate_cmd(
    model: str,
    budget: str,
    gpu: str | None,
    config_path: str | None,
    nproc: int,
    nodes: int,
    seq_len: int | None,
    global_batch_size: int | None,
    top: int,
) -> None:
    """Predict peak memory and speed: one configuration, or the best few that fit."""
    from autotune.display import describe

    console = Console(width=110)
    budget_bytes = parse_size(budget)
    entry = resolve_model(model)
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
        config = _load_config(config_path)
        space = estimate_space()
        known = {d.name for d in space.dimensions}
        unknown = sorted(set(config) - known)
        if unknown:
            raise UserError(f"config: unknown dimension '{unknown[0]}' (known: {', '.join(known)})")
        rows = [
            ("analytical", analytical.estimate(entry.config, config, **kw)),
            ("traced", traced.estimate(entry.config, config, **kw)),
        ]
        console.print(breakdown_table(rows, budget_bytes, f"{entry.name}: {describe(config)}"))
        for note in rows[1][1].notes:
            console.print(f"[dim]{note}[/dim]")
        return
    space = estimate_space().resolve(kw["global_batch_size"], hardware_for(spec, nproc))
    scored = []
    for config in space.grid():
        est = analytical.estimate(entry.config, config, **kw)
        if est.peak_bytes <= budget_bytes:
            scored.append((est.tokens_per_s, est.peak_bytes, config))
    console.print(
        f"{entry.name} on {spec.name} x{nproc}, budget {format_size(budget_bytes)}: "
        f"{len(scored)} of {len(space.grid())} configurations predicted to fit (analytical)"
    )
    if not scored:
        raise UserError(f"no configuration of {entry.name} is predicted to fit {budget}")
    scored.sort(key=lambda x: (-x[0], x[1]))
    # configurations the model can't tell apart (e.g. two kernels keeping the same tensors)
    # are shown once: the first in the space's order
    distinct: dict[tuple[int, int], dict[str, Any]] = {}
    for tps, peak, config in scored:
        distinct.setdefault((round(tps), peak), config)
    rows = []
    for i, config in enumerate(list(distinct.values())[:top], 1):
        est = traced.estimate(entry.config, config, **kw)
        rows.append((f"#{i}", est))
        console.print(f"#{i}: {describe(config)}")
    console.print(breakdown_table(rows, budget_bytes, f"predicted for {spec.name} (traced)"))
    console.print(json.dumps(next(iter(distinct.values()))))
