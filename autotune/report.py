"""The report: a Pareto plot, the memory breakdown of the ladder's rungs, a markdown and an HTML
summary linking them. Rendered with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import itertools

import matplotlib.pyplot as plt
import optuna

from autotune.display import describe
from autotune.ladder import Ladder, build_ladder, ladder_cells
from autotune.selector import Row, Selection, select
from autotune.space import SearchSpace
from autotune.study import settings_of
from autotune.units import format_size

MIB = 2**20
#: memory breakdown keys in stacking order, with their legend labels and colours
PARTS: dict[str, tuple[str, str]] = {
    "parameters": ("parameters", "#4c72b0"),
    "gradients": ("gradients", "#55a868"),
    "optimizer_states": ("optimizer states", "#dd8452"),
    "activations": ("activations", "#c44e52"),
    "activations_and_other": ("activations and other", "#c44e52"),
    "other": ("other", "#8c8c8c"),
}
LADDER_COLUMNS = (
    "step",
    "adds",
    "peak",
    "fits",
    "saved",
    "alone",
    "tok/s",
    "speed",
    "loss",
    "trial",
)
COLUMN_TITLES = {
    "saved": "saved vs step below",
    "alone": "saved on baseline alone",
    "speed": "speed vs step below",
    "loss": "loss vs reference",
}


@dataclass
class Report:
    out_dir: Path
    pareto_png: Path
    memory_png: Path | None
    markdown: Path
    html: Path
    ladder: Ladder


def _ran_to_end(r: Row) -> bool:
    return r.tokens_per_s > 0 and r.peak_bytes > 0 and r.status in ("ok", "oom")


def pareto_plot(sel: Selection, ladder: Ladder | None, path: Path, title: str) -> Path:
    """Tokens/s against peak memory: every trial, the budget, the front, the winner, the ladder."""
    budget_mib = sel.budget_bytes / MIB
    fig, ax = plt.subplots(figsize=(10.5, 5.5), dpi=110)
    groups: dict[str, tuple[list[Row], dict[str, str]]] = {
        "fits": ([], {"marker": "o", "color": "#4c72b0"}),
        "over the budget (true peak)": ([], {"marker": "X", "color": "#c44e52"}),
        "loss regressed": ([], {"marker": "^", "color": "#dd8452"}),
        "OOM, stopped at the budget": ([], {"marker": "x", "color": "#c44e52"}),
    }
    rows = [r for r in sel.rows if r.duplicate_of is None and r.peak_bytes > 0]
    for r in rows:
        if r.status == "oom" and not _ran_to_end(r):
            groups["OOM, stopped at the budget"][0].append(r)
        elif not _ran_to_end(r):
            continue
        elif r.peak_bytes > sel.budget_bytes:
            groups["over the budget (true peak)"][0].append(r)
        elif r.loss_ok is False:
            groups["loss regressed"][0].append(r)
        else:
            groups["fits"][0].append(r)
    for label, (members, style) in groups.items():
        for predicted in (False, True):
            part = [r for r in members if r.predicted == predicted]
            if not part:
                continue
            face = "none" if predicted or style["marker"] in ("x",) else style["color"]
            ax.scatter(
                [r.peak_bytes / MIB for r in part],
                [r.tokens_per_s for r in part],
                marker=str(style["marker"]),
                s=60,
                facecolors=face,
                edgecolors=style["color"],
                linewidths=1.5,
                label=label + (" (estimated)" if predicted else ""),
                zorder=3,
            )
    for r in rows:  # trial numbers, to find a point in `autotune show`
        y = r.tokens_per_s if _ran_to_end(r) else 0.0
        ax.annotate(
            f"#{r.number}",
            (r.peak_bytes / MIB, y),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=7,
            color="#666666",
        )
    front = [r for r in sel.pareto if _ran_to_end(r)]
    if len(front) > 1:
        ax.step(
            [r.peak_bytes / MIB for r in front],
            [r.tokens_per_s for r in front],
            where="post",
            color="#4c72b0",
            alpha=0.4,
            linewidth=1,
            label="Pareto front",
        )
    if ladder is not None:
        path_pts = [
            (s.row.peak_bytes / MIB, s.row.tokens_per_s)
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
            ax.plot([], [], color="#555555", linewidth=1, label="ablation ladder")
        first = ladder.steps[0].row
        if first is not None and ladder.steps[0].measured and _ran_to_end(first):
            ax.annotate(
                "baseline",
                (first.peak_bytes / MIB, first.tokens_per_s),
                textcoords="offset points",
                xytext=(6, -12),
                fontsize=8,
                color="#555555",
            )
    ax.axvline(
        budget_mib,
        color="#c44e52",
        linestyle="--",
        linewidth=1.2,
        label=f"budget {format_size(sel.budget_bytes)}",
    )
    if sel.winner is not None:
        w = sel.winner
        ax.scatter(
            [w.peak_bytes / MIB],
            [w.tokens_per_s],
            marker="*",
            s=320,
            color="#f2b701",
            edgecolors="black",
            linewidths=0.8,
            zorder=4,
            label="winner",
        )
        xs_all = [r.peak_bytes / MIB for r in rows] + [budget_mib]
        left_half = w.peak_bytes / MIB < (min(xs_all) + max(xs_all)) / 2
        ax.annotate(  # on the side with more room, so the box stays inside the axes
            f"winner #{w.number}\n{describe(w.config)}",
            (w.peak_bytes / MIB, w.tokens_per_s),
            textcoords="offset points",
            xytext=(14, 10) if left_half else (-10, 14),
            ha="left" if left_half else "right",
            fontsize=8,
            bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#999999", "alpha": 0.9},
            zorder=5,
        )
    xs = [r.peak_bytes / MIB for r in rows] + [budget_mib]
    ax.set_xlim(min(xs) * 0.9, max(xs) * 1.08)
    ax.set_ylim(bottom=0, top=max([r.tokens_per_s for r in rows] + [1.0]) * 1.25)
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("throughput (tokens/s)")
    n_failed = sum(r.status == "failed" for r in sel.rows)
    ax.set_title(title + (f"  ({n_failed} failed, not shown)" if n_failed else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def memory_plot(ladder: Ladder, path: Path, title: str) -> Path | None:
    """Stacked memory breakdown of each measured rung, the winner last; ``None`` without data."""
    bars: list[tuple[str, Row]] = [
        (("baseline" if i == 0 else f"+{s.added}"), s.row)
        for i, s in enumerate(ladder.steps)
        if s.row is not None and s.row.memory_breakdown
    ]
    if not bars and ladder.target is not None and ladder.target.memory_breakdown:
        bars = [(f"trial #{ladder.target.number}", ladder.target)]
    if not bars:
        return None
    present = {k for _, r in bars for k in (r.memory_breakdown or {})}
    keys = [k for k in PARTS if k in present] + sorted(present - set(PARTS))
    fig, ax = plt.subplots(figsize=(1.2 * max(len(bars), 3) + 4.5, 5), dpi=110)
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for key in keys:
        values = [(r.memory_breakdown or {}).get(key, 0) / MIB for _, r in bars]
        label, color = PARTS.get(key, (key.replace("_", " "), "#bbbbbb"))
        ax.bar(x, values, bottom=bottom, label=label, color=color, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    top = max([*bottom, ladder.budget_bytes / MIB])
    for i, (_, r) in enumerate(bars):
        tag = " (est.)" if r.predicted else ""
        ax.text(
            i,
            bottom[i] - top * 0.01,
            f"{format_size(r.peak_bytes)}{tag}",
            ha="center",
            va="top",
            color="white",
            fontweight="bold",
            fontsize=8,
        )
    ax.axhline(
        ladder.budget_bytes / MIB,
        color="#c44e52",
        linestyle="--",
        linewidth=1.2,
        label=f"budget {format_size(ladder.budget_bytes)}",
    )
    labels = [name for name, _ in bars]
    if ladder.target is not None and bars[-1][1].number == ladder.target.number:
        labels[-1] += "\n(winner)"
    ax.set_xticks(x, labels, fontsize=8, rotation=0 if len(bars) < 6 else 20)
    ax.set_xlim(-0.6, max(len(bars), 3) - 0.4)
    ax.set_ylabel("memory at the peak (MiB)")
    ax.set_ylim(0, max([*bottom, ladder.budget_bytes / MIB]) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
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
            f"{w.tokens_per_s:,.0f} tokens/s"
            + (f", host memory {format_size(w.host_peak_bytes)}" if w.host_peak_bytes else "")
        )
    else:
        lines.append("no trial fits the budget yet")
    return lines


def _ladder_note(ladder: Ladder) -> str:
    if ladder.target is None:
        return "No winner yet, so no ladder."
    if not ladder.complete:
        return (
            f"{len(ladder.missing)} configuration(s) of the ladder are not measured yet; the order "
            "below is provisional. `autotune run --ladder` (or `autotune resume --ladder`) "
            "measures them."
        )
    return (
        "Each rung adds the technique that helps most from the rung below: while over the "
        "budget the biggest saving, once within it the fastest that still fits. Rungs ran "
        "without the budget, so an over-budget peak is the true one."
    )


def write_markdown(
    path: Path, study: optuna.Study, sel: Selection, ladder: Ladder, pngs: dict[str, Path | None]
) -> Path:
    cells = ladder_cells(ladder)
    lines = [f"# autotune report: study `{study.study_name}`", ""]
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


def write_html(
    path: Path, study: optuna.Study, sel: Selection, ladder: Ladder, pngs: dict[str, Path | None]
) -> Path:
    e = html.escape
    cells = ladder_cells(ladder)
    head = "".join(f"<th>{e(COLUMN_TITLES.get(c, c))}</th>" for c in LADDER_COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{e(cell[c])}</td>" for c in LADDER_COLUMNS) + "</tr>"
        for cell in cells
    )
    items = "".join(f"<li>{e(line)}</li>" for line in _summary_lines(study, sel))
    imgs = {k: (f'<img src="{e(p.name)}" alt="{k}">' if p else "") for k, p in pngs.items()}
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>autotune: {e(study.study_name)}</title><style>"
        "body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}img{max-width:100%}</style></head><body>"
        f"<h1>autotune report: {e(study.study_name)}</h1><ul>{items}</ul>"
        f"<h2>Speed against memory</h2>{imgs.get('pareto', '')}"
        f"<h2>Ablation ladder</h2><p>{e(_ladder_note(ladder))}</p>"
        f"<table><tr>{head}</tr>{body}</table>"
        f"<h2>Memory breakdown</h2>{imgs.get('memory', '') or 'not recorded by this backend'}"
        "</body></html>\n"
    )
    return path


def write_report(study: optuna.Study, out_dir: Path) -> Report:
    """Everything ``autotune report`` writes, from the database alone (nothing is run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    sel = select(study)
    ladder = build_ladder(study, space)
    pareto = pareto_plot(sel, ladder, out_dir / "pareto.png", f"study {study.study_name}")
    memory = memory_plot(
        ladder, out_dir / "memory.png", "memory at the peak, by part, along the ablation ladder"
    )
    pngs: dict[str, Path | None] = {"pareto": pareto, "memory": memory}
    md = write_markdown(out_dir / "report.md", study, sel, ladder, pngs)
    page = write_html(out_dir / "report.html", study, sel, ladder, pngs)
    return Report(out_dir, pareto, memory, md, page, ladder)
