"""Run the semantic mutation set (``scripts/semantic_mutants.py``) against the fast tests.

    .venv/bin/python scripts/semantic_mutation.py [--only NAME ...] [--list]

Each mutant is one plausible bug written by hand: a snippet of a source file replaced by a
wrong one (a decision inverted, two quantities swapped, the wrong quantity fed). The tree
(tracked and untracked, not ignored files) is copied once into a temporary directory; for each
mutant its file is rewritten there, the mutant's own test files run with pytest in a fresh
process (``-p no:xdist -x -q``, imports from the copy), and the file restored. The working tree
is never written. The unmutated copy runs every named test file first: it must pass, or every
mutant would read as killed. Prints a line per mutant (``<name>: killed by <the first failing
test>`` or ``<name>: survived``, with its seconds) and the score; exits 1 when a mutant
survived, 2 when a snippet is not found exactly once or the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from semantic_mutants import MUTANTS, Mutant  # noqa: E402

PYTEST = [
    sys.executable,
    "-m",
    "pytest",
    "-p",
    "no:xdist",
    "-p",
    "no:cacheprovider",
    "-x",
    "-q",
    "-W",
    "ignore",
]


def copy_tree(dest: Path) -> None:
    """The files git knows of or would add (no .venv, no build outputs), as they are now."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = Path(raw.decode())
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def pytest_run(tree: Path, tests: list[str]) -> tuple[int, str]:
    """pytest's exit code and output, importing from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    ran = subprocess.run(
        [*PYTEST, "-rfE", *tests],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return ran.returncode, ran.stdout


def first_failure(output: str) -> str:
    """The test that killed a mutant, from pytest's short summary."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].split(" ", 1)[1]
    return "collection or import error"


def check(mutants: list[Mutant], tree: Path) -> list[str]:
    """Snippets that are not found exactly once (a stale mutant)."""
    bad = []
    for m in mutants:
        text = (tree / m.file).read_text()
        n = text.count(m.original)
        if n != 1:
            bad.append(f"{m.name}: its original snippet occurs {n} times in {m.file}")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutant names to run")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args()
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        print("duplicate mutant names", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name} [{m.file}]: {m.bug}")
        return 0
    # stopped (kill): leave through the clean-up below, the temporary tree removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="semantic-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        bad = check(chosen, tree)
        if bad:
            print("\n".join(bad), file=sys.stderr)
            return 2
        every_test = sorted({t for m in chosen for t in m.tests})
        rc, output = pytest_run(tree, every_test)
        if rc != 0:
            print(output[-4000:], file=sys.stderr)
            print("the unmutated tree fails its tests: no mutant can be judged", file=sys.stderr)
            return 2
        print(f"unmutated: {len(every_test)} test files pass ({time.monotonic() - start:.0f} s)")
        survived = []
        for m in chosen:
            path = tree / m.file
            original = path.read_text()
            path.write_text(original.replace(m.original, m.mutated, 1))
            t0 = time.monotonic()
            try:
                rc, output = pytest_run(tree, list(m.tests))
            finally:
                path.write_text(original)
            # pytest: 1 = a test failed; 2-4 = collection or usage error (the mutant broke the
            # import): both count as killed; 5 = no test ran is a broken mutant entry
            if rc == 5:
                print(f"{m.name}: its tests collected nothing", file=sys.stderr)
                return 2
            killed = rc != 0
            if not killed:
                survived.append(m.name)
            by = f" by {first_failure(output)}" if killed else ""
            print(
                f"{m.name}: {'killed' if killed else 'survived'}{by} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    total = len(chosen)
    print(
        f"semantic mutants: {total - len(survived)} of {total} killed "
        f"({(total - len(survived)) / max(1, total):.0%}) in {time.monotonic() - start:.0f} s"
    )
    for name in survived:
        print(f"survived: {name}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
