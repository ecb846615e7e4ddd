"""The report as a person sees it: memory split by role checked against hand counts, every kind
of trial on the Pareto plot, the answer block first, and report.html opened in headless Chromium.

One real study: the exact reference (runs), the plain baseline under the budget (a real OOM,
stopped at the budget), one trial killed by its time limit (failed); and beside it an estimate
study (predicted trials, some over the budget)."""

from __future__ import annotations

import contextlib
import html
import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from click.testing import CliRunner
from matplotlib import image
from rich.console import Console

from autotune.cli import main, next_commands
from autotune.display import commands_grid
from autotune.report import KINDS, MIB, Bar, memory_figure, pareto_figure
from autotune.runner import SubprocessRunner
from autotune.selector import Row, Selection, rows_of, select
from autotune.space import SearchSpace
from autotune.study import Objective, TrialCrashed, ensure_reference, settings_of
from tests.conftest import DATA, SMALL_ARGS, cli, tiny_spec
from tests.studies import make_study
from trials.job import run_trial

STUDY = "view"
PLAIN = {
    "gradient_checkpointing": "off",
    "precision": "fp32",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 8,
}
#: tiny-llama's parameters, counted by hand from its config (vocab 8192, hidden 256,
#: intermediate 688, 4 layers, untied embeddings): embedding and head V*h each; per layer
#: q, k, v, o (h*h each), gate, up, down (h*688 each) and two RMSNorm weights (h each); final norm
N_PARAMS = 2 * 8192 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 688 + 2 * 256) + 256
N_TENSORS = 2 + 4 * 9 + 1  # parameter tensors: AdamW keeps one 4-byte step counter for each


def test_breakdown_at_the_peak_matches_a_hand_count() -> None:
    """Micro-batch 2 (4 accumulation steps): from the second micro-batch on, every gradient is
    alive, so at the peak: parameters 4 B/param, gradients 4 B/param, AdamW states 8 B/param
    plus a 4-byte step per tensor; the parts add up to the tracker's peak exactly."""
    result = run_trial(tiny_spec({"micro_batch_size": 2}))
    assert result.status == "ok", result.error
    b = result.memory_breakdown
    assert N_PARAMS == 7_358_720
    assert b["parameters"] == 4 * N_PARAMS
    assert b["gradients"] == 4 * N_PARAMS
    assert b["optimizer_states"] == 8 * N_PARAMS + 4 * N_TENSORS
    assert b["activations"] > 0 and b["other"] > 0
    assert sum(b.values()) == result.peak_bytes
    # construction: the model alone (and its rotary buffer), far below the training peak
    assert result.construction_breakdown["parameters"] == 4 * N_PARAMS
    assert result.construction_breakdown["gradients"] == 0
    assert sum(result.construction_breakdown.values()) == result.construction_peak_bytes
    assert result.construction_peak_bytes < result.training_peak_bytes == result.peak_bytes


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("view")
    url = f"sqlite:///{path / 'autotune.db'}"
    study = make_study(url, STUDY, DATA / "ladder_space.yaml", budget="150MB")
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    ensure_reference(study, space)
    study.enqueue_trial(space.params_for(PLAIN))  # ~175 MiB: out of memory at 150 MB
    objective = Objective(study, space, SubprocessRunner(path / "runs"))
    study.optimize(objective, n_trials=2, catch=(TrialCrashed,))
    study.enqueue_trial(space.params_for({**PLAIN, "precision": "bf16"}))
    hurried = Objective(study, space, SubprocessRunner(path / "runs", timeout_s=0.5))
    study.optimize(hurried, n_trials=1, catch=(TrialCrashed,))
    with contextlib.chdir(path):
        # 200 MB: full training fits without ZeRO (~160 MiB); ZeRO carries DeepSpeed's default
        # 5e8-element gradient bucket (1 GB in bf16), which no tiny-model budget holds
        predicted = cli(
            "run", "--model", "tiny-llama", "--budget", "200MB", "--backend", "estimate",
            "--trials", "8", "--study-name", "predicted", *SMALL_ARGS,
        )  # fmt: skip
        assert predicted.exit_code == 0, predicted.output
        (path / "predicted.txt").write_text(predicted.output)
        reported = cli("report", "--study", STUDY, "--out", "rep")
        assert reported.exit_code == 0, reported.output
    return path


def _study(path: Path, name: str = STUDY) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path / 'autotune.db'}")


def test_every_kind_of_trial_has_a_marker_in_the_legend(study_dir: Path) -> None:
    measured, predicted = _study(study_dir), _study(study_dir, "predicted")
    states = {t.number: t.state for t in measured.trials}
    assert optuna.trial.TrialState.FAIL in states.values()
    sel = select(measured)
    # both studies on one picture, their trial numbers apart
    rows = sel.rows + [replace(r, number=r.number + 1000) for r in rows_of(predicted)]
    both = Selection(rows, sel.winner, sel.pareto, None, sel.budget_bytes)
    fig = pareto_figure(both, None, "both")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    statuses = [t.user_attrs.get("status") for t in measured.trials]
    n_failed = sum(s == "failed" for s in statuses)
    n_oom = sum(s == "oom" for s in statuses)
    assert f"{KINDS['failed'][0]}: {n_failed}" in legend and n_failed == 1
    assert f"{KINDS['oom'][0]}: {n_oom}" in legend and n_oom == 1
    assert any(label.startswith(KINDS["fits"][0] + ":") for label in legend)
    assert any("(predicted)" in label for label in legend)
    assert f"winner: trial {sel.winner.number}" in legend if sel.winner else False
    assert any(label.startswith("Pareto front") for label in legend)
    # every trial is a drawn point: the scatter offsets count the trials of each study
    drawn = sum(len(c.get_offsets()) for c in fig.axes[0].collections if c.get_label() in legend)
    assert drawn == len(measured.trials) + len(predicted.trials) + 1  # + the winner's star


def _grey_levels(png: Path) -> np.ndarray:
    pixels = np.asarray(image.imread(png))[..., :3]
    return pixels @ np.array([0.299, 0.587, 0.114])


def test_pngs_have_content(study_dir: Path) -> None:
    for name in ("pareto.png", "memory.png"):
        grey = _grey_levels(study_dir / "rep" / name)
        assert grey.shape[0] > 400 and grey.shape[1] > 600
        assert grey.std() > 0.05, name  # not blank
        assert len(np.unique((grey * 255).astype(int))) > 30, name  # shades apart in grey-scale


CHECK = """<script>
window.__errors = [];
window.addEventListener('error',
  e => window.__errors.push(String(e.message || e.target.src)), true);
window.addEventListener('load', () => {
  const r = {
    errors: window.__errors,
    images: [...document.images].map(i => ({id: i.id, complete: i.complete,
      width: i.naturalWidth, height: i.naturalHeight, inline: i.src.startsWith('data:image/png')})),
    tables: Object.fromEntries([...document.querySelectorAll('table')].map(
      t => [t.id, t.tBodies[0].rows.length])),
    title: document.title,
  };
  document.documentElement.setAttribute('data-check', JSON.stringify(r));
});
</script>"""


def test_report_html_opens_in_chromium(study_dir: Path, tmp_path: Path) -> None:
    """The report alone (copied elsewhere: nothing beside it), opened by headless Chromium."""
    browser = shutil.which("chromium")
    assert browser, "chromium is not installed: run scripts/install_chromium.sh"
    page = tmp_path / "sent.html"
    page.write_text(
        (study_dir / "rep" / "report.html").read_text().replace("<head>", "<head>" + CHECK, 1)
    )
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000"]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    start = dom.index('data-check="') + len('data-check="')
    check: dict[str, Any] = json.loads(html.unescape(dom[start : dom.index('"', start)]))
    assert check["errors"] == []
    assert {i["id"] for i in check["images"]} == {"pareto", "memory"}
    for img in check["images"]:
        assert img["complete"] and img["inline"] and img["width"] > 600 and img["height"] > 400
    study = _study(study_dir)
    assert check["tables"]["trials"] == len(study.trials)
    assert check["tables"]["ladder"] >= 2  # the baseline and the winner at least
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert _grey_levels(shot).std() > 0.05


def test_ladder_says_what_is_left_and_how_long(study_dir: Path) -> None:
    page = (study_dir / "rep" / "report.html").read_text()
    md = (study_dir / "rep" / "report.md").read_text()
    assert "Rungs still to measure" in md and "autotune resume --study view" in md
    wall = [t.user_attrs["wall_s"] for t in _study(study_dir).trials if t.user_attrs.get("wall_s")]
    assert wall and "per trial" in md
    assert "<p id='pending'>" in page
    assert "change vs rung below" in md and "tokens/s" in md


def test_run_answers_first(study_dir: Path) -> None:
    # a trial-backend study: the answer block (resume with no trials reports as run does)
    with contextlib.chdir(study_dir):
        measured = CliRunner().invoke(
            main, ["resume", "--study", STUDY, "--trials", "0"], env={"COLUMNS": "120"}
        )
    assert measured.exit_code == 0, measured.output
    out = measured.output
    sel = select(_study(study_dir))
    winner = sel.winner
    assert winner is not None
    answer = out[out.index(f"winner: trial {winner.number}") :]
    for word in ("why", "memory", "export", "resume", "report", "autotune export --study view"):
        assert word in answer
    assert "tok/s" not in out  # no table of every trial unless asked (--table, `show`)
    # the counts line, then the answer
    assert out.index(f"{len(sel.rows)} trials: ") < out.index("winner: trial")
    # an estimate study: its answer is the best per fidelity class, not the selector's winner
    predicted = (study_dir / "predicted.txt").read_text()
    assert "tok/s" not in predicted
    answer = predicted[predicted.index("best per fidelity class") :]
    assert "predicted best for" in answer and "autotune export --study predicted" in answer
    with contextlib.chdir(study_dir):
        shown = CliRunner().invoke(main, ["show", "--study", "predicted"])
    assert "tok/s" in shown.output  # show prints the table
    # (the terminal's width: test_hardening.test_the_table_follows_the_terminal_width)


@pytest.mark.parametrize(
    ("name", "url", "storage_args"),
    [
        ("plain", "sqlite:///autotune.db", []),
        (
            "it's [bold]$(touch pwned)",
            "sqlite:///my dir/x.db",
            ["--storage", "sqlite:///my dir/x.db"],
        ),
        ("pg", "postgresql://bob:s3cret-pw@db/x", []),  # a password is never printed
    ],
)
def test_the_next_commands_are_commands_bash_reads_back(
    name: str, url: str, storage_args: list[str], tmp_path: Path
) -> None:
    """Each command of the answer block, pasted into bash, is the command meant, whatever the
    study's name; the printed block (rich markup escaped) shows them as they are."""
    commands = next_commands(name, url)
    assert not any("s3cret" in c for c in commands.values())
    if url.startswith("postgresql"):
        assert "AUTOTUNE_STORAGE" in commands["storage"]
    tails = {
        "export": ["--format", "deepspeed", "--out", "ds_config.json"],
        "resume": ["--trials", "12"],
        "report": ["--out", "autotune_report"],
    }
    for label, tail in tails.items():
        argv = subprocess.run(
            ["bash", "-c", f'autotune() {{ printf "%s\\0" "$@"; }}; {commands[label]}'],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        ).stdout.split("\0")[:-1]  # fmt: skip
        assert argv == [label, "--study", name, *storage_args, *tail]
    assert not list(tmp_path.glob("pwned*"))
    console = Console(width=400, record=True, emoji=False)
    console.print(commands_grid(commands))
    printed = console.export_text()
    assert all(commands[label] in printed for label in tails)


def _bar(number: int, rss: int, offloaded: int) -> Bar:
    row = Row(
        number, {}, "ok", 100 * MIB, 1.0, None, None, True, None,
        memory_breakdown={"parameters": 100 * MIB, "host_offloaded": offloaded},
        host_peak_bytes=rss,
    )  # fmt: skip
    return Bar(f"#{number}", row, host_offloaded=offloaded)


def test_host_panel_draws_the_resident_set_the_offloaded_part_and_a_near_limit() -> None:
    """Right panel: one bar per trial at its host peak (resident set), the offloaded part drawn
    inside it; the --host-memory limit drawn when near the bars, named when far above them."""
    bars = [_bar(0, 600 * MIB, 0), _bar(1, 900 * MIB, 300 * MIB)]
    near = memory_figure(bars, 150 * MIB, 1200 * MIB, "t").axes[1]
    heights = sorted(round(p.get_height()) for p in near.patches)
    assert heights == [0, 300, 600, 900]  # two resident sets, two offloaded parts (one 0)
    assert [round(line.get_ydata()[0]) for line in near.get_lines()] == [1200]
    assert near.get_ylim()[1] > 1200
    far = memory_figure(bars, 150 * MIB, 128 * 2**30, "t").axes[1]
    assert not far.get_lines() and far.get_ylim()[1] < 1200  # the bars keep the axis
    assert any("host limit 128 GiB" in t.get_text() for t in far.texts)
