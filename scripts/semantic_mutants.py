"""The semantic mutation set: plausible bugs written by hand, each one a decision made wrong.

Every entry replaces ``original`` (found exactly once in ``file``) by ``mutated``, says in one
line what the bug breaks, and names the fast tests that must fail on it (run by
``scripts/semantic_mutation.py``, in a temporary copy of the tree). A new decision in one of
these modules comes with its mutant here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    mutated: str
    bug: str
    tests: tuple[str, ...]


SELECTOR = ("tests/test_selector_decisions.py",)
FINALISTS = ("tests/test_finalists.py",)
LADDER = ("tests/test_ladder_oracle.py",)

MUTANTS: list[Mutant] = [
    # --- selector -------------------------------------------------------------------------------
    Mutant(
        "selector-contender-noise-ignored",
        "autotune/selector.py",
        "return max(NOISE_FLOOR, a.spread, b.spread)",
        "return max(NOISE_FLOOR, a.spread)",
        "a contender's own measurement noise is ignored when deciding whether it ties with the "
        "best (the margin is the best's alone)",
        SELECTOR,
    ),
    # --- ladder ---------------------------------------------------------------------------------
    Mutant(
        "ladder-fit-takes-biggest-saving",
        "autotune/ladder.py",
        "return (2.0, row.tokens_per_s, -float(row.peak_bytes))",
        "return (2.0, -float(row.peak_bytes), row.tokens_per_s)",
        "once a rung fits, the next technique is the biggest memory saving, not the fastest fit",
        LADDER,
    ),
    Mutant(
        "ladder-over-budget-ranks-as-fit",
        "autotune/ladder.py",
        "        return (2.0, row.tokens_per_s, -float(row.peak_bytes))\n"
        "    return (1.0, -float(row.peak_bytes), row.tokens_per_s)",
        "        return (2.0, row.tokens_per_s, -float(row.peak_bytes))\n"
        "    return (2.0, row.tokens_per_s, -float(row.peak_bytes))",
        "a faster candidate over the budget ranks as a fit once the rung below fits",
        LADDER,
    ),
    # --- finalists ------------------------------------------------------------------------------
    Mutant(
        "finalists-slowest-four",
        "autotune/finalists.py",
        "rows = sorted(result.contenders, key=lambda r: -r.speed)[:MAX_FINALISTS]",
        "rows = sorted(result.contenders, key=lambda r: r.speed)[:MAX_FINALISTS]",
        "with more than four tied contenders the slowest four are re-measured, the fastest "
        "left out",
        FINALISTS,
    ),
    Mutant(
        "finalists-failed-run-is-zero-sample",
        "autotune/finalists.py",
        '                if result.status == "ok":\n'
        "                    samples[str(n)].append(result.tokens_per_s)",
        "                samples[str(n)].append(result.tokens_per_s)",
        "a re-measurement that failed or ran out of memory counts as a 0 tokens/s sample",
        FINALISTS,
    ),
]
