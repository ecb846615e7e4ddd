"""Security rules, checked: safe YAML, no shell, no remote code, passwords never shown."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from autotune.runner import STORAGE_ENV, SubprocessRunner
from autotune.storage import mask_secret, mask_url
from tests.conftest import tiny_spec
from trials.lifeline import CONTROLLER_ENV

ROOT = Path(__file__).resolve().parents[1]
#: built from pieces so that this file does not match itself
FORBIDDEN = {
    "shell=" + "True": "no shell: commands are argument lists",
    "yaml." + "load(": "yaml.safe_load only",
    "yaml." + "unsafe_load": "yaml.safe_load only",
    "trust_remote_code=" + "True": "model code never comes from a hub",
    "os." + "system(": "no shell: commands are argument lists",
}


def _sources() -> list[Path]:
    folders = ("autotune", "trials", "tests", "scripts")
    files = [p for d in folders for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 10
    return files


def test_no_shell_no_unsafe_yaml_no_remote_code() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {why}"
        for path in _sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for needle, why in FORBIDDEN.items()
        if needle in line.replace(" ", "")
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://bob:s3cret@db:5432/x", "postgresql://bob:***@db:5432/x"),
        ("postgresql+psycopg://bob:p%40ss@db/x", "postgresql+psycopg://bob:***@db/x"),
        ("sqlite:///autotune.db", "sqlite:///autotune.db"),
        ("mysql://root:@localhost/x", "mysql://root:***@localhost/x"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_mask_secret_hides_the_password_anywhere_in_a_message() -> None:
    url = "postgresql://bob:p%40ss-word@db/x"
    text = "auth failed for bob with p@ss-word (postgresql://bob:p%40ss-word@db/x)"
    masked = mask_secret(text, url)
    assert "p@ss-word" not in masked and "p%40ss-word" not in masked
    assert "postgresql://bob:***@db/x" in masked


class EnvDump(SubprocessRunner):
    """The real runner, whose job prints its environment to stderr and exits."""

    def command(self, spec_path: Path, result_path: Path) -> list[str]:
        code = (
            "import os, sys; "
            "[print(k, file=sys.stderr) for k in os.environ if k.startswith('AUTOTUNE')]; "
            "sys.exit(1)"
        )
        return [sys.executable, "-c", code]


def test_the_trial_job_never_sees_the_storage_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORAGE_ENV, "postgresql://bob:s3cret@db/x")
    result = EnvDump(tmp_path).run(tiny_spec({}), "t0")
    names = set(re.findall(r"^\w+$", result.stderr_tail, re.MULTILINE))
    assert CONTROLLER_ENV in names  # the dump is real: the runner's own variable is there
    assert STORAGE_ENV not in names
