"""Progress through the real CLI with its output piped (a file, a CI log): a line per finished
trial (number, configuration, peak, tokens/s, verdict) with the time left, a line when a long
phase starts, and no animated bar. The oracle for each trial line is the trial as the database
holds it (``autotune show --json``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.units import format_size
from tests.conftest import DATA

ROOT = Path(__file__).resolve().parent.parent
#: a trial line: its number, (finished/total), the configuration, peak, tokens/s, verdict
TRIAL_LINE = re.compile(
    r"^trial (\d+) \((\d+)/(\d+)\) (.+): peak (\S+ \S+), ([\d,-]+) tokens/s, (.+?)"
    r"(; about .+ left)?$"
)
#: the animated bar of a terminal ("trials ━━━━ 3/8 ..."): never in a pipe
BAR = re.compile(r"^\s*trials\s.*━", re.MULTILINE)


def _autotune(tmp: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args, "--storage", f"sqlite:///{tmp / 'a.db'}"],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,  # a pipe: no terminal
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def _trial_lines(out: str) -> list[re.Match[str]]:
    return [m for line in out.splitlines() if (m := TRIAL_LINE.match(line))]


def _check_against_database(tmp: Path, lines: list[re.Match[str]], study: str) -> None:
    shown = json.loads(_autotune(tmp, "show", "--study", study, "--json"))
    by_number = {t["number"]: t for t in shown["trials"]}
    total = len(lines)
    for i, m in enumerate(lines, 1):
        trial = by_number[int(m.group(1))]
        assert (int(m.group(2)), int(m.group(3))) == (i, total)
        assert m.group(5) == format_size(trial["peak_bytes"])
        assert m.group(6) == f"{trial['tokens_per_s']:,.0f}"
        assert m.group(7).startswith("fits" if trial["fits"] else "over the budget")
        # every line but the last says how long the rest takes
        assert (m.group(8) is not None) == (i < total), m.group(0)


def test_predictions_piped_print_a_line_per_trial_and_no_bar(tmp_path: Path) -> None:
    out = _autotune(
        tmp_path, "run", "--model", "tiny-llama", "--budget", "300MB", "--backend", "estimate",
        "--space", str(DATA / "tiny_space.yaml"), "--study-name", "p",
    )  # fmt: skip
    assert not BAR.search(out), out
    lines = _trial_lines(out)
    assert lines, out
    assert all("(predicted, not measured)" in m.group(7) for m in lines)
    _check_against_database(tmp_path, lines, "p")
    assert "tracing the best configuration's step on fake tensors" in out


@pytest.mark.slow
def test_real_trials_piped_say_each_trial_and_each_long_phase(tmp_path: Path) -> None:
    """The reference and a bf16 trial (real CPU jobs), the bf16 loss probe (two seeds, next to
    fp32 AdamW) and the side-by-side re-measurement of both, output piped."""
    env_cache = tmp_path / "cache"
    os.environ["AUTOTUNE_CACHE"] = str(env_cache)  # a fresh probe cache: the probes must train
    try:
        out = _autotune(
            tmp_path, "run", "--model", "tiny-llama", "--budget", "300MB",
            "--space", str(DATA / "precision_space.yaml"), "--seq-len", "64",
            "--global-batch-size", "8", "--trials", "2", "--probe-steps", "20",
            "--confirm-rounds", "1", "--study-name", "r",
        )  # fmt: skip
    finally:
        del os.environ["AUTOTUNE_CACHE"]
    assert not BAR.search(out), out
    lines = _trial_lines(out)
    assert len(lines) == 2, out
    _check_against_database(tmp_path, lines, "r")
    verdicts = {m.group(4): m.group(7) for m in lines}
    assert "the loss reference" in next(v for c, v in verdicts.items() if "bf16" not in c)
    assert "on the loss probe" in next(v for c, v in verdicts.items() if "bf16" in c)
    probes = [ln for ln in out.splitlines() if ln.startswith("loss probe: ")]
    assert len(probes) == 4, out  # fp32 AdamW and bf16, two seeds each
    again = [ln for ln in out.splitlines() if ln.startswith("re-measuring the finalists")]
    assert len(again) == 2 and again[-1].endswith("(2/2)"), out
    # each phase line comes before the trial line it belongs to (the bf16 trial's probes)
    text = out.splitlines()
    assert text.index(probes[-1]) < text.index(lines[1].group(0))
