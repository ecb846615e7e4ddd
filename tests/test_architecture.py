"""``docs/ARCHITECTURE.md`` against the code: each claim the page makes about imports, checked on
the real import graph (every ``import`` in every file of ``autotune/`` and ``trials/``, read with
``ast``, the ones inside functions too), and every file the page names exists.

Each test first finds its claim on the page, so that a claim reworded or dropped there is
revisited here.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ARCHITECTURE.md"


def _claim(text: str) -> None:
    page = " ".join(PAGE.read_text().split())
    assert text in page, f"docs/ARCHITECTURE.md no longer says: {text}"


@cache
def _modules() -> dict[str, Path]:
    """The project's modules by dotted name (a package by its own name)."""
    found = {}
    for package in ("autotune", "trials"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


@cache
def _imports(module: str) -> frozenset[str]:
    """Every module name ``module`` imports, anywhere in its file (relative imports resolved;
    ``from a import b`` counts ``a`` and ``a.b``: ``b`` may be a module)."""
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                kept = parts[: len(parts) - node.level + 1]
                base = ".".join(kept + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(names)


def _own(name: str) -> str | None:
    """The project module an imported name lands in (``trials.techniques.TECHNIQUES`` ->
    ``trials.techniques``), or None for a library."""
    while name and name not in _modules():
        name = name.rpartition(".")[0]
    return name or None


def _own_imports(module: str) -> set[str]:
    return {m for name in _imports(module) if (m := _own(name)) and m != module}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _libraries(module: str) -> set[str]:
    return {name.split(".")[0] for name in _imports(module) if _own(name) is None}


def test_the_graph_reader_sees_lazy_and_relative_imports() -> None:
    """The reader on known lines: the estimate backend imports the estimator at the top, and the
    study imports ``autotune.models`` inside a function."""
    assert "autotune.estimator.analytical" in _own_imports("autotune.estimate_backend")
    assert "autotune.models" in _own_imports("autotune.study")
    assert "torch" in _libraries("trials.job")


def test_trials_imports_nothing_from_autotune() -> None:
    _claim("`trials/` imports nothing from `autotune/`")
    bad = {
        m: sorted(d for d in _own_imports(m) if _in(d, "autotune"))
        for m in _modules()
        if _in(m, "trials")
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_job_needs_none_of_the_controllers_libraries() -> None:
    _claim("nor the controller's libraries (click, rich, optuna)")
    bad = {
        m: sorted(_libraries(m) & {"click", "rich", "optuna"})
        for m in _modules()
        if _in(m, "trials")
    }
    assert {m: d for m, d in bad.items() if d} == {}


#: what the page lets the estimator import of ``autotune/`` (besides itself)
ESTIMATOR_AUTOTUNE = {"autotune.models", "autotune.units", "autotune.errors", "autotune.runner"}
#: ... of ``trials/``; the job's own modules for the traced estimator alone
ESTIMATOR_TRIALS = {"trials.techniques", "trials.data", "trials.spec"}
TRACED_ONLY = {"trials.job", "trials.memory"}


def _estimator() -> list[str]:
    return [m for m in _modules() if _in(m, "autotune.estimator")]


def test_the_estimator_imports_of_autotune_only_what_the_page_lists() -> None:
    _claim(
        "of `autotune/`, only the model registry, units, errors and the `TrialRunner` base "
        "(its runner stands in for the job): not the study, the search or the CLI"
    )
    assert "autotune.runner.TrialRunner" in set().union(*(_imports(m) for m in _estimator()))
    bad = {
        m: sorted(
            d
            for d in _own_imports(m)
            if _in(d, "autotune")
            and not _in(d, "autotune.estimator")
            and d not in ESTIMATOR_AUTOTUNE
        )
        for m in _estimator()
    }
    assert {m: d for m, d in bad.items() if d} == {}
    libraries = set().union(*(_libraries(m) for m in _estimator()))
    assert not libraries & {"click", "rich", "optuna"}


def test_the_estimator_imports_of_trials_only_what_the_page_lists() -> None:
    _claim(
        "of `trials/`, the techniques, the data's shapes and the trial spec, and for the traced "
        "estimator alone the job's model builder and host-memory scope"
    )
    for module in _estimator():
        allowed = ESTIMATOR_TRIALS | (
            TRACED_ONLY if module == "autotune.estimator.traced" else set()
        )
        bad = [
            d
            for d in _own_imports(module)
            if _in(d, "trials") and not any(_in(d, a) for a in allowed)
        ]
        assert bad == [], module
    assert _own_imports("autotune.estimator.traced") >= TRACED_ONLY


#: the modules the page's registry diagram draws reading the techniques' registry
REGISTRY_READERS = (
    "autotune.space",
    "autotune.availability",
    "autotune.strategy",
    "autotune.ladder",
    "autotune.selector",
    "autotune.lossguard",
    "autotune.export",
    "trials.deepspeed_engine",
    "trials.job",
    "autotune.estimator.traced",
)


@pytest.mark.parametrize("module", REGISTRY_READERS)
def test_each_step_the_diagram_draws_reads_the_techniques_package(module: str) -> None:
    _claim("Every step above reads them from the registry rather than naming them")
    assert any(_in(d, "trials.techniques") for d in _own_imports(module))


def test_no_import_cycle() -> None:
    _claim("lists no cycle")
    graph = {
        m: {d for d in _own_imports(m) if not _in(m, d)} for m in _modules()
    }  # a module importing its own package's __init__ is no cycle
    done: set[str] = set()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph[module]):
            if dep in path:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    for module in graph:
        if module not in done:
            visit(module, [module])
    assert cycles == []


def test_every_file_the_page_names_exists() -> None:
    text = PAGE.read_text()
    named = set(
        re.findall(r"(?<![\w/.])((?:autotune|trials|tests|search_spaces)/[\w/]+\.\w+)", text)
    )
    assert len(named) > 10
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
