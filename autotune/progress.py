"""Progress of a study wherever its output goes: a line per finished trial (its number, its
configuration, its peak, its tokens/s and its verdict) with an estimate of the time left, and a
line when a long phase starts (loss probes, re-measurements, tracing). In a terminal an animated
bar sits under the lines; in a file or a pipe (a CI log, ``| tee``) there is no bar, only the
lines, each printed as it happens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optuna
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from autotune.display import describe
from autotune.selector import Row, rows_of
from autotune.units import format_size


def verdict_words(row: Row) -> str:
    """What a finished trial amounts to, in a few words: fits or not, and its loss verdict."""
    if row.status == "oom":
        return "out of memory: over the budget"
    if row.status == "failed":
        return f"failed: {row.error.splitlines()[0][:120]}" if row.error else "failed"
    if row.status != "ok":
        return row.status
    words = "fits" if row.fits else "over the budget"
    if row.duplicate_of is not None:
        words += f" (same configuration as #{row.duplicate_of})"
    v = row.verdict
    if row.predicted:
        words += " (predicted, not measured)"
    elif row.role == "reference":
        words += ", the loss reference"
    elif v is None or v.via == "none":
        words += ", no loss verdict" + (f" ({v.note[:80]})" if v is not None and v.note else "")
    elif v.regression is not None:
        how = (
            f"{v.regression:.0e} per step off the reference"
            if v.via == "reference"
            else (f"{v.regression:+.2%} on the loss probe")
        )
        words += f", loss {'ok' if v.ok else 'regressed'} ({how})"
    return words


def trial_line(row: Row, done: int, total: int) -> str:
    peak = format_size(row.peak_bytes) if row.peak_bytes else "-"
    speed = f"{row.tokens_per_s:,.0f} tokens/s" if row.status == "ok" else "- tokens/s"
    return (
        f"trial {row.number} ({done}/{total}) {describe(row.config)}: peak {peak}, {speed}, "
        f"{verdict_words(row)}"
    )


def time_left(seconds: float) -> str:
    if seconds < 60:
        return f"about {max(1, round(seconds))} s left"
    return f"about {round(seconds / 60)} min left"


class StudyProgress:
    """The progress of ``total`` trials of ``study`` on ``console``; ``callback`` is the
    Optuna callback that prints each finished trial, ``say`` prints a phase line."""

    def __init__(self, study: optuna.Study, console: Console, total: int) -> None:
        self.study, self.console, self.total = study, console, total
        self.done = 0
        self.started = time.monotonic()
        self.bar: Progress | None = None
        self.task: Any = None

    @contextmanager
    def running(self) -> Iterator[StudyProgress]:
        if not self.console.is_terminal:
            yield self
            return
        with Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        ) as bar:
            self.bar = bar
            self.task = bar.add_task("", total=self.total)
            try:
                yield self
            finally:
                self.bar = None

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def say(self, text: str) -> None:
        """A line about what is being done now (a long phase): printed as it starts."""
        self.console.print(text, style="dim", markup=False)

    def callback(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.done += 1
        row = next((r for r in rows_of(study) if r.number == trial.number), None)
        if row is None:  # a trial the selector does not list (still waiting)
            return
        line = escape(trial_line(row, self.done, self.total))
        left = self.total - self.done
        if left > 0:
            per_trial = (time.monotonic() - self.started) / self.done
            line += f"; {time_left(per_trial * left)}"
        self.console.print(line, markup=True, highlight=False)
        if self.bar is not None:
            self.bar.update(self.task, advance=1)
