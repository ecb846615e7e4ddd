"""Data other tools wrote, names that carry terminal sequences, inputs whose cost has no bound:
each a flagged trial or one clear line, through the real CLI on a real SQLite study."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from click.testing import CliRunner, Result

from autotune.cli import main
from autotune.space import SearchSpace
from autotune.study import settings_of
from tests.conftest import SMALL_SPACE
from tests.studies import make_study
from tests.test_hardening import ROOT, _fitted


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _one_line(result: Result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]
    return lines[0]


# --- trials and settings another tool wrote ---------------------------------------------------

JUNK: dict[str, dict[str, Any]] = {
    "peak text": {"peak_bytes": "lots"},
    "speed infinite": {"tokens_per_s": math.inf},
    "speed negative": {"tokens_per_s": -5.0},
    "peak a list": {"peak_bytes": [1, 2]},
    "breakdown text": {"memory_breakdown": {"parameters": "many"}},
    "breakdown a list": {"memory_breakdown": [1]},
    "verdict text": {"loss_verdict": "fine"},
    "verdict keys": {"loss_verdict": {"nonsense": 1}},
    "config text": {"config": "zero3"},
    "status a number": {"status": 7},
    "host peak a bool": {"host_peak_bytes": True},
}


@pytest.mark.parametrize("junk", list(JUNK.values()), ids=list(JUNK))
def test_a_trial_written_by_another_tool_is_a_flagged_failure(
    junk: dict[str, Any], in_tmp: Path
) -> None:
    study = _fitted(f"sqlite:///{in_tmp / 'autotune.db'}")
    winner_before = json.loads(_cli("show", "--json").stdout)["winner"]
    ref = study.trials[0].user_attrs["config"]
    attrs = {"config": ref, "status": "ok", "peak_bytes": 10, "tokens_per_s": 9e9, **junk}
    study.add_trial(optuna.trial.create_trial(values=[9e9, 0.0], user_attrs=attrs))
    shown = _cli("show")
    assert shown.exit_code == 0, shown.output
    as_json = _cli("show", "--json")
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    junk_row = data["trials"][-1]
    assert junk_row["status"] == "failed" and "not autotune's" in junk_row["error"]
    assert data["winner"] == winner_before  # the junk never wins
    for args in (["export", "--format", "hf", "--out", "x.json"], ["report", "--out", "r"]):
        result = _cli(*args)
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "settings",
    [
        "junk",
        42,
        ["a"],
        {"model": 5},
        {"budget_bytes": "1GB"},
        {"space": "all"},
        {"model_config": {"num_hidden_layers": 10**12, "vocab_size": 256}},
    ],
    ids=["text", "number", "list", "model number", "budget text", "space text", "layers"],
)
def test_junk_settings_are_one_line_for_every_command(settings: Any, in_tmp: Path) -> None:
    study = _fitted(f"sqlite:///{in_tmp / 'autotune.db'}")
    stored = study.user_attrs["settings"]
    study.set_user_attr(
        "settings", {**stored, **settings} if isinstance(settings, dict) else settings
    )
    for args in (["show"], ["show", "--json"], ["export", "--format", "hf", "--out", "x.json"],
                 ["report", "--out", "r"], ["resume", "--study", "fitted", "--trials", "1"],
                 ["worker", "--study", "fitted", "--trials", "1"]):  # fmt: skip
        _one_line(_cli(*args), "settings")
    assert sorted(p.name for p in in_tmp.iterdir()) == ["autotune.db"]


# --- what reaches the terminal ----------------------------------------------------------------

#: set the clipboard, set the window title, clear the screen, a bell, a C1 control (CSI)
SEQUENCES = "\x1b]52;c;cHduZWQ=\x07\x1b]0;owned\x1b\\\x1b[2J\x07\x9b31m"


def test_names_with_terminal_sequences_reach_no_terminal(in_tmp: Path) -> None:
    url = f"sqlite:///{in_tmp / 'autotune.db'}"
    study = _fitted(url)
    storage = optuna.storages.RDBStorage(url)
    name = "evil" + SEQUENCES
    # another tool renames the study (autotune refuses such names itself)
    with storage.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE studies SET study_name = ? WHERE study_name = 'fitted'",
                             (name,))  # fmt: skip
    storage.engine.dispose()
    study.set_user_attr("reference_losses", [9.0, 8.9, 8.8, 8.7])
    outputs = [
        _cli("show"),
        _cli("show", "--study", "other" + SEQUENCES),  # the "no study named" error
        _cli("resume", "--study", "nope"),  # lists the studies there
        _cli("export", "--format", "command", "--out", "x.sh"),
        _cli("report", "--out", "r"),
    ]
    for result in outputs:
        text = result.output
        assert not any(c in text for c in "\x1b\x07\x9b"), repr(text)
    assert "evil\\x1b]52" in outputs[0].stdout  # shown, escaped
    assert "no study named 'other\\x1b]52" in outputs[1].stderr
    for name in ("report.md", "report.html"):
        assert "evil\\x1b]52" in (in_tmp / "r" / name).read_text()
        assert "\x1b" not in (in_tmp / "r" / name).read_text()


# --- two controllers started together ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_a_controller_waits_for_another_measuring_the_same_configuration(
    tmp_path: Path,
) -> None:
    """Another controller (this test's process) is measuring configuration X as trial 0; a
    worker (a second real process) then draws X too (queued, as a second reference or the
    same plan would be). It waits while trial 0 runs and reuses its result; it measures
    nothing, and no job folder is made for its trial."""
    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    study = make_study(url, "together", SMALL_SPACE, "1GB")
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    config = space.reference_config()
    running = study.ask()  # trial 0: RUNNING, its configuration recorded as the objective does
    running.set_user_attr("config", config)
    study.enqueue_trial(space.params_for(config))  # trial 1: what the worker draws
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "worker", "--study", "together", "--trials", "1",
         "--storage", url], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while True:  # the worker's trial 1 has started and recorded X
        t1 = next(t for t in study.get_trials() if t.number == 1)
        if t1.state.name == "RUNNING" and "config" in t1.user_attrs:
            break
        assert worker.poll() is None, worker.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(3)  # the worker would measure now if it did not wait
    assert [t.state.name for t in study.get_trials()] == ["RUNNING", "RUNNING"]
    for key, value in {"status": "ok", "peak_bytes": 140 * 2**20, "tokens_per_s": 1234.0,
                       "losses": [9.0, 8.9, 8.8, 8.7]}.items():  # fmt: skip
        running.set_user_attr(key, value)
    study.tell(running, [1234.0, 140.0])
    out, err = worker.communicate(timeout=300)
    assert worker.returncode == 0, out + err
    reused = next(t for t in study.get_trials() if t.number == 1)
    assert reused.state.name == "COMPLETE" and reused.user_attrs["duplicate_of"] == 0
    assert reused.user_attrs["tokens_per_s"] == 1234.0
    assert not list(tmp_path.rglob("trial-1*"))  # no job ran for it
