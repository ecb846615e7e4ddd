"""``autotune estimate``: predicted peak memory, host memory and speed, without a GPU: one
configuration, or the best of each fidelity class over every configuration of the space."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from autotune.errors import UserError
from autotune.estimate_backend import (
    estimate_space,
    frontier_json,
    hardware_for,
    host_budget,
    target_gpu,
)
from autotune.estimate_cli import (
    MAX_BATCH,
    MAX_GPUS,
    MAX_SEQ_LEN,
    breakdown_table,
    class_lines,
    frontier_lines,
)
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.exhaustive import best_per_class, headline, host_frontier, score
from autotune.estimator.gpus import GPUS
from autotune.estimator.paging import apply_budget
from autotune.estimator.speed import MODEL_ERROR
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.models import check_seq_len, resolve_model
from autotune.terminal import make_console, printable
from autotune.units import format_size, parse_size
from autotune.yaml_limits import load_yaml
from trials.techniques.micro_batch import micro_batch_problem


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
    problem = micro_batch_problem(data, global_batch_size)
    if problem is not None:
        raise UserError(printable(problem))
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
    help="Host RAM per machine the configuration may use (default: the system memory of the "
    "GPU's server where its row gives one, e.g. 2 TiB for a DGX H100; else unlimited; always "
    "shown).",
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
    entry = resolve_model(model)
    check_seq_len(seq_len, entry.config, entry.name)
    if nproc % nodes:
        raise UserError(f"--nproc {nproc} GPUs do not split evenly over --nodes {nodes}")
    gpu_row = target_gpu(gpu, budget_bytes)
    host_bytes = host_budget(host_memory, "estimate", gpu_row)  # the target's server memory
    workload = Workload(
        model_config=entry.config,
        seq_len_tokens=seq_len or entry.seq_len,
        global_batch_sequences=global_batch_size or entry.global_batch_size,
        processes=nproc,
        nodes=nodes,
        gpu=gpu_row,
    )
    spec = workload.device
    assert spec is not None
    analytical, traced = AnalyticalEstimator(), TracedEstimator()
    if config_path:
        config = _load_config(config_path, workload.global_batch_sequences)
        space = estimate_space()
        known = {d.name for d in space.dimensions}
        unknown = sorted(set(config) - known)
        if unknown:
            raise UserError(f"config: unknown dimension '{unknown[0]}' (known: {', '.join(known)})")
        rows = [
            ("analytical", analytical.estimate(workload, config)),
            ("traced", traced.estimate(workload, config)),
        ]
        for _, est in rows:  # a paged optimizer's states beyond the budget on the host
            apply_budget(est, workload, config, budget_bytes)
        console.print(breakdown_table(rows, budget_bytes, f"{entry.name}: {describe(config)}"))
        for note in rows[1][1].notes:
            console.print(f"[dim]{note}[/dim]")
        return
    t0 = time.perf_counter()
    configs = (
        estimate_space().resolve(workload.global_batch_sequences, hardware_for(spec, nproc)).grid()
    )
    scored = score(workload, configs, budget_bytes=budget_bytes, host_budget_bytes=host_bytes)
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
            rows.append((f"{head.cls} (traced)", traced.estimate(workload, head.best.config)))
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
