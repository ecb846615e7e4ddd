"""What a person sees: a progress bar over trials, a results table, the winner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autotune.selector import Row, Selection
from autotune.units import format_size
from trials.techniques import FIDELITY_CLASSES, fidelity_class

STATUS_STYLE = {"ok": "green", "oom": "red", "failed": "magenta", "running": "yellow"}
#: how each dimension is abbreviated in the table's config column
SHORT: dict[str, Callable[[Any], str]] = {
    "gradient_checkpointing": lambda v: {"off": "", "full": "ckpt", "selective": "ckpt/sel"}[v],
    "checkpoint_every": lambda v: f"k={v}",
    "precision": str,
    "attention": str,
    "optimizer": str,
    "micro_batch_size": lambda v: f"mb={v}",
    "zero_stage": lambda v: f"zero{v}" if v else "",
    "offload_optimizer": lambda v: "" if v == "none" else "off-opt",
    "offload_param": lambda v: "" if v == "none" else "off-param",
    "quantization": lambda v: "" if v == "none" else f"{v}+lora",
    "reduce_bucket_size": lambda v: f"rb={v:.0e}",
    "allgather_bucket_size": lambda v: f"ag={v:.0e}",
    "overlap_comm": lambda v: "overlap" if v else "",
    "contiguous_gradients": lambda v: "" if v else "noncontig",
}


def _peak_cell(row: Row) -> str:
    if not row.peak_bytes:
        return "-"
    if row.rank_peaks and len(row.rank_peaks) > 1:  # per rank: the worst, then each rank's
        each = "/".join(f"{p / 2**20:.0f}" for p in row.rank_peaks)
        return f"{format_size(row.peak_bytes)} ({each} MiB)"
    return format_size(row.peak_bytes)


def describe(config: dict[str, Any]) -> str:
    parts = [SHORT[k](v) if k in SHORT else f"{k}={v}" for k, v in config.items()]
    return " ".join(p for p in parts if p)


def _loss_cell(row: Row) -> str:
    if row.role == "reference":
        return "reference"
    if row.loss_regression is None:
        return "-"
    cell = f"{row.loss_regression * 100:+.2f}%"
    if row.loss_ok is False:
        return f"[red]{cell} ✗[/red]"
    return cell


def results_table(sel: Selection, title: str = "trials") -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("#", justify="right")
    table.add_column("config", overflow="fold", max_width=40)
    table.add_column("status")
    table.add_column("peak", justify="right")
    table.add_column("tok/s", justify="right")
    table.add_column("loss vs ref", justify="right")
    host = any(r.host_peak_bytes for r in sel.rows)  # studies recorded before it have none
    if host:
        table.add_column("host", justify="right")
    for r in sel.rows:
        style = STATUS_STYLE.get(r.status, "")
        status = f"[{style}]{r.status}[/{style}]" if style else r.status
        if r.duplicate_of is not None:
            status += f" (=#{r.duplicate_of})"
        if r.retry_of is not None:
            status += f" (retry of #{r.retry_of})"
        mark = " ★" if sel.winner is not None and r.number == sel.winner.number else ""
        table.add_row(
            f"{r.number}{mark}",
            describe(r.config),
            status,
            _peak_cell(r),
            f"{r.tokens_per_s:,.0f}" if r.status == "ok" else "-",
            _loss_cell(r),
            *([format_size(r.host_peak_bytes) if r.host_peak_bytes else "-"] if host else []),
        )
    return table


def print_failures(console: Console, rows: list[Row]) -> None:
    """Why each failed trial failed, with the last line of its job's stderr."""
    retried = {r.retry_of: r.number for r in rows if r.retry_of is not None}
    for r in rows:
        if r.status != "failed":
            continue
        again = f"; run again as #{retried[r.number]}" if r.number in retried else ""
        console.print(f"[magenta]#{r.number} failed[/magenta]: {escape(r.error)}{again}")
        last = next((ln for ln in reversed(r.stderr_tail.splitlines()) if ln.strip()), "")
        if last:
            console.print(f"    stderr: {last.strip()}", style="dim", markup=False)


def print_selection(console: Console, sel: Selection, title: str = "trials") -> None:
    console.print(results_table(sel, title))
    print_failures(console, sel.rows)
    budget = format_size(sel.budget_bytes)
    if sel.winner is not None:
        w = sel.winner
        console.print(
            f"[bold green]winner[/bold green]: trial {w.number}: {describe(w.config)}  "
            f"peak {format_size(w.peak_bytes)} of {budget}, {w.tokens_per_s:,.0f} tokens/s"
            + (f", host {format_size(w.host_peak_bytes)}" if w.host_peak_bytes else "")
        )
    elif sel.closest is not None:
        c = sel.closest
        regressed = sum(r.fits and r.loss_ok is False for r in sel.rows)
        why = (
            f"nothing fits {budget} without a loss regression ({regressed} fit but broke the "
            "loss guard)"
            if regressed
            else f"nothing fits {budget}"
        )
        console.print(
            f"[bold red]{why}[/bold red]; closest: trial {c.number}: "
            f"{describe(c.config)} at {format_size(c.peak_bytes)}"
        )
    else:
        console.print("[bold red]no trial has finished yet[/bold red]")


#: ladder cells shown in the terminal, with their header
LADDER_HEADERS = {
    "step": "step",
    "adds": "adds",
    "peak": "peak",
    "peak_change": "Δ peak",
    "alone": "alone",
    "tok/s": "tok/s",
    "speed_change": "Δ tok/s",
    "loss": "loss vs ref",
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


def runners_up(sel: Selection) -> dict[str, Row]:
    """Per fidelity class (``trials.techniques.FIDELITY_CLASSES``), the fastest feasible trial
    other than the winner: the selector's winner rule applied within each class."""
    out: dict[str, Row] = {}
    for cls in FIDELITY_CLASSES:
        feasible = [
            r
            for r in sel.rows
            if r.feasible
            and r.duplicate_of is None
            and fidelity_class(r.config) == cls
            and (sel.winner is None or r.number != sel.winner.number)
        ]
        if feasible:
            out[cls] = max(feasible, key=lambda r: r.tokens_per_s)
    return out


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
        others = sorted((r for r in fitting if r.number != w.number), key=lambda r: -r.tokens_per_s)
        why = (
            f"fastest ({w.tokens_per_s:,.0f} tokens/s) of {len(fitting)} trial(s) that fit "
            f"{budget} without a loss regression"
        )
        if others and others[0].tokens_per_s > 0:
            gain = w.tokens_per_s / others[0].tokens_per_s - 1
            why += f"; {gain:.0%} faster than the next, trial {others[0].number}"
        grid.add_row("why", why)
        grid.add_row("memory", f"{_memory_words(w)} (budget {budget} per GPU)")
        ups = runners_up(sel)
        if ups:
            grid.add_row("runner-up", "the fastest other fitting trial of each fidelity class:")
        for cls in FIDELITY_CLASSES:
            r = ups.get(cls)
            if r is not None:
                grid.add_row(
                    f"  {cls}",
                    f"trial {r.number}: {r.tokens_per_s:,.0f} tokens/s, {_memory_words(r)}: "
                    f"{escape(describe(r.config))}",
                )
    for label, command in commands.items():
        grid.add_row(label, escape(command))
    return grid
