"""Data other tools wrote, names that carry terminal sequences, inputs whose cost has no bound:
each a flagged trial or one clear line, through the real CLI on a real SQLite study."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from click.testing import CliRunner, Result

from autotune.cli import main
from tests.test_hardening import _fitted


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
    ["junk", 42, ["a"], {"model": 5}, {"budget_bytes": "1GB"}, {"space": "all"}],
    ids=["text", "number", "list", "model number", "budget text", "space text"],
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
