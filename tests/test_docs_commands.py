"""The commands README.md and docs/ quote still work: each parses with the CLI's own parser and
the fast ones run (``scripts/check_docs_commands.py``; ``--slow`` runs the rest). The oracle is
click's parser of the real command and the real exit code."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_docs_commands", ROOT / "scripts" / "check_docs_commands.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


CHECK = _checker()
QUOTED = CHECK.quoted()


def test_the_documents_quote_the_headline_and_the_demo() -> None:
    texts = {q.text for q in QUOTED}
    assert "autotune run --model llama-7b --budget 24GB" in texts
    assert "make run" in texts and "make demo" in texts
    assert any(q.kind() == "fast" for q in QUOTED)


@pytest.mark.parametrize("q", QUOTED, ids=[f"{q.path}:{q.line}" for q in QUOTED])
def test_every_quoted_command_parses(q: object) -> None:
    assert CHECK.parse(q) == ""


def test_a_wrong_command_is_refused() -> None:
    """The checker itself: an unknown option, a bad value, a missing required option in a
    complete command, an unknown make target."""
    Quoted = CHECK.Quoted
    bad = [
        Quoted("x", 1, "autotune run --model tiny-llama --budget 1GB --no-such-option", True),
        Quoted("x", 1, "autotune run --model tiny-llama --budget 1GB --trials zero", True),
        Quoted("x", 1, "autotune run --budget 1GB", True),
        Quoted("x", 1, "autotune run --trials zero", False),
        Quoted("x", 1, "autotune run --no-such-option", False),
        Quoted("x", 1, "make no-such-target", True),
    ]
    for q in bad:
        assert CHECK.parse(q) != "", q.text
    assert CHECK.parse(Quoted("x", 1, "autotune run --ladder", False)) == ""


def test_the_fast_commands_run() -> None:
    fast = {q.text: q for q in QUOTED if q.kind() == "fast"}
    for text, q in fast.items():
        code, output = CHECK.run(q, timeout=600)
        assert code == 0, f"{text}\n{output[-2000:]}"


def test_the_readme_is_short_and_names_no_work_items() -> None:
    """A newcomer's README: at most 300 lines; it and the guide speak of the product, not of the
    work that made it (no issue or stop numbers, no commit hashes)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    history = re.compile(r"\b(issue|stop) \d+\b|\bcommit [0-9a-f]{7}|\bat [0-9a-f]{7}\b", re.I)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]:
        found = history.search(path.read_text())
        assert found is None, f"{path.name}: {found.group(0) if found else ''}"
