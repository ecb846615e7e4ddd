"""The answer's certainty line: untried configurations the corrected estimator ranks within 10%
of the winner, on the console and in ``show --json``, through the real CLI and real trials."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import optuna

from tests.conftest import NO_PROBES, SMALL_ARGS, SMALL_SPACE, cli


def test_a_study_says_what_it_has_not_measured_that_could_win(tmp_path: Path) -> None:
    with contextlib.chdir(tmp_path):
        done = cli(
            "run", "--model", "tiny-llama", "--budget", "150MB", "--space", str(SMALL_SPACE),
            *SMALL_ARGS, *NO_PROBES, "--trials", "2",
        )  # fmt: skip
        assert done.exit_code == 0, done.output
        shown = cli("show", "--json")
        assert shown.exit_code == 0, shown.output
    line = " ".join(done.output.split())  # the console wraps long lines
    got = json.loads(shown.output)["unmeasured_contenders"]
    assert got["within"] == 0.1
    count = got["count"]
    storage = f"sqlite:///{tmp_path / 'autotune.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
    measured = {json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials}
    # the small space's grid, less what was measured, bounds it
    from autotune.availability import Hardware
    from autotune.space import SearchSpace

    grid = SearchSpace.load(SMALL_SPACE).resolve(8, Hardware.detect("cpu")).grid()
    assert 0 <= count <= len(grid) - len(measured)
    if count:
        match = re.search(r"within 10% of the winner: (\d+) not yet measured", line)
        assert match and int(match.group(1)) == count, line
        assert f"autotune resume --study {summary.study_name}" in line
        assert f"--trials {count}" in line
    else:
        assert "every configuration the estimator ranks within 10% of the winner" in line
