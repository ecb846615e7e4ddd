"""The installed (non-editable) wheel carries the YAML search spaces and the trial job."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_loads_default_space_outside_the_source_tree(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("autotune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "search_spaces/default.yaml" in names and "trials/job.py" in names
    assert "autotune/commands/run.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import autotune, trials; from autotune.space import SearchSpace; "
        # the command line, its commands in a package of their own
        "import autotune.cli, autotune.commands.run; "
        f"s = SearchSpace.load(); assert autotune.__file__.startswith({str(site)!r}); "
        "print(len(s.dimensions))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
        check=True,
        capture_output=True,
        text=True,
    )
    assert int(out.stdout) >= 6
