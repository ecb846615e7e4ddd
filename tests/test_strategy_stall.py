"""A search whose hard rules are wrong for this space still reaches the optimum: hand-built
realities where the estimator's prior ranks the optimum's choices last, an OOM of its smaller
micro-batch would rule it out by the monotone-memory rule (this reality's memory is not
monotone), and a crash shares most of its choices. The optimum is known by construction here
(the fastest configuration of the table that fits and does not crash), not by the search."""

from __future__ import annotations

import random

import pytest

from autotune.strategy import AutotuneSampler, Config, Observation, config_key

BUDGET = 1e9
LETTERS = "0123"


def _grid() -> list[Config]:
    return [
        {"micro_batch_size": mb, "a": a, "b": b}
        for mb in (1, 2, 4)
        for a in LETTERS
        for b in LETTERS
    ]


def _prior(c: Config) -> tuple[float, float]:
    """The estimator: memory grows with the micro-batch (4 over the budget), speed too, and
    choice ``3`` of ``a`` and of ``b`` is the slowest of its dimension."""
    peak = {1: 0.3, 2: 0.6, 4: 1.5}[c["micro_batch_size"]] * BUDGET
    speed = 1000.0 * c["micro_batch_size"] ** 0.5
    speed *= 1.0 - 0.03 * int(c["a"]) - 0.03 * int(c["b"])
    return peak, speed


def _reality(
    seed: int,
) -> tuple[dict[tuple[tuple[str, str], ...], tuple[str, float, float]], Config]:
    """Each configuration's (status, peak, tokens/s): the prior times a random factor per
    configuration, plus the seed's optimum (a*, b*, micro-batch 2) 3x faster, its micro-batch 1
    sibling over the budget (memory not monotone)."""
    rng = random.Random(seed)
    a_star, b_star = rng.choice("23"), rng.choice("23")
    optimum = {"micro_batch_size": 2, "a": a_star, "b": b_star}
    table = {}
    for c in _grid():
        peak, speed = _prior(c)
        speed *= rng.uniform(0.8, 1.2)
        if c == optimum:
            speed *= 3.0 * 1.5
        if c == {**optimum, "micro_batch_size": 1}:
            peak = 1.2 * BUDGET
        table[config_key(c)] = ("ok", peak, speed)
    return table, optimum


def _search(seed: int, first: list[Config], limit: int) -> int | None:
    """Trials (the ``first`` ones forced, as a study's enqueued trials are) until the optimum."""
    table, optimum = _reality(seed)
    sampler = AutotuneSampler(_grid(), _prior, BUDGET)
    history: list[Observation] = []
    for n in range(1, limit + 1):
        plan = first[n - 1] if n <= len(first) else sampler.plan(history)
        if plan is None:
            return None
        status, peak, speed = table[config_key(plan)]
        if status == "ok" and peak > BUDGET:
            status = "oom"
        history.append(
            Observation(
                plan, status, peak if status != "failed" else 0.0, speed if status == "ok" else 0.0
            )
        )
        if plan == optimum:
            return n
    return None


@pytest.mark.parametrize("seed", range(4))
def test_an_oom_that_would_hide_the_optimum_does_not_hide_it_for_ever(seed: int) -> None:
    """The optimum's micro-batch-1 sibling runs out of memory first: by the monotone rule the
    optimum would then never be proposed. After ``STALL`` trials without a better measurement
    the rule is a belief weighed by the chance to fit, and the optimum is reached before the
    search runs out of candidates (with the rule as a wall it never is: the plan ends first)."""
    _, optimum = _reality(seed)
    blocker = {**optimum, "micro_batch_size": 1}
    found = _search(seed, [blocker], len(_grid()))
    assert found is not None and found > 1


def test_a_candidate_is_weighed_by_its_chance_to_escape_a_crash() -> None:
    """(a0, b0, c0) crashed and nothing has run: its cause is one of its 3 choices or 3 pairs.
    X = (a0, b0, c1) holds a0, b0 and (a0, b0): 3 of the 6, a 1/2 chance to crash like it (not
    over the 1/2 that sends a candidate last); Y = (a1, b1, c0) holds only c0, 1/6. Counted by
    hand. X is predicted 10% faster, but weighed by the chance to run Y goes first; had the same
    configuration been killed at the trial timeout (tried, nothing learned of its choices), X
    would."""

    def cfg(a: str, b: str, c: str) -> Config:
        return {"a": a, "b": b, "c": c}

    crashed, x, y = cfg("0", "0", "0"), cfg("0", "0", "1"), cfg("1", "1", "0")
    speeds = {config_key(crashed): 2000.0, config_key(x): 1100.0, config_key(y): 1000.0}
    grid = [cfg(a, b, c) for a in "01" for b in "01" for c in "01"]

    def prior(c: Config) -> tuple[float, float]:
        return 0.3 * BUDGET, speeds.get(config_key(c), 300.0)

    sampler = AutotuneSampler(grid, prior, BUDGET)
    assert sampler.plan([Observation(crashed, "failed", 0.0, 0.0)]) == y
    assert sampler.plan([Observation(crashed, "timeout", 0.0, 0.0)]) == x
