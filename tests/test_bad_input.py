"""Bad input: one line on stderr, exit code 2, no traceback, and nothing on disk changed.

Each case runs the real CLI in a folder holding a real SQLite study (no trials yet) and some
broken input files; every file in that folder is hashed before and after.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from autotune.cli import main
from autotune.cli import run as run_cmd
from tests.conftest import SMALL_ARGS, SMALL_SPACE
from tests.studies import make_study

STUDY = "existing"
CUDA_STUDY = "measured-on-cuda"
SECRET = "hunter2-secret"
TINY = ["--model", "tiny-llama"]
RUN_1GB = ["run", *TINY, "--budget", "1GB", "--space", str(SMALL_SPACE), *SMALL_ARGS]

SPACES = {
    "unknown_key.yaml": "dimensions:\n  precision: {choices: [fp32]}\ncolour: blue\n",
    "wrong_type.yaml": "dimensions:\n  precision: {choices: fp32}\n",
    "empty_choices.yaml": "dimensions:\n  precision: {choices: []}\n",
    "impossible_rule.yaml": (
        "dimensions:\n  precision: {choices: [fp32, bf16]}\n"
        "  micro_batch_size: {choices: [1, 8]}\n"
        "rules:\n  - forbid: {precision: fp32, micro_batch_size: [1, 8]}\n"
    ),
    "bad_value.yaml": "dimensions:\n  micro_batch_size: {choices: [0]}\n",
    "not_yaml.yaml": "dimensions: [unclosed\n",
}

CASES: list[tuple[str, list[str], str]] = [
    ("budget unit", ["run", *TINY, "--budget", "24XB"], "invalid budget '24XB'"),
    ("budget negative", ["run", *TINY, "--budget", "-1GB"], "greater than zero"),
    ("budget zero", ["run", *TINY, "--budget", "0"], "invalid budget '0'"),
    ("budget no number", ["run", *TINY, "--budget", "GB"], "invalid budget 'GB'"),
    ("unknown model", ["run", "--model", "lama-7b", "--budget", "24GB"], "did you mean llama-7b"),
    ("hub id, never downloaded", ["run", "--model", "meta-llama/Llama-2-7b-hf", "--budget", "1GB"],
     "unknown model"),
    ("not a model config", ["run", "--model", "not_model.json", "--budget", "1GB"],
     "not a causal-LM model config"),
    ("model config not JSON", ["run", "--model", "broken.json", "--budget", "1GB"],
     "is not valid JSON"),
    ("model config missing", ["run", "--model", "missing.json", "--budget", "1GB"],
     "model config file not found"),
    ("space unknown key", ["run", *TINY, "--budget", "1GB", "--space", "unknown_key.yaml"],
     "unknown key 'colour'"),
    ("space wrong type", ["run", *TINY, "--budget", "1GB", "--space", "wrong_type.yaml"],
     "choices must be a list"),
    ("space empty choices", ["run", *TINY, "--budget", "1GB", "--space", "empty_choices.yaml"],
     "choices is empty"),
    ("space impossible rule",
     ["run", *TINY, "--budget", "1GB", "--space", "impossible_rule.yaml"], "is impossible"),
    ("space bad value", ["run", *TINY, "--budget", "1GB", "--space", "bad_value.yaml"],
     "not a positive integer"),
    ("space not YAML", ["run", *TINY, "--budget", "1GB", "--space", "not_yaml.yaml"],
     "invalid YAML"),
    ("space missing", ["run", *TINY, "--budget", "1GB", "--space", "missing.yaml"],
     "search space file not found"),
    ("storage folder missing",
     [*RUN_1GB, "--storage", "sqlite:////no/such/dir/x.db"], "cannot open storage"),
    ("storage not a database", ["show", "--storage", "sqlite:///not_a_db.db"],
     "cannot open storage"),
    ("storage unreachable, password masked",
     [*RUN_1GB, "--storage", f"postgresql://user:{SECRET}@127.0.0.1:9/db"],
     "postgresql://user:***@127.0.0.1:9/db"),
    ("storage unknown dialect", [*RUN_1GB, "--storage", "nosuchdb://x/y"],
     "cannot open storage"),
    ("show of a missing file", ["show", "--storage", "sqlite:///typo.db"], "no database at"),
    ("study with another model",
     ["run", "--model", "small-llama", "--budget", "1GB", "--space", str(SMALL_SPACE),
      *SMALL_ARGS, "--study-name", STUDY], "exists with model='tiny-llama'"),
    ("study with another budget",
     ["run", *TINY, "--budget", "2GB", "--space", str(SMALL_SPACE), *SMALL_ARGS,
      "--study-name", STUDY], f"exists with budget_bytes={10**9}"),
    ("export before a fit", ["export", "--study", STUDY, "--format", "deepspeed", "--out", "x"],
     "nothing to export"),
    ("export unknown format", ["export", "--format", "xml", "--out", "x"],
     "unknown export format 'xml'"),
    ("export folder missing",
     ["export", "--study", STUDY, "--format", "deepspeed", "--out", "no/such/dir/ds.json"],
     "does not exist"),
    ("trials zero", [*RUN_1GB, "--trials", "0"], "--trials"),
    # no GPU here: "needs the cuda backend"; on a GPU machine: "only N CUDA GPU(s) visible"
    ("gpus more than present", [*RUN_1GB, "--gpus", "64"], "cuda"),
    ("show unknown study", ["show", "--study", "nope"], "no study named 'nope'"),
    ("resume unknown study", ["resume", "--study", "nope"], "no study named 'nope'"),
    ("worker unknown study", ["worker", "--study", "nope"], "no study named 'nope'"),
    ("missing option", ["run", "--budget", "1GB"], "Missing option '--model'"),
    ("worker without the study's GPUs", ["worker", "--study", CUDA_STUDY], "no CUDA GPU"),
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real SQLite study with no trials yet, and broken inputs beside it."""
    path = tmp_path_factory.mktemp("bad_input")
    make_study(f"sqlite:///{path / 'autotune.db'}", STUDY, SMALL_SPACE, "1GB")
    make_study(f"sqlite:///{path / 'autotune.db'}", CUDA_STUDY, SMALL_SPACE, "1GB", "cuda")
    for name, text in SPACES.items():
        (path / name).write_text(text)
    (path / "not_model.json").write_text(json.dumps({"name": "a tokenizer, not a model"}))
    (path / "broken.json").write_text("{not json")
    (path / "not_a_db.db").write_text("plain text, not SQLite\n" * 100)
    return path


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


_HAS_GPUS = "gpus" in {p.name for p in run_cmd.params}


def _param(case: tuple[str, list[str], str]) -> object:
    if "--gpus" in case[1] and not _HAS_GPUS:
        return pytest.param(*case[1:], id=case[0], marks=pytest.mark.skip("run has no --gpus yet"))
    if CUDA_STUDY in case[1] and torch.cuda.is_available():
        return pytest.param(*case[1:], id=case[0], marks=pytest.mark.skip("a GPU is visible"))
    return pytest.param(*case[1:], id=case[0])


@pytest.mark.parametrize(("args", "message"), [_param(c) for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_changed(
    args: list[str], message: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder)
    before = _snapshot(folder)
    assert "autotune.db" in before
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and message.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in result.output
    assert SECRET not in result.output
    assert _snapshot(folder) == before


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)
