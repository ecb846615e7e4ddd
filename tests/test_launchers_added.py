"""A launcher defined here alone, subclassing ``autotune.launchers.Launcher``: ``run``,
``resume`` and ``worker`` take it by ``--launcher`` with its own option, store its settings with
the study and run real trials through its runner, with no command module edited."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import optuna
import pytest

from autotune.launchers import LAUNCHERS, Launcher, register_launcher
from autotune.runner import InProcessRunner, TrialRunner
from tests.conftest import NO_PROBES, SMALL_ARGS, SMALL_SPACE, cli
from trials.spec import TrialResult, TrialSpec

TAG_ATTR = "inline_tag"


class InlineRunner(TrialRunner):
    """Each trial's job in this process (``trials.job.run_trial``), its tag on the trial."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        return InProcessRunner().run(spec, name)

    def attrs_for(self, result: TrialResult) -> dict[str, Any]:
        return {TAG_ATTR: self.tag}


class InlineLauncher(Launcher):
    name = "inline"
    label = "inline"
    help = "trials in this process."

    def options(self) -> list[Any]:
        return [click.Option(["--inline-tag"], default=None, help="inline: a tag for trials.")]

    def settings(
        self, stored: dict[str, Any] | None, given: dict[str, Any], gpus_per_node: int
    ) -> dict[str, Any]:
        tag = given["inline_tag"] or (stored or {}).get("tag", "untagged")
        return {"name": self.name, "tag": tag}

    def runner(self, attrs: dict[str, Any], workdir: Path, timeout_s: float) -> TrialRunner:
        return InlineRunner(attrs["tag"])


@pytest.fixture()
def inline() -> Iterator[None]:
    register_launcher(InlineLauncher())
    yield
    del LAUNCHERS["inline"]


def _tags(db: Path) -> list[Any]:
    study = optuna.load_study(study_name="tiny-llama-300MB-cpu", storage=f"sqlite:///{db}")
    return [t.user_attrs.get(TAG_ATTR) for t in study.trials]


@pytest.mark.real_trial
def test_run_and_resume_take_a_launcher_defined_in_the_test(inline: None, in_tmp: Path) -> None:
    for command in ("run", "resume", "worker"):
        assert "--inline-tag" in cli(command, "--help").output
        assert "inline: trials in this process." in cli(command, "--help").output
    db = in_tmp / "s.db"
    storage = ["--storage", f"sqlite:///{db}"]
    ran = cli("run", "--model", "tiny-llama", "--budget", "300MB", "--space", str(SMALL_SPACE),
              *SMALL_ARGS, *NO_PROBES, "--trials", "1", *storage, "--launcher", "inline",
              "--inline-tag", "first")  # fmt: skip
    assert ran.exit_code == 0, ran.output
    study = optuna.load_study(study_name="tiny-llama-300MB-cpu", storage=f"sqlite:///{db}")
    assert study.user_attrs["settings"]["launcher"] == {"name": "inline", "tag": "first"}
    # the reference, measured in this process through the launcher's runner
    [trial] = study.trials
    assert trial.user_attrs[TAG_ATTR] == "first" and trial.user_attrs["status"] == "ok"
    # resume: the stored launcher, its option changed
    again = cli("resume", "--study", "tiny-llama-300MB-cpu", "--trials", "1", *storage,
                "--inline-tag", "second")  # fmt: skip
    assert again.exit_code == 0, again.output
    assert _tags(db) == ["first", "second"]
    study = optuna.load_study(study_name="tiny-llama-300MB-cpu", storage=f"sqlite:///{db}")
    assert study.user_attrs["settings"]["launcher"] == {"name": "inline", "tag": "second"}


def test_a_launchers_option_without_it_is_one_line(inline: None, tmp_path: Path) -> None:
    base = ["run", "--model", "tiny-llama", "--budget", "300MB", *SMALL_ARGS,
            "--storage", f"sqlite:///{tmp_path / 's.db'}"]  # fmt: skip
    out = cli(*base, "--inline-tag", "x")
    assert out.exit_code == 2
    assert out.output.strip() == "Error: --inline-tag is a inline option: add --launcher inline"
    out = cli(*base, "--launcher", "inline", "--partition", "gpu")
    assert out.exit_code == 2
    assert out.output.strip() == "Error: --partition is a Slurm option: add --launcher slurm"
    assert not (tmp_path / "s.db").exists()  # refused before any study is made


def test_the_launchers_option_is_gone_with_it(tmp_path: Path) -> None:
    out = cli("run", "--model", "tiny-llama", "--budget", "300MB", "--inline-tag", "x")
    assert out.exit_code == 2 and "No such option '--inline-tag'" in out.output
    assert "inline" not in cli("run", "--help").output
