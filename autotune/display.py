"""What a person sees: a progress bar over trials, a results table, the winner."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.selector import GROUPS, Row, Selection, class_summary
from autotune.units import format_size
from trials.techniques import TECHNIQUES

STATUS_STYLE = {"ok": "green", "oom": "red", "failed": "magenta", "running": "yellow"}


def _peak_cell(row: Row) -> str:
    if not row.peak_bytes:
        return "-"
    if row.rank_peaks and len(row.rank_peaks) > 1:  # per rank: the worst, then each rank's
        each = "/".join(f"{p / 2**20:.0f}" for p in row.rank_peaks)
        return f"{format_size(row.peak_bytes)} ({each} MiB)"
    return format_size(row.peak_bytes)


def _build_cell(row: Row) -> str:
    """The construction peak (model built and wrapped, before the first step)."""
    return format_size(row.construction_peak_bytes) if row.construction_peak_bytes else "-"


def status_text(row: Row) -> str:
    """The status with what sets it apart: a predicted OOM (never run), the rank that ran out,
    a run without budget stopped by the card, a deterministic failure (never run again)."""
    text = row.status
    if row.status == "oom" and row.pruned_by_estimate:
        text = "oom (predicted)"
    elif row.status == "oom" and row.capped:
        text = "oom (card)"
    elif row.status == "oom" and row.oom_rank is not None and row.rank_peaks:
        text = f"oom (rank {row.oom_rank})"
    return text


def _short(dimension: str, value: Any) -> str:
    """A choice as the table's config column shows it (its technique's ``Knob.short``)."""
    knob = TECHNIQUES.knob(dimension)
    if knob is None or knob.short is None:
        return f"{dimension}={value}"
    return knob.short(value)


def describe(config: dict[str, Any]) -> str:
    parts = [_short(k, v) for k, v in config.items()]
    return " ".join(p for p in parts if p)


def _loss_cell(row: Row) -> str:
    """The stored verdict and how it was reached: ``ref`` (per step against the reference),
    ``probe`` (proxy, with the seed-noise band), or why there is none."""
    v = row.verdict
    if row.role == "reference":
        return "reference"
    if v is None:
        return "-"
    if v.via == "none":
        short = {"adapters": "adapters", "exact": "no ref"}.get(row.fidelity, "no probe")
        return f"[dim]{short}[/dim]"
    assert v.regression is not None
    if v.via == "reference":
        cell = f"ref {v.regression:.0e}"
    else:
        noise = f" ±{v.noise * 100:.2f}%" if v.noise is not None else ""
        cell = f"{v.regression * 100:+.2f}%{noise} probe"
    if v.ok is False:
        return f"[red]{cell} ✗[/red]"
    return cell


def results_table(sel: Selection, title: str = "trials") -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("#", justify="right")
    table.add_column("config", overflow="fold", max_width=40)
    table.add_column("class")
    table.add_column("status")
    table.add_column("build", justify="right")
    table.add_column("peak", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("loss", justify="right")
    host = any(r.host_peak_bytes for r in sel.rows)  # studies recorded before it have none
    if host:
        table.add_column("host", justify="right")
    for r in sel.rows:
        style = STATUS_STYLE.get(r.status, "")
        status = f"[{style}]{status_text(r)}[/{style}]" if style else status_text(r)
        if r.duplicate_of is not None:
            status += f" (=#{r.duplicate_of})"
        if r.retry_of is not None:
            status += f" (retry of #{r.retry_of})"
        if r.recovered_from is not None:
            status += f" (measured for #{r.recovered_from})"
        mark = " ★" if sel.winner is not None and r.number == sel.winner.number else ""
        table.add_row(
            f"{r.number}{mark}",
            describe(r.config),
            r.fidelity,
            status,
            _build_cell(r),
            _peak_cell(r),
            f"{r.tokens_per_s:,.0f}" if r.status == "ok" else "-",
            _loss_cell(r),
            *([format_size(r.host_peak_bytes) if r.host_peak_bytes else "-"] if host else []),
        )
    return table


def print_failures(console: Console, rows: list[Row]) -> None:
    """Why each failed trial failed, with the last line of its job's stderr."""
    retried = {r.retry_of: r.number for r in rows if r.retry_of is not None}
    kept = {r.recovered_from: r.number for r in rows if r.recovered_from is not None}
    for r in rows:
        if r.status != "failed":
            continue
        again = f"; run again as #{retried[r.number]}" if r.number in retried else ""
        if r.number in kept:
            again += f"; its measurement is kept as #{kept[r.number]}"
        console.print(f"[magenta]#{r.number} failed[/magenta]: {escape(r.error)}{again}")
        last = next((ln for ln in reversed(r.stderr_tail.splitlines()) if ln.strip()), "")
        if last:
            console.print(f"    stderr: {last.strip()}", style="dim", markup=False)


#: ladder cells shown in the terminal, with their header
LADDER_HEADERS = {
    "step": "step",
    "adds": "adds",
    "peak": "peak",
    "peak_change": "Δ peak",
    "alone": "alone",
    "tok/s": "tok/s",
    "speed_change": "Δ tok/s",
    "loss": "loss",
    "trial": "trial",
}


def ladder_table(cells: list[dict[str, str]], budget_bytes: int) -> Table:
    """The ablation ladder, cumulative: each rung keeps the ones above; the changes are against
    the rung below, ``alone`` is the same technique's saving on the baseline alone."""
    table = Table(
        title=f"ablation ladder (budget {format_size(budget_bytes)})",
        title_justify="left",
        expand=False,
    )
    for key, header in LADDER_HEADERS.items():
        table.add_column(
            header,
            justify="left" if key in ("adds", "trial") else "right",
            overflow="fold",
            max_width=24 if key == "adds" else None,
        )
    for cell in cells:
        values = dict(cell)
        if cell.get("fits") == "no":
            values["peak"] = f"[red]{cell['peak']}[/red]"
        elif cell.get("fits") == "yes":
            values["peak"] = f"[green]{cell['peak']}[/green]"
        if "estimated" in cell.get("trial", ""):
            values["trial"] = f"[cyan]{cell['trial']}[/cyan]"
        table.add_row(*(values[k] for k in LADDER_HEADERS))
    return table


# --- the answer a person reads first -------------------------------------------------------------


def _memory_words(row: Row) -> str:
    """The device peak, then the host: the job's peak resident set (measured, or predicted on
    the estimate backend) and what of it was offloaded."""
    offloaded = int((row.memory_breakdown or {}).get("host_offloaded", 0))
    words = f"{format_size(row.peak_bytes)} GPU"
    if row.host_peak_bytes:
        words += f", host {format_size(row.host_peak_bytes)}"
        return words + (f" ({format_size(offloaded)} offloaded)" if offloaded else ", no offload")
    return words + (f" + {format_size(offloaded)} host" if offloaded else ", no host offload")


def print_answer(console: Console, sel: Selection, commands: dict[str, str]) -> None:
    """The short answer ``run`` ends with: the winner, why, its memory, the runner-up of each
    fidelity class and what to type next; it wraps to the console's width."""
    if sel.winner is not None:
        w = sel.winner
        console.print(
            f"[bold green]winner[/bold green]: trial {w.number}: {escape(describe(w.config))}"
        )
    console.print(answer_grid(sel, commands))


def commands_grid(commands: dict[str, str]) -> Table:
    """What to type next, one labelled line each (the answer block's last rows)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, command in commands.items():
        grid.add_row(label, escape(command))
    return grid


def answer_grid(sel: Selection, commands: dict[str, str]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    budget = format_size(sel.budget_bytes)
    fitting = [r for r in sel.rows if r.feasible and r.duplicate_of is None]
    if sel.winner is None:
        closest = sel.closest
        grid.add_row(
            "winner",
            f"[red]nothing fits {budget} yet[/red]"
            + (
                f"; closest: trial {closest.number} at {format_size(closest.peak_bytes)}: "
                f"{escape(describe(closest.config))}"
                if closest is not None
                else ""
            ),
        )
    else:
        w = sel.winner
        group = next(
            (c for c in sel.classes.values() if c.winner and c.winner.number == w.number), None
        )
        mine = [r for r in fitting if group is None or r.fidelity in GROUPS[group.group]]
        others = sorted((r for r in mine if r.number != w.number), key=lambda r: -r.speed)
        why = (
            f"fastest ({w.speed:,.0f} tokens/s) of {len(mine)} trial(s) of its class that fit "
            f"{budget} without a loss regression"
        )
        if group is not None and group.ties:
            tied = ", ".join(f"#{r.number}" for r in group.ties[:3])
            why += (
                f"; ties with {tied} within {group.margin:.0%} (the measurements' noise): "
                "the simplest is named"
            )
        elif others and others[0].speed > 0:
            gain = w.speed / others[0].speed - 1
            why += f"; {gain:.0%} faster than the next, trial {others[0].number}"
        grid.add_row("why", why)
        grid.add_row("memory", f"{_memory_words(w)} (budget {budget} per GPU)")
    if sel.winner is not None or sel.closest is not None:
        # the answer of each fidelity class, the full-training one first
        for i, line in enumerate(class_summary(sel, describe)):
            grid.add_row("per class" if i == 0 else "", escape(line))
    if sel.load_warning:
        grid.add_row("[yellow]note[/yellow]", f"[yellow]{escape(sel.load_warning)}[/yellow]")
    for label, command in commands.items():
        grid.add_row(label, escape(command))
    return grid


def certainty_line(contenders: dict[str, Any] | None, resume: str) -> str | None:
    """How sure the answer is: untried configurations the corrected estimator ranks close to the
    winner (``strategy.record_contenders``), and ``resume`` (``: autotune resume ...``, the
    study's own command) with ``--trials N`` to measure them."""
    if not contenders:
        return None
    within = f"{100 * float(contenders['within']):g}%"
    count = int(contenders["count"])
    if count == 0:
        return (
            f"every configuration the estimator ranks within {within} of the winner was "
            "measured: more trials are unlikely to find a faster one"
        )
    return (
        f"configurations the estimator ranks within {within} of the winner: {count} not yet "
        f"measured; more trials may find a faster one{resume} --trials {count}"
    )
