"""The report: a Pareto plot, the memory breakdown of the ladder's rungs, a markdown and an HTML
summary linking them. Rendered with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import itertools

import matplotlib.pyplot as plt
import optuna
from matplotlib.figure import Figure

from autotune.display import describe
from autotune.ladder import Ladder, build_ladder, ladder_cells, pending_note
from autotune.selector import Row, Selection, select
from autotune.space import SearchSpace
from autotune.study import settings_of
from autotune.terminal import printable
from autotune.units import format_size

MIB = 2**20
#: the device's parts of a peak, in stacking order: label, colour, hatch (the hatch keeps the
#: parts apart in grey-scale)
PARTS: dict[str, tuple[str, str, str]] = {
    "parameters": ("parameters", "#4c72b0", ""),
    "gradients": ("gradients", "#55a868", "//"),
    "optimizer_states": ("optimizer states", "#dd8452", ".."),
    "activations": ("activations", "#c44e52", "xx"),
    "other": ("other (temporaries, logits, buffers)", "#b0b0b0", "--"),
    "activations_and_other": ("activations and other (not split)", "#937860", "\\\\"),
    "unsplit": ("not split (older trial)", "#dddddd", "oo"),
}
#: breakdown keys of other sources, folded into the parts above (the estimator's names; older
#: trials' single "device" count); ``host_offloaded`` is host memory, drawn apart
FOLD = {"logits/loss": "other", "temporaries": "other", "device": "unsplit"}
HOST_KEY = "host_offloaded"
LADDER_COLUMNS = (
    "step",
    "adds",
    "peak",
    "fits",
    "peak_change",
    "alone",
    "tok/s",
    "speed_change",
    "loss",
    "trial",
)
COLUMN_TITLES = {
    "peak": "peak memory",
    "peak_change": "change vs rung below",
    "alone": "saved on baseline alone",
    "tok/s": "tokens/s",
    "speed_change": "change vs rung below",
    "loss": "loss (vs the reference, or probed)",
}


@dataclass
class Report:
    out_dir: Path
    pareto_png: Path
    memory_png: Path | None
    markdown: Path
    html: Path
    ladder: Ladder

    def moved_to(self, folder: Path) -> Report:
        """The same report once its files are in ``folder`` (written in a staging folder)."""

        def moved(p: Path | None) -> Path | None:
            return None if p is None else folder / p.name

        return Report(
            folder,
            folder / self.pareto_png.name,
            moved(self.memory_png),
            folder / self.markdown.name,
            folder / self.html.name,
            self.ladder,
        )


def device_parts(breakdown: dict[str, int] | None) -> dict[str, int]:
    """A trial's breakdown as the device parts of ``PARTS`` (host memory left out)."""
    parts: dict[str, int] = {}
    for key, value in (breakdown or {}).items():
        if key == HOST_KEY:
            continue
        part = FOLD.get(key, key if key in PARTS else "other")
        parts[part] = parts.get(part, 0) + int(value)
    return parts


def _ran_to_end(r: Row) -> bool:
    return r.tokens_per_s > 0 and r.peak_bytes > 0 and r.status in ("ok", "oom")


#: the kinds of trial on the Pareto plot: label, marker, colour (shapes differ, for grey-scale)
KINDS: dict[str, tuple[str, str, str]] = {
    "fits": ("fits the budget", "o", "#4c72b0"),
    "over": ("over the budget (ran unbounded)", "s", "#c44e52"),
    "regressed": ("fits, loss regressed", "^", "#dd8452"),
    "oom": ("out of memory (stopped)", "X", "#c44e52"),
    "failed": ("failed (nothing measured)", "D", "#7f7f7f"),
}


def trial_kind(r: Row, budget: int) -> str | None:
    """Which kind of point a trial is on the Pareto plot (``None``: still running)."""
    if r.status == "failed":
        return "failed"
    if r.status not in ("ok", "oom"):
        return None
    if not _ran_to_end(r):
        return "oom"
    if r.peak_bytes > budget:
        return "over"
    if r.loss_ok is False:
        return "regressed"
    return "fits"


def pareto_figure(sel: Selection, ladder: Ladder | None, title: str) -> Figure:
    """Tokens/s against peak memory: every trial (OOM and failed ones on the zero line), the
    budget, the front, the winner, the ladder. Predicted trials are hollow markers."""
    budget_mib = sel.budget_bytes / MIB
    fig, ax = plt.subplots(figsize=(10.5, 5.8), dpi=110)
    rows = [r for r in sel.rows if r.duplicate_of is None and trial_kind(r, sel.budget_bytes)]
    peaks = [r.peak_bytes / MIB for r in rows if r.peak_bytes > 0] + [budget_mib]
    x_lo, x_hi = min(peaks) * 0.9, max(peaks) * 1.08
    top = max([r.speed for r in rows] + [1.0]) * 1.25

    def where(r: Row) -> tuple[float, float]:
        x = r.peak_bytes / MIB if r.peak_bytes > 0 else x_lo + (x_hi - x_lo) * 0.02
        return x, (r.speed if _ran_to_end(r) else 0.0)

    for kind, (label, marker, color) in KINDS.items():
        for predicted in (False, True):
            part = [r for r in rows if trial_kind(r, sel.budget_bytes) == kind]
            part = [r for r in part if r.predicted == predicted]
            if not part:
                continue
            pts = [where(r) for r in part]
            ax.scatter(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=marker,
                s=70,
                facecolors="none" if predicted else color,
                edgecolors=color if predicted else "black",
                linewidths=1.6 if predicted else 0.6,
                label=f"{label}{' (predicted)' if predicted else ''}: {len(part)}",
                zorder=3,
                clip_on=False,
            )
    for r in rows:  # trial numbers, to find a point in `autotune show`
        ax.annotate(
            f"#{r.number}",
            where(r),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=7,
            color="#555555",
        )
    front = [r for r in sel.pareto if _ran_to_end(r)]
    if front:
        xs = [r.peak_bytes / MIB for r in front]
        ys = [r.speed for r in front]
        ax.step(
            [*xs, x_hi],
            [*ys, ys[-1]],
            where="post",
            color="black",
            linewidth=1.6,
            linestyle=(0, (5, 2)),
            label="Pareto front (fastest for its memory)",
            zorder=2,
        )
    if ladder is not None:
        path_pts = [
            (s.row.peak_bytes / MIB, s.row.speed)
            for s in ladder.steps
            if s.measured and s.row is not None and _ran_to_end(s.row)
        ]
        for (x0, y0), (x1, y1) in itertools.pairwise(path_pts):
            ax.annotate(
                "",
                xy=(x1, y1),
                xytext=(x0, y0),
                arrowprops={"arrowstyle": "->", "color": "#555555", "linewidth": 1, "alpha": 0.7},
                zorder=2,
            )
        if len(path_pts) > 1:
            ax.plot([], [], color="#555555", linewidth=1, label="ablation ladder (arrows)")
    ax.axvline(budget_mib, color="#c44e52", linestyle="--", linewidth=1.4)
    ax.axvspan(
        budget_mib,
        x_hi,
        facecolor="#c44e52",
        alpha=0.12,
        hatch="//",
        edgecolor="#c44e52",
        linewidth=0,
        label=f"over the budget ({format_size(sel.budget_bytes)})",
    )
    ax.axhline(0, color="#999999", linewidth=0.8)
    if sel.winner is not None:
        w = sel.winner
        ax.scatter(
            [w.peak_bytes / MIB],
            [w.speed],
            marker="*",
            s=480,
            color="#f2b701",
            edgecolors="black",
            linewidths=1.0,
            zorder=5,
            label=f"winner: trial {w.number}",
        )
        left_half = w.peak_bytes / MIB < (x_lo + x_hi) / 2
        ax.annotate(  # on the side with more room, so the box stays inside the axes
            f"winner #{w.number}\n{describe(w.config)}",
            (w.peak_bytes / MIB, w.speed),
            textcoords="offset points",
            xytext=(16, 10) if left_half else (-12, 14),
            ha="left" if left_half else "right",
            fontsize=8,
            fontweight="bold",
            bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "black", "alpha": 0.95},
            zorder=6,
        )
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(bottom=-top * 0.06, top=top)
    ax.set_xlabel("peak device memory (MiB)")
    ax.set_ylabel("throughput (tokens/s); 0: no measurement")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    fig.tight_layout()
    return fig


def pareto_plot(sel: Selection, ladder: Ladder | None, path: Path, title: str) -> Path:
    fig = pareto_figure(sel, ladder, title)
    fig.savefig(path)
    plt.close(fig)
    return path


@dataclass
class Bar:
    """One trial's bar in the memory picture."""

    label: str
    row: Row
    construction_peak: int = 0
    host_offloaded: int = 0  # the bytes offloaded to host memory at most (ZeRO offload)

    @property
    def host_peak(self) -> int:
        """The job's host memory peak (resident set; what --host-memory limits), or where a
        trial recorded none, the offloaded bytes alone."""
        return max(self.row.host_peak_bytes, self.host_offloaded)


def memory_bars(sel: Selection, ladder: Ladder, attrs: dict[int, dict[str, Any]]) -> list[Bar]:
    """The ladder's measured rungs (the winner last); without a ladder, the Pareto front and the
    winner. Trials without a breakdown are left out."""
    chosen: list[tuple[str, Row]] = [
        (("baseline" if i == 0 else f"+{s.added}"), s.row)
        for i, s in enumerate(ladder.steps)
        if s.row is not None and s.row.memory_breakdown
    ]
    if not chosen:
        chosen = [(f"#{r.number}", r) for r in sel.pareto if r.memory_breakdown][:8]
    w = sel.winner
    if w is not None and w.memory_breakdown and all(r.number != w.number for _, r in chosen):
        chosen.append((f"#{w.number}", w))
    bars = []
    for label, r in chosen:
        a = attrs.get(r.number, {})
        if sel.winner is not None and r.number == sel.winner.number:
            label += "\n(winner)"
        offloaded = int((r.memory_breakdown or {}).get(HOST_KEY) or 0)
        bars.append(Bar(label, r, r.construction_peak_bytes or int(a.get("construction") or 0),
                        offloaded))  # fmt: skip
    return bars


def memory_figure(bars: list[Bar], budget_bytes: int, host_limit: int | None, title: str) -> Figure:
    """Left: the device peak of each bar split by part, against the device budget, with the
    construction peak marked. Right, on its own axis: the same trials' host memory peak (the
    job's resident set) with the part offloaded to it, against the host limit when one is set
    (a limit far above the bars, such as this machine's whole memory, is named, not drawn)."""
    fig, (ax, hx) = plt.subplots(
        1,
        2,
        figsize=(1.3 * max(len(bars), 3) + 6.5, 5.4),
        dpi=110,
        gridspec_kw={"width_ratios": [3, 1]},
    )
    present = {k for b in bars for k in device_parts(b.row.memory_breakdown)}
    keys = [k for k in PARTS if k in present]
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for key in keys:
        values = [device_parts(b.row.memory_breakdown).get(key, 0) / MIB for b in bars]
        label, color, hatch = PARTS[key]
        ax.bar(
            x,
            values,
            bottom=bottom,
            label=label,
            color=color,
            hatch=hatch,
            width=0.6,
            edgecolor="black",
            linewidth=0.5,
        )
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    built = [(i, b.construction_peak / MIB) for i, b in enumerate(bars) if b.construction_peak]
    if built:
        ax.scatter(
            [i for i, _ in built],
            [v for _, v in built],
            marker="_",
            s=900,
            linewidths=2.5,
            color="black",
            zorder=4,
            label="construction peak (model built, before the first step)",
        )
    budget_mib = budget_bytes / MIB
    top = max([*bottom, budget_mib, *(v for _, v in built)]) * 1.15
    for i, b in enumerate(bars):
        tag = " (pred.)" if b.row.predicted else ""
        ax.text(
            i,
            bottom[i] + top * 0.01,
            f"{format_size(b.row.peak_bytes)}{tag}",
            ha="center",
            va="bottom",
            fontsize=8,
            fontweight="bold",
        )
    ax.axhline(
        budget_mib,
        color="#c44e52",
        linestyle="--",
        linewidth=1.4,
        label=f"device budget {format_size(budget_bytes)}",
    )
    labels = [b.label for b in bars]
    ax.set_xticks(x, labels, fontsize=8, rotation=0 if len(bars) < 5 else 20)
    ax.set_xlim(-0.6, max(len(bars), 3) - 0.4)
    ax.set_ylim(0, top)
    ax.set_ylabel("device memory at the peak (MiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)

    hosts = [b.host_peak / MIB for b in bars]
    offloaded = [b.host_offloaded / MIB for b in bars]
    hx.bar(
        x,
        hosts,
        color="#c9c3e0",
        edgecolor="black",
        linewidth=0.5,
        width=0.6,
        label="host memory peak (the job's resident set)",
    )
    if any(offloaded):
        hx.bar(
            x,
            offloaded,
            color="#8172b3",
            hatch="++",
            edgecolor="black",
            linewidth=0.5,
            width=0.6,
            label="of which offloaded (ZeRO offload)",
        )
    h_top = max([*hosts, 1.0]) * 1.15
    if host_limit and host_limit / MIB <= 4 * h_top:
        h_top = max(h_top, host_limit / MIB * 1.15)
        hx.axhline(
            host_limit / MIB,
            color="#c44e52",
            linestyle=":",
            linewidth=1.4,
            label=f"host limit {format_size(host_limit)}",
        )
    elif host_limit:  # drawn, it would flatten the bars
        hx.text(
            0.5,
            0.97,
            f"host limit {format_size(host_limit)}\n(above the axis)",
            transform=hx.transAxes,
            ha="center",
            va="top",
            fontsize=8,
            color="#c44e52",
        )
    if not any(hosts):
        hx.text(
            0.5,
            0.5,
            "no host memory\nrecorded",
            transform=hx.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="#555555",
        )
    hx.set_xticks(x, [f"#{b.row.number}" for b in bars], fontsize=8)
    hx.set_ylim(0, h_top)
    hx.set_ylabel("host memory (MiB)")
    hx.set_title("host (own axis)", fontsize=10)
    hx.grid(True, axis="y", alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    h2, n2 = hx.get_legend_handles_labels()
    fig.legend(handles + h2, names + n2, fontsize=8, loc="lower center", ncol=3, framealpha=0.9)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return fig


def memory_plot(
    bars: list[Bar], budget_bytes: int, host_limit: int | None, path: Path, title: str
) -> Path | None:
    """The memory picture as a PNG; ``None`` when no trial recorded a breakdown."""
    if not bars:
        return None
    fig = memory_figure(bars, budget_bytes, host_limit, title)
    fig.savefig(path)
    plt.close(fig)
    return path


def _summary_lines(study: optuna.Study, sel: Selection) -> list[str]:
    s = settings_of(study)
    counts = {k: sum(r.status == k for r in sel.rows) for k in ("ok", "oom", "failed")}
    lines = [
        f"model {s.model}, budget {format_size(s.budget_bytes)}, backend {s.backend}, "
        f"sequence {s.seq_len}, global batch {s.global_batch_size}",
        f"{len(sel.rows)} trials: {counts['ok']} ok, {counts['oom']} over the budget, "
        f"{counts['failed']} failed",
    ]
    if sel.winner is not None:
        w = sel.winner
        lines.append(
            f"winner: trial {w.number}: {describe(w.config)}, peak {format_size(w.peak_bytes)}, "
            f"{w.speed:,.0f} tokens/s"
            + (f", host memory {format_size(w.host_peak_bytes)}" if w.host_peak_bytes else "")
        )
    else:
        lines.append("no trial fits the budget yet")
    return lines


def _ladder_note(ladder: Ladder) -> str:
    if ladder.target is None:
        return "No winner yet, so no ladder."
    text = (
        "Cumulative, as in torchtune's README: each rung keeps every technique above it and "
        "adds the one that helps most from the rung below (over the budget the biggest saving, "
        "within it the fastest that still fits). Rungs run without the budget, so an "
        "over-budget peak is the true one."
    )
    if not ladder.complete:
        text += " The order below the first rung still to measure is provisional."
    return text


#: the per-trial table of the HTML report: every trial's peak split by part
TRIAL_COLUMNS = (
    "#",
    "status",
    "config",
    "peak",
    "construction",
    *(k for k in PARTS if k not in ("activations_and_other", "unsplit")),
    "host",
    "offloaded",
    "tokens/s",
)


def trial_cells(sel: Selection, attrs: dict[int, dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for r in sel.rows:
        parts = device_parts(r.memory_breakdown)
        offloaded = int((r.memory_breakdown or {}).get(HOST_KEY) or 0)
        status = r.status + (" (predicted)" if r.predicted else "")
        if sel.winner is not None and r.number == sel.winner.number:
            status += " ★ winner"
        cell = {
            "#": str(r.number),
            "status": status,
            "config": describe(r.config),
            "peak": format_size(r.peak_bytes) if r.peak_bytes else "-",
            "construction": format_size(r.construction_peak_bytes)
            if r.construction_peak_bytes
            else "-",
            "host": format_size(r.host_peak_bytes) if r.host_peak_bytes else "-",
            "offloaded": format_size(offloaded) if offloaded else "-",
            "tokens/s": f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
        }
        for k in TRIAL_COLUMNS[5:-3]:
            cell[k] = format_size(parts[k]) if parts.get(k) else "-"
        if "activations_and_other" in parts:
            cell["activations"] = format_size(parts["activations_and_other"]) + " (with other)"
        out.append(cell)
    return out


def write_markdown(
    path: Path,
    study: optuna.Study,
    sel: Selection,
    ladder: Ladder,
    pngs: dict[str, Path | None],
    pending: str,
) -> Path:
    cells = ladder_cells(ladder)
    lines = [f"# autotune report: study `{printable(study.study_name)}`", ""]
    lines += [f"* {line}" for line in _summary_lines(study, sel)]
    lines += [
        "",
        "## Speed against memory",
        "",
        f"![Pareto plot]({pngs['pareto'].name})" if pngs["pareto"] else "",
        "",
    ]
    lines += ["## Ablation ladder: from the baseline to the winner", "", _ladder_note(ladder), ""]
    lines.append("| " + " | ".join(COLUMN_TITLES.get(c, c) for c in LADDER_COLUMNS) + " |")
    lines.append("|" + "---|" * len(LADDER_COLUMNS))
    for cell in cells:
        lines.append("| " + " | ".join(cell[c] for c in LADDER_COLUMNS) + " |")
    if pending:
        lines += ["", pending]
    memory = pngs.get("memory")
    lines += ["", "## Memory breakdown", ""]
    lines.append(
        f"![Memory breakdown]({memory.name})"
        if memory
        else "The backend recorded no memory breakdown for these trials."
    )
    lines += [
        "",
        "## Export",
        "",
        "    autotune export --format deepspeed|hf|accelerate|axolotl|command --out FILE",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


def _data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def _html_table(
    columns: Sequence[str], cells: list[dict[str, str]], titles: dict[str, str], table_id: str
) -> str:
    e = html.escape
    head = "".join(f"<th>{e(titles.get(c, c))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(cell[c])}</td>" for c in columns) + "</tr>" for cell in cells
    )
    return f"<table id='{table_id}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_html(
    path: Path,
    study: optuna.Study,
    sel: Selection,
    ladder: Ladder,
    pngs: dict[str, Path | None],
    pending: str,
    trials: list[dict[str, str]],
) -> Path:
    """One self-contained page (the PNGs embedded as data: URIs), to send as it is."""
    e = html.escape
    items = "".join(f"<li>{e(line)}</li>" for line in _summary_lines(study, sel))
    alts = {"pareto": "throughput against peak memory", "memory": "memory at the peak by part"}
    imgs = {
        k: (f'<img id="{k}" src="{_data_uri(p)}" alt="{alts.get(k, k)}">' if p else "")
        for k, p in pngs.items()
    }
    ladder_html = _html_table(LADDER_COLUMNS, ladder_cells(ladder), COLUMN_TITLES, "ladder")
    titles = {
        "construction": "construction peak",
        "optimizer_states": "optimizer states",
        "host": "host memory peak",
        "offloaded": "offloaded to host",
    }
    trials_html = _html_table(TRIAL_COLUMNS, trials, titles, "trials")
    path.write_text(
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>autotune: {e(printable(study.study_name))}</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:right}th{background:#f3f3f3}img{max-width:100%}"
        "td:nth-child(2),td:nth-child(3){text-align:left}</style></head><body>"
        f"<h1>autotune report: {e(printable(study.study_name))}</h1><ul>{items}</ul>"
        f"<h2>Speed against memory</h2>{imgs.get('pareto', '')}"
        f"<h2>Ablation ladder</h2><p>{e(_ladder_note(ladder))}</p>{ladder_html}"
        + (f"<p id='pending'>{e(pending)}</p>" if pending else "")
        + f"<h2>Memory breakdown</h2>"
        f"{imgs.get('memory', '') or '<p>not recorded by this backend</p>'}"
        f"<h2>Every trial</h2>{trials_html}"
        "</body></html>\n"
    )
    return path


def measured_seconds(study: optuna.Study) -> list[float]:
    """Wall times of the trials that really ran (not predicted, not reused)."""
    return [
        float(t.user_attrs["wall_s"])
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("wall_s")
        and not t.user_attrs.get("predicted")
        and "duplicate_of" not in t.user_attrs
    ]


def write_report(study: optuna.Study, out_dir: Path) -> Report:
    """Everything ``autotune report`` writes, from the database alone (nothing is run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = settings_of(study)
    space = SearchSpace.from_dict(settings.space, "study")
    sel = select(study)
    ladder = build_ladder(study, space)
    attrs = {t.number: t.user_attrs for t in study.get_trials(deepcopy=False)}
    title = f"study {printable(study.study_name)}"
    pareto = pareto_plot(sel, ladder, out_dir / "pareto.png", title)
    host_limit = settings.host_budget_bytes or None  # 0: unlimited
    memory = memory_plot(
        memory_bars(sel, ladder, attrs),
        sel.budget_bytes,
        host_limit,
        out_dir / "memory.png",
        "device memory at the peak, by part",
    )
    pngs: dict[str, Path | None] = {"pareto": pareto, "memory": memory}
    pending = pending_note(ladder, measured_seconds(study), study.study_name)
    md = write_markdown(out_dir / "report.md", study, sel, ladder, pngs, pending)
    page = write_html(
        out_dir / "report.html", study, sel, ladder, pngs, pending, trial_cells(sel, attrs)
    )
    return Report(out_dir, pareto, memory, md, page, ladder)
