"""Re-run the survivors of a finished mutmut run against tests written after it.

    .venv/bin/python scripts/mutation_recheck.py --mutants mutants --survivors names.txt \
        --tests tests/test_a.py tests/test_b.py > docs/mutation/recheck.txt

A full ``mutmut run`` takes hours here; the tests written to kill its survivors only need to
meet those survivors. Each named mutant is switched on the way mutmut itself does (its
trampoline reads ``MUTANT_UNDER_TEST`` at every call) and the given test files run with pytest
from the mutmut work tree (``mutants/``, where the mutated sources are), into which the test
files are copied first. Each mutant runs in a process of its own:
in one process a mutant that breaks the code's clean-up (a patched torch function not
restored, a dispatch mode left on) failed the tests of every mutant after it, which were then
counted killed. Prints ``<mutant>: killed|survived`` lines, the format of ``mutmut results
--all true`` that ``scripts/mutation.py --recheck`` overlays on the run's listing. Run with
``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=Path, required=True, help="mutmut's work tree")
    parser.add_argument("--survivors", type=Path, required=True, help="one mutant name a line")
    parser.add_argument("--tests", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    names = [line.strip() for line in args.survivors.read_text().splitlines() if line.strip()]
    for test in args.tests:
        shutil.copy(test, args.mutants / "tests" / test.name)
    tests = [f"tests/{t.name}" for t in args.tests]

    def run(name: str, timeout_s: float | None) -> int | None:
        """pytest's exit code with mutant ``name`` switched on (None: out of time)."""
        try:
            return subprocess.run(
                [*PYTEST, *tests],
                cwd=args.mutants,
                env={**os.environ, "MUTANT_UNDER_TEST": name, "PYTHONPATH": "."},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            return None

    # the unmutated code first (no mutant has this name): it must pass, or every mutant would
    # read as killed; a mutant given ten times its time (at least a minute) is a timeout
    start = time.monotonic()
    baseline = run("none__mutmut_0", None)
    if baseline != 0:
        raise SystemExit(f"the tests fail without a mutant (exit {baseline}): {tests}")
    limit = max(60.0, 10 * (time.monotonic() - start))
    for name in names:
        code = run(name, limit)
        if code == NO_TESTS_COLLECTED:
            raise SystemExit(f"no tests collected from {tests}")
        # 1: a test failed; 2: collection failed (a mutated module that doesn't import)
        if code is not None and code not in (0, 1, 2):
            raise SystemExit(f"{name}: pytest exited {code} (an internal or usage error)")
        status = "timeout" if code is None else "survived" if code == 0 else "killed"
        print(f"    {name}: {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
