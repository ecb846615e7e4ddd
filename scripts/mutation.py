"""Mutation testing of the modules that decide, and its report.

    .venv/bin/python scripts/mutation.py            # run mutmut, then write docs/MUTATION.md
    .venv/bin/python scripts/mutation.py --report   # only rewrite the report from the last run
    .venv/bin/python scripts/mutation.py --from A.txt B.txt  # the report from saved listings
                                                    # (``mutmut results --all true``); a later
                                                    # file's modules replace an earlier one's
        [--recheck R.txt]                           # survivors re-run against later tests
                                                    # (scripts/mutation_recheck.py)

The modules and the tests that guard them are listed in pyproject.toml (``[tool.mutmut]``).
mutmut (PyPI) copies the project into ``mutants/``, changes one operator, constant or call at a
time, and runs the tests that cover the changed function; a mutant the tests do not notice
*survived*. Survivors that cannot change behaviour (equivalent mutants) are argued one per line in
``docs/mutation_equivalent.txt`` as ``<mutant name> <reason>``; every other survivor is listed
in the report as a gap in the tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = [sys.executable, "-m", "mutmut"]
REPORT = ROOT / "docs" / "MUTATION.md"
EQUIVALENT = ROOT / "docs" / "mutation_equivalent.txt"
#: mutmut's word for a mutant the tests noticed. A timeout is not counted: besides a mutant that
#: loops forever it is also a forked test child deadlocked in torch's thread pool (run mutmut with
#: OMP_NUM_THREADS=1), so timeouts are listed with the survivors to be looked at
KILLED = {"killed"}


def results() -> dict[str, str]:
    """mutant name -> status, from mutmut's own listing of the last run."""
    out = subprocess.run(
        [*MUTMUT, "results", "--all", "true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_listing(out)


def parse_listing(out: str) -> dict[str, str]:
    """``mutmut results --all true`` output -> mutant name -> status."""
    statuses = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            statuses[name] = status.strip()
    return statuses


def equivalents() -> dict[str, str]:
    if not EQUIVALENT.exists():
        return {}
    argued = {}
    for line in EQUIVALENT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            argued[name] = reason.strip()
    return argued


def module_of(mutant: str) -> str:
    """``autotune.units.x_parse_size__mutmut_3`` -> ``autotune.units``."""
    head = mutant.split("__mutmut_")[0]
    parts = head.split(".")
    while parts and (parts[-1].startswith(("x_", "xǁ")) or "ǁ" in parts[-1]):
        parts.pop()
    return ".".join(parts)


def report(statuses: dict[str, str], note: str = "") -> str:
    argued = equivalents()
    per_module: dict[str, Counter[str]] = defaultdict(Counter)
    for name, status in statuses.items():
        per_module[module_of(name)][status] += 1
    lines = [
        "# Mutation testing",
        "",
        "Made by `.venv/bin/python scripts/mutation.py` (mutmut, configured in `pyproject.toml`).",
        "Score = killed / (mutants run - equivalent survivors argued in",
        "`docs/mutation_equivalent.txt`); a mutant no test covers counts as not killed, one the",
        "run did not reach is left out and counted under *not run*.",
        "",
        *([note.strip(), ""] if note else []),
        "| module | mutants | killed | survived | equivalent (argued) | no test | not run "
        "| score |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total = Counter[str]()
    for module in sorted(per_module):
        c = per_module[module]
        n = sum(c.values())
        run = n - c["not checked"]
        killed = sum(c[s] for s in KILLED)
        survivors = [m for m, s in statuses.items() if module_of(m) == module and s == "survived"]
        equiv = sum(m in argued for m in survivors)
        total.update({"n": n, "run": run, "killed": killed, "survived": c["survived"]})
        total.update({"equiv": equiv, "no tests": c["no tests"], "not run": c["not checked"]})
        lines.append(
            f"| `{module}` | {n} | {killed} | {c['survived']} | {equiv} | {c['no tests']} "
            f"| {c['not checked']} | {100 * killed / max(run - equiv, 1):.1f}% |"
        )
    lines.append(
        f"| **all** | {total['n']} | {total['killed']} | {total['survived']} | {total['equiv']} "
        f"| {total['no tests']} | {total['not run']} "
        f"| **{100 * total['killed'] / max(total['run'] - total['equiv'], 1):.1f}%** |"
    )
    lines += ["", "## Survivors", ""]
    survivors = sorted(m for m, s in statuses.items() if s not in KILLED | {"not checked"})
    if not survivors:
        lines.append("None.")
    for m in survivors:
        why = argued.get(m)
        lines.append(f"- `{m}` ({statuses[m]}): " + (f"equivalent: {why}" if why else "NOT KILLED"))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only write the report")
    parser.add_argument("--max-children", default="2")
    parser.add_argument("--from", dest="listings", nargs="+", type=Path, default=[])
    parser.add_argument("--note", type=Path, help="a file whose text goes above the table")
    parser.add_argument(
        "--recheck",
        nargs="+",
        type=Path,
        default=[],
        help="listings of survivors (or mutants not reached) re-run against later tests "
        "(scripts/mutation_recheck.py): each mutant's status there replaces the run's",
    )
    args = parser.parse_args()
    if args.listings:
        statuses: dict[str, str] = {}
        for listing in args.listings:  # a later run's modules replace an earlier run's
            later = parse_listing(listing.read_text())
            redone = {module_of(m) for m in later}
            statuses = {m: s for m, s in statuses.items() if module_of(m) not in redone}
            statuses.update(later)
    else:
        if not args.report:
            # one thread: a forked test child that inherits torch's OpenMP pool can deadlock
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            subprocess.run(
                [*MUTMUT, "run", "--max-children", args.max_children],
                cwd=ROOT,
                check=True,
                env=env,
            )
        statuses = results()
    for listing in args.recheck:
        for mutant, status in parse_listing(listing.read_text()).items():
            # a recheck re-runs survivors and mutants the run did not reach or test; a kill is a
            # kill, a survivor there is one (for a mutant not reached, of the tests named only)
            if statuses.get(mutant) in ("survived", "no tests", "not checked"):
                statuses[mutant] = status
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(report(statuses, args.note.read_text() if args.note else ""))
    print(REPORT.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
