"""The ablation ladder, the report and its plots, `show --json`, and the study as optuna-dashboard
reads it: all from one real small study of real CPU trials, run through the real CLI."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import numpy as np
import optuna
import pytest
from matplotlib import image

from autotune.ladder import baseline_config, build_ladder, compose, ladder_cells, run_ladder
from autotune.runner import SubprocessRunner
from autotune.selector import select
from autotune.space import SearchSpace
from autotune.study import Objective, TrialCrashed, settings_of
from tests.conftest import DATA, NO_PROBES, SMALL_ARGS, cli

BUDGET = "150MB"  # the plain baseline (~175 MiB) does not fit; checkpointing (~136 MiB) does
STUDY = "tiny-llama-150MB-cpu"
RUN = [
    "run",
    "--model",
    "tiny-llama",
    "--budget",
    BUDGET,
    "--space",
    str(DATA / "ladder_space.yaml"),
    *SMALL_ARGS,
    *NO_PROBES,
]


def _study(path: Path) -> optuna.Study:
    return optuna.load_study(study_name=STUDY, storage=f"sqlite:///{path / 'autotune.db'}")


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sampled trials (the reference first), then the ladder to the winner, then the report."""
    path = tmp_path_factory.mktemp("ladder")
    with contextlib.chdir(path):
        ran = cli(*RUN, "--trials", "2", "--ladder")
        assert ran.exit_code == 0, ran.output
        (path / "run.txt").write_text(ran.output)
        reported = cli("report", "--out", "rep")
        assert reported.exit_code == 0, reported.output
        (path / "report.txt").write_text(reported.output)
    return path


def test_ladder_climbs_from_baseline_to_winner_one_technique_at_a_time(study_dir: Path) -> None:
    study = _study(study_dir)
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    ladder = build_ladder(study, space)
    winner = select(study).winner
    assert winner is not None and ladder.target is not None
    assert ladder.complete, ladder.missing
    assert ladder.steps[0].config == {
        "gradient_checkpointing": "off",
        "precision": "fp32",
        "attention": "sdpa",
        "optimizer": "adamw",
        "micro_batch_size": 8,
    }
    assert ladder.steps[-1].config == winner.config
    # monotone in the technique set: each rung keeps every earlier technique and adds one
    for below, above in zip(ladder.steps, ladder.steps[1:], strict=False):
        assert set(below.techniques) < set(above.techniques)
        assert len(above.techniques) == len(below.techniques) + 1
        assert above.techniques[: len(below.techniques)] == below.techniques
    for step in ladder.steps:
        assert step.measured and step.row is not None and not step.estimated
        for dim in step.techniques:
            assert step.config[dim] == winner.config[dim]
    # the rungs ran without the budget: the baseline's peak over the budget is its true peak
    base = ladder.steps[0].row
    assert base is not None and base.role == "ladder"
    assert base.peak_bytes > ladder.budget_bytes and base.tokens_per_s > 0
    assert base.status == "oom"  # still a violation of the budget for the sampler
    trial = _study(study_dir).trials[base.number]
    assert trial.constraints["memory"] > 0
    cells = ladder_cells(ladder)
    assert cells[0]["adds"] == "baseline" and cells[0]["fits"] == "no"
    assert cells[-1]["fits"] == "yes" and cells[-1]["trial"] == f"#{ladder.steps[-1].row.number}"


def test_a_second_ladder_run_measures_nothing_new(study_dir: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(study_dir)
    before = len(_study(study_dir).trials)
    again = cli("resume", "--study", STUDY, "--trials", "0", "--ladder")
    assert again.exit_code == 0, again.output
    assert len(_study(study_dir).trials) == before
    assert "ablation ladder" in again.output


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(image.imread(path))


def test_report_writes_non_trivial_plots_and_a_summary(study_dir: Path) -> None:
    rep = study_dir / "rep"
    for name in ("pareto.png", "memory.png"):
        png = rep / name
        assert png.is_file() and png.stat().st_size > 20_000, name
        pixels = _pixels(png)
        assert pixels.shape[0] > 400 and pixels.shape[1] > 600
        assert pixels[..., :3].std() > 0.05  # drawn, not blank
        colours = {tuple(p) for p in (pixels[::4, ::4, :3] * 255).astype(int).reshape(-1, 3)}
        assert len(colours) > 50
    md = (rep / "report.md").read_text()
    assert "![Pareto plot](pareto.png)" in md and "![Memory breakdown](memory.png)" in md
    assert "| 0 | baseline |" in md and "winner: trial" in md
    html = (rep / "report.html").read_text()
    assert '<img id="pareto" src="data:image/png;base64,' in html and "<table id='ladder'>" in html
    out = (study_dir / "report.txt").read_text()
    assert "ablation ladder" in out and "wrote rep/pareto.png" in out


def test_tables_fit_the_terminal(study_dir: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(study_dir)
    monkeypatch.setenv("COLUMNS", "100")
    shown = cli("show")
    assert shown.exit_code == 0
    for text in (shown.output, (study_dir / "run.txt").read_text()):
        assert "GiB" in text or "MiB" in text
        assert max(len(line) for line in text.splitlines()) <= 100


def test_show_json(study_dir: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(study_dir)
    shown = cli("show", "--json")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    study = _study(study_dir)
    assert data["study"] == STUDY and data["budget_bytes"] == 150_000_000
    assert len(data["trials"]) == len(study.trials)
    winner = select(study).winner
    assert winner is not None and data["winner"] == winner.number
    row = next(t for t in data["trials"] if t["number"] == winner.number)
    assert row["feasible"] and row["config"] == winner.config


def _get(app: Any, path: str) -> Any:
    environ: dict[str, Any] = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    environ["wsgi.input"] = io.BytesIO()
    status: list[str] = []
    body = b"".join(app(environ, lambda s, h, *a: status.append(s)))
    assert status[0].startswith("200"), (path, status, body[:200])
    return json.loads(body)


def test_optuna_dashboard_reads_the_study(study_dir: Path) -> None:
    """The dashboard's own API (its WSGI app, no server) serves every attribute we store."""
    from optuna_dashboard import wsgi

    storage = f"sqlite:///{study_dir / 'autotune.db'}"
    study = optuna.load_study(study_name=STUDY, storage=storage)
    assert study.metric_names == ["tokens_per_s", "peak_mib"]
    app = wsgi(storage)
    summaries = _get(app, "/api/studies")["study_summaries"]
    (summary,) = [s for s in summaries if s["study_name"] == STUDY]
    detail = _get(app, f"/api/studies/{summary['study_id']}")
    assert detail["objective_names"] == ["tokens_per_s", "peak_mib"]
    assert {a["key"] for a in detail["user_attrs"]} >= {"settings", "reference_losses"}
    assert len(detail["trials"]) == len(study.trials)
    for served, trial in zip(detail["trials"], study.trials, strict=True):
        keys = {a["key"] for a in served["user_attrs"]}
        assert keys == set(trial.user_attrs), trial.number
        assert {"config", "status", "peak_bytes", "tokens_per_s"} <= keys
        # Optuna 5 names constraints; the dashboard shows them through the user attr copy
        assert set(trial.constraints) == {"memory", "loss", "failed"}
        shown = next(a["value"] for a in served["user_attrs"] if a["key"] == "constraints")
        assert json.loads(shown) == trial.constraints
        assert [p["name"] for p in served["params"]] == list(trial.params)
        assert trial.system_attrs is not None  # readable (enqueued trials keep fixed params)
    assert detail["best_trials"]  # the Pareto front the dashboard draws


def test_rungs_follow_the_space_rules() -> None:
    """A rung the rules forbid is never proposed; a dependent dimension travels with its parent."""
    space = SearchSpace.load(None)  # forbids eager attention at micro-batch 16
    base = baseline_config(space, 16)
    plain = {"gradient_checkpointing": "off", "precision": "fp32", "attention": "sdpa"}
    plain |= {"optimizer": "adamw", "micro_batch_size": 16}
    assert {k: base[k] for k in plain} == plain
    assert base.get("zero_stage", 0) == 0 and base.get("quantization", "none") == "none"
    target = {**base, "gradient_checkpointing": "selective", "checkpoint_every": 2}
    target |= {"checkpoint_save": "attention", "attention": "eager", "micro_batch_size": 2}
    assert compose(space, base, target, ["attention"]) is None
    assert compose(space, base, target, ["gradient_checkpointing"]) == {
        **base,
        "gradient_checkpointing": "selective",
        "checkpoint_every": 2,
        "checkpoint_save": "attention",
    }
    assert compose(space, base, target, ["micro_batch_size", "attention"]) == {
        **base,
        "attention": "eager",
        "micro_batch_size": 2,
    }


def test_ladder_to_a_chosen_config_takes_the_biggest_saving_first(
    study_dir: Path, monkeypatch: Any
) -> None:
    """Climb to checkpointing + bf16 (at most one more real trial: bf16 alone). Over the budget
    the greedy rule takes the biggest measured saving first, and the table shows how bf16's
    saving on the baseline alone differs from its saving once checkpointing is in."""
    monkeypatch.chdir(study_dir)
    study = _study(study_dir)
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    objective = Objective(study, space, SubprocessRunner(study_dir / "extra"))

    def optimize(n: int) -> None:
        study.optimize(objective, n_trials=n, catch=(TrialCrashed,))

    target = {**baseline_config(space, 8), "gradient_checkpointing": "full", "precision": "bf16"}
    ladder = run_ladder(study, space, optimize, target=target)
    assert ladder.complete
    assert [s.techniques for s in ladder.steps] == [
        (),
        ("gradient_checkpointing",),
        ("gradient_checkpointing", "precision"),
    ]
    base, ckpt, both = (s.row for s in ladder.steps)
    assert base is not None and ckpt is not None and both is not None
    assert both.config == target
    bf16_alone = ladder.steps[2].alone_saving
    assert bf16_alone is not None
    # checkpointing was taken first because it saves more on the baseline than bf16 does
    assert base.peak_bytes - ckpt.peak_bytes > bf16_alone
    # the interaction: bf16's saving on top of checkpointing is not its saving alone
    assert ckpt.peak_bytes - both.peak_bytes != bf16_alone
