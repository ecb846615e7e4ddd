"""What ``export`` and ``report`` write: only what the user named, never the study's database,
never through a link they did not make, a FIFO never opened; a failed report leaves no folder.
Run through the real CLI on a real SQLite study (``tests.test_hardening._fitted``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from autotune.cli import main
from tests.test_hardening import ROOT, _fitted

FORMATS = ["deepspeed", "hf", "accelerate", "axolotl", "command"]


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _one_line(result: Result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def fitted(in_tmp: Path) -> Path:
    db = in_tmp / "autotune.db"
    _fitted(f"sqlite:///{db}")
    return db


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_export_never_writes_onto_the_study_database(
    fmt: str, force: list[str], fitted: Path
) -> None:
    before = _sha(fitted)
    for out in ("autotune.db", "./autotune.db", str(fitted), "autotune.db-journal"):
        if out.endswith("-journal"):
            fitted.with_name(out).write_bytes(b"")  # a journal SQLite left beside it
        _one_line(_cli("export", "--format", fmt, "--out", out, *force), "study's own database")
    (fitted.parent / "db-link.json").symlink_to(fitted)
    _one_line(_cli("export", "--format", fmt, "--out", "db-link.json", "--force"), "database")
    assert _sha(fitted) == before
    assert _cli("show").exit_code == 0  # the study is still there


def test_export_refuses_files_it_did_not_write_unless_forced(fitted: Path) -> None:
    mine = {"x.json": "my notes\n", "x.autotune.json": '{"mine": 1}\n'}
    for name, text in mine.items():
        (fitted.parent / name).write_text(text)
        _one_line(_cli("export", "--format", "hf", "--out", "x.json"), name, "--force")
        assert (fitted.parent / name).read_text() == text
        (fitted.parent / name).unlink()
    # a side file of another name: the accelerate YAML the command export names
    (fitted.parent / "run.accelerate.yaml").write_text("mine: 1\n")
    _one_line(_cli("export", "--format", "command", "--out", "run.sh"), "run.accelerate.yaml")
    assert not (fitted.parent / "run.sh").exists()  # nothing written before the refusal
    assert _cli("export", "--format", "command", "--out", "run.sh", "--force").exit_code == 0
    assert "mine" not in (fitted.parent / "run.accelerate.yaml").read_text()


def test_export_again_replaces_its_own_files_but_not_edited_ones(fitted: Path) -> None:
    for fmt in FORMATS:
        first = _cli("export", "--format", fmt, "--out", "w.json")
        assert first.exit_code == 0, first.output
        again = _cli("export", "--format", fmt, "--out", "w.json", "--lr", "0.001")
        assert again.exit_code == 0, again.output
    companion = json.loads((fitted.parent / "w.autotune.json").read_text())
    assert set(companion["written"]) >= {"w.json"}
    edited = fitted.parent / "w.json"
    edited.write_text(edited.read_text() + "# my change\n")
    _one_line(_cli("export", "--format", "command", "--out", "w.json"), "changed since")
    assert edited.read_text().endswith("# my change\n")


def test_export_replaces_a_planted_link_only_with_force_never_its_target(fitted: Path) -> None:
    victim = fitted.parent / "victim.txt"
    victim.write_text("precious\n")
    for name in ("e.json", "e.autotune.json", "e.accelerate.yaml"):
        link = fitted.parent / name
        link.unlink(missing_ok=True)  # the forced export before wrote it
        link.symlink_to(victim)
        _one_line(_cli("export", "--format", "command", "--out", "e.json"), "symbolic link")
        forced = _cli("export", "--format", "command", "--out", "e.json", "--force")
        assert forced.exit_code == 0, forced.output
        assert not link.is_symlink() and link.is_file()
        assert victim.read_text() == "precious\n"
    assert not list(fitted.parent.glob(".*.tmp"))  # no temporary file left


def test_export_onto_a_fifo_is_refused_without_opening_it(fitted: Path) -> None:
    fifo = fitted.parent / "pipe.json"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "export", "--format", "deepspeed", "--out",
         str(fifo), "--force"],
        capture_output=True, text=True, cwd=fitted.parent, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "not a regular file" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_report_refuses_links_and_foreign_files_and_replaces_its_own(fitted: Path) -> None:
    assert _cli("report", "--out", "r").exit_code == 0
    first = {p.name: _sha(p) for p in (fitted.parent / "r").iterdir()}
    assert {"report.html", "report.md", "pareto.png"} <= set(first)
    assert _cli("report", "--out", "r").exit_code == 0  # its own files: replaced
    victim = fitted.parent / "victim.html"
    victim.write_text("precious\n")
    page = fitted.parent / "r" / "report.html"
    page.unlink()
    page.symlink_to(victim)
    _one_line(_cli("report", "--out", "r"), "symbolic link")
    assert _cli("report", "--out", "r", "--force").exit_code == 0
    assert victim.read_text() == "precious\n" and not page.is_symlink()
    (fitted.parent / "mine").mkdir()
    (fitted.parent / "mine" / "report.md").write_text("my own report\n")
    _one_line(_cli("report", "--out", "mine"), "report.md", "already exists")
    assert (fitted.parent / "mine" / "report.md").read_text() == "my own report\n"
    elsewhere = fitted.parent / "elsewhere"
    elsewhere.mkdir()
    (fitted.parent / "autotune_report").symlink_to(elsewhere)  # the default folder, planted
    _one_line(_cli("report"), "symbolic link")
    assert not list(elsewhere.iterdir())


def test_a_failed_report_leaves_no_folder(fitted: Path) -> None:
    import optuna

    study = optuna.load_study(study_name="fitted", storage=f"sqlite:///{fitted}")
    study.set_user_attr("settings", "junk written by another tool")
    _one_line(_cli("report", "--out", "r"), "settings")
    assert sorted(p.name for p in fitted.parent.iterdir()) == ["autotune.db"]


def test_the_trial_folder_stays_under_the_runs_folder_whatever_the_study_stored(
    tmp_path: Path,
) -> None:
    from autotune.study import FOLDER_ID_ATTR, workdir_for
    from tests.conftest import SMALL_SPACE
    from tests.studies import make_study

    study = make_study(f"sqlite:///{tmp_path / 'autotune.db'}", "../../up\nx", SMALL_SPACE)
    study.set_user_attr(FOLDER_ID_ATTR, "/../../../etc\n#SBATCH --wrap=x")
    root = tmp_path / "autotune_runs"
    folder = workdir_for(study, root)
    assert folder.parent == root and folder.name.isprintable() and "/" not in folder.name
    assert os.path.realpath(folder).startswith(str(root) + os.sep)
