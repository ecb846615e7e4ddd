"""The finalists (``autotune/finalists.py``) against answers computed here from the raw trial
records of random studies (real SQLite, real Optuna), and their re-measurement with a runner
that returns recorded results (the decision under test is which configurations are re-measured,
in which order, and what is kept of each result, not the measurement itself).

The decisions the module makes, each with a test here that fails when it is inverted, swapped
or fed the wrong quantity:

1. which configurations are finalists: per class group, the ``MAX_FINALISTS`` fastest feasible
   configurations by their own measurement (never the slowest ones, never one over the budget,
   rejected by the loss guard, failed or out of memory), fastest first;
2. which groups need a re-measurement: a group with two feasible configurations or more, of
   whose finalists at least one has no re-measurement yet (a lone feasible configuration, or a
   group whose finalists were all re-measured, needs none);
3. the order of the runs: side by side, every finalist once per round, ``rounds`` rounds, each
   round in the reverse order of the one before (A B C C B A), each run under the study's
   budget;
4. what a run contributes: the tokens/s of a run that finished; a run that failed or ran out of
   memory adds no sample (never a 0 tokens/s one), and a finalist with no sample stores none;
5. where the samples go: the study's ``remeasured`` attr (trial number -> samples); a
   re-measured group's earlier samples are dropped (taken at another moment), every other
   group's kept; the selector then decides among the re-measured configurations on those
   samples alone (their median, their range as the noise; after one round, the range over the
   trial's own measurement and its re-measurement).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.finalists import MAX_FINALISTS, finalists, remeasure
from autotune.runner import TrialRunner
from autotune.selector import select
from tests.records import MB, add_record, memory_study
from tests.studies import records_study
from trials.spec import TrialResult, TrialSpec

BUDGET = 200 * MB
#: the class groups, most faithful first (the README's order), by the fidelity stored per trial
GROUPS = [("exact", "mixed"), ("reduced_state",), ("other_optimizer",), ("adapters",)]
#: configurations with their fidelity class and their simplicity counted by hand: (techniques
#: that differ from plain training, ZeRO stage, offloads)
CONFIGS: list[tuple[dict[str, Any], str, tuple[int, int, int]]] = [
    ({"precision": "fp32"}, "exact", (0, 0, 0)),
    ({"precision": "fp32", "gradient_checkpointing": "full"}, "exact", (1, 0, 0)),
    ({"precision": "fp32", "zero_stage": 2}, "exact", (1, 2, 0)),
    ({"precision": "bf16"}, "mixed", (1, 0, 0)),
    ({"precision": "bf16", "zero_stage": 2, "offload_optimizer": "cpu"}, "mixed", (3, 2, 1)),
    ({"optimizer": "adamw_8bit"}, "reduced_state", (1, 0, 0)),
    ({"optimizer": "adafactor"}, "other_optimizer", (1, 0, 0)),
    ({"optimizer": "adafactor", "gradient_checkpointing": "full"}, "other_optimizer", (2, 0, 0)),
    ({"quantization": "nf4"}, "adapters", (1, 0, 0)),
]


def _study(tmp_path: Path, name: str = "f") -> optuna.Study:
    return records_study(f"sqlite:///{tmp_path / f'{name}.db'}", name, BUDGET, "200MB")


def _memory_study(name: str) -> optuna.Study:
    return memory_study(name, BUDGET)


def _random_study(tmp_path: Path, seed: int) -> optuna.Study:
    """Trials whose speeds crowd within a few percent of each other, in groups of one to more
    than ``MAX_FINALISTS`` feasible configurations, beside failures, OOMs, trials over the
    budget and rejected verdicts; some configurations already re-measured."""
    study = _memory_study(f"r{seed}")
    rng = random.Random(seed)
    for _ in range(rng.randint(6, 22)):
        config, fidelity, _ = rng.choice(CONFIGS)
        status = rng.choices(["ok", "oom", "failed"], [8, 1, 1])[0]
        add_record(
            study,
            {**config, "micro_batch_size": rng.choice([1, 2, 4, 8])},
            fidelity=fidelity,
            status=status,
            peak=rng.randint(50, 230) * MB,
            tps=rng.uniform(900.0, 1100.0) if rng.random() < 0.8 else rng.uniform(300, 800),
            spread=rng.choice([0.01, 0.02, 0.04, 0.08, 0.15]),
            verdict_ok=rng.choice([True, True, True, None, False]),
        )
    done: dict[str, list[float]] = {}
    for t in study.trials:
        if t.user_attrs["status"] == "ok" and rng.random() < 0.25:
            done[str(t.number)] = [rng.uniform(900.0, 1100.0) for _ in range(rng.randint(1, 2))]
    if done:
        study.set_user_attr("remeasured", done)
    return study


def _feasible_by_group(study: optuna.Study) -> list[list[dict[str, Any]]]:
    """Per group, its feasible trials from the raw records as {number, tps, speed, spread,
    simple, done}: ``speed`` the median of its re-measurements where it has some, else its own
    tokens/s; ``spread`` the larger of the step spread and the samples' range over that speed
    (one re-measurement: the range over it and the trial's own tokens/s)."""
    done: dict[str, list[float]] = study.user_attrs.get("remeasured") or {}
    simple = {repr(sorted(c.items())): s for c, _, s in CONFIGS}
    out = []
    for group in GROUPS:
        mine = []
        for t in study.trials:
            a = t.user_attrs
            if a["status"] != "ok" or a["peak_bytes"] > BUDGET or a["fidelity"] not in group:
                continue
            if (a.get("loss_verdict") or {}).get("ok") is False:
                continue
            again = done.get(str(t.number), [])
            speed = statistics.median(again) if again else a["tokens_per_s"]
            samples = again if len(again) > 1 else [a["tokens_per_s"], *again]
            spread = max(a["step_spread"], (max(samples) - min(samples)) / speed)
            config = {k: v for k, v in a["config"].items() if k != "micro_batch_size"}
            mine.append(
                {
                    "number": t.number,
                    "tps": a["tokens_per_s"],
                    "speed": speed,
                    "spread": spread,
                    "simple": simple[repr(sorted(config.items()))],
                    "done": bool(again),
                }
            )
        out.append(mine)
    return out


def _group_numbers(study: optuna.Study, numbers: list[int]) -> set[str]:
    """Every trial of the class group of these trials (whatever its status), as stored."""
    fidelity = study.trials[numbers[0]].user_attrs["fidelity"]
    group = next(g for g in GROUPS if fidelity in g)
    return {str(t.number) for t in study.trials if t.user_attrs["fidelity"] in group}


def _contenders(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Within the noise of the fastest: the larger of 5% and either one's spread."""
    if not rows:
        return []
    best = max(rows, key=lambda r: r["speed"])
    return [
        r
        for r in rows
        if r["speed"] >= best["speed"] * (1 - max(0.05, best["spread"], r["spread"]))
    ]


def _oracle_finalists(study: optuna.Study) -> list[list[int]]:
    """The three fastest feasible by their own tokens/s (the lower number first among equal
    ones), where a group has two or more and one of them has no re-measurement yet."""
    done = study.user_attrs.get("remeasured") or {}
    out = []
    for rows in _feasible_by_group(study):
        fastest = sorted(rows, key=lambda r: (-r["tps"], r["number"]))[:3]
        if len(fastest) > 1 and any(str(r["number"]) not in done for r in fastest):
            out.append([r["number"] for r in fastest])
    return out


def _oracle_winner(study: optuna.Study) -> int | None:
    """The first group's winner: among its re-measured configurations where it has some, the
    simplest within the noise of the fastest."""
    for rows in _feasible_by_group(study):
        again = [r for r in rows if r["done"]]
        tied = _contenders(again or rows)
        if tied:
            return min(tied, key=lambda r: (*r["simple"], -r["speed"], r["number"]))["number"]  # type: ignore[no-any-return]
    return None


class RecordedRunner(TrialRunner):
    """Returns, per run name, the result recorded for it, and keeps the order of the calls and
    the budget each ran under."""

    def __init__(self, results: dict[str, TrialResult]) -> None:
        self.results = results
        self.calls: list[tuple[str, int | None]] = []

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        self.calls.append((name, spec.budget_bytes))
        return self.results[name]


def test_max_finalists_is_three() -> None:
    assert MAX_FINALISTS == 3


@pytest.mark.parametrize("seed", range(40))
def test_finalists_are_the_three_fastest_feasible_of_each_group(seed: int, tmp_path: Path) -> None:
    study = _random_study(tmp_path, seed)
    assert finalists(study) == _oracle_finalists(study)


def test_the_random_studies_hold_what_the_rules_are_about(tmp_path: Path) -> None:
    """Groups with more feasible configurations than ``MAX_FINALISTS``, groups with exactly
    two, groups whose finalists were all re-measured already, lone feasible configurations,
    re-measured groups with earlier samples beside their finalists (stale), and groups with
    samples that are not re-measured again: each rule above is met."""
    seen = {"more": 0, "two": 0, "all_done": 0, "lone": 0, "stale": 0, "kept": 0}
    for seed in range(40):
        study = _random_study(tmp_path, seed)
        again = {n for numbers in _oracle_finalists(study) for n in numbers}
        for rows in _feasible_by_group(study):
            fastest = sorted(rows, key=lambda r: (-r["tps"], r["number"]))[:MAX_FINALISTS]
            seen["more"] += len(rows) > MAX_FINALISTS
            seen["two"] += len(rows) == 2
            seen["lone"] += len(rows) == 1
            seen["all_done"] += len(fastest) > 1 and all(r["done"] for r in fastest)
            top = {r["number"] for r in fastest}
            seen["stale"] += bool(top & again) and any(
                r["done"] and r["number"] not in top for r in rows
            )
            seen["kept"] += not (top & again) and any(r["done"] for r in rows)
    assert all(n >= 2 for n in seen.values()), seen


def _result(status: str, tps: float = 0.0) -> TrialResult:
    return TrialResult(status=status, peak_bytes=120 * MB, tokens_per_s=tps)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(16))
def test_remeasure_alternates_keeps_finished_runs_only_and_the_selector_decides_on_them(
    seed: int, tmp_path: Path
) -> None:
    """Each finalist's runs return recorded results (some failed or out of memory); the runs go
    side by side round by round, each round reversed, under the budget; only finished runs'
    tokens/s are stored, a re-measured group's earlier samples dropped and the others' kept;
    the winner is then the one the raw records and those samples name."""
    study = _random_study(tmp_path, seed)
    rng = random.Random(1000 + seed)
    groups = _oracle_finalists(study)
    rounds = rng.choice([1, 2, 3])
    results: dict[str, TrialResult] = {}
    expected: dict[str, list[float]] = dict(study.user_attrs.get("remeasured") or {})
    order = []
    for numbers in groups:
        for i in range(rounds):
            order += [f"confirm-{n}-{i}" for n in (numbers if i % 2 == 0 else numbers[::-1])]
        stale = _group_numbers(study, numbers)
        expected = {k: v for k, v in expected.items() if k not in stale}
        for n in numbers:
            kept = []
            for i in range(rounds):
                status = rng.choices(["ok", "oom", "failed"], [3, 1, 1])[0]
                results[f"confirm-{n}-{i}"] = _result(status, rng.uniform(850.0, 1150.0))
                if status == "ok":
                    kept.append(results[f"confirm-{n}-{i}"].tokens_per_s)
            if kept:
                expected[str(n)] = kept
    runner = RecordedRunner(results)
    ran = remeasure(study, runner, rounds)
    assert [name for name, _ in runner.calls] == order
    assert all(budget == BUDGET for _, budget in runner.calls)
    assert ran == len(order)
    assert (study.user_attrs.get("remeasured") or {}) == expected
    winner = select(study).winner
    assert (winner.number if winner else None) == _oracle_winner(study)


def test_no_rounds_no_runs(tmp_path: Path) -> None:
    study = _study(tmp_path)
    for tps in (1000.0, 990.0):
        add_record(study, {"precision": "fp32"}, fidelity="exact", tps=tps)
    runner = RecordedRunner({})
    assert remeasure(study, runner, 0) == 0 and runner.calls == []


def test_five_feasible_the_fastest_three_are_remeasured(tmp_path: Path) -> None:
    """By hand: five feasible configurations (960 to 1000 tokens/s) and a faster one over the
    budget: the three fastest feasible (1000, 990, 980) are re-measured, fastest first; the
    slowest two and the one over the budget are left out."""
    study = _study(tmp_path)
    speeds = [960.0, 1000.0, 990.0, 980.0, 970.0]
    numbers = [
        add_record(study, {"precision": "fp32", "micro_batch_size": m}, fidelity="exact", tps=s)
        for m, s in zip([1, 2, 4, 8, 16], speeds, strict=True)
    ]
    add_record(study, {"precision": "fp32"}, fidelity="exact", tps=2000.0, peak=BUDGET + 1)
    assert finalists(study) == [[numbers[1], numbers[2], numbers[3]]]


def test_rounds_alternate_their_order(tmp_path: Path) -> None:
    """By hand: finalists A B C, three rounds: A B C, C B A, A B C."""
    study = _study(tmp_path)
    a, b, c = (
        add_record(study, {"precision": "fp32", "micro_batch_size": m}, fidelity="exact", tps=s)
        for m, s in ((1, 1000.0), (2, 990.0), (4, 980.0))
    )
    runner = RecordedRunner(
        {f"confirm-{n}-{i}": _result("ok", 1000.0) for n in (a, b, c) for i in range(3)}
    )
    assert remeasure(study, runner, 3) == 9
    expected = [(a, 0), (b, 0), (c, 0), (c, 1), (b, 1), (a, 1), (a, 2), (b, 2), (c, 2)]
    assert [name for name, _ in runner.calls] == [f"confirm-{n}-{i}" for n, i in expected]


def test_a_failed_or_oom_remeasurement_is_no_sample(tmp_path: Path) -> None:
    """By hand: A (1000 tokens/s, 1% spread) and B (980); A's re-measurements fail and run out
    of memory, B's finish at 1100 and 1120. A stores no sample; only B was re-measured, so B
    is the winner (decided on re-measured samples alone), with no ties. Counted as 0 tokens/s
    samples, the failures would store [0, 0] for A, which then ties nothing: B still wins but
    A's samples are wrong; and a stored empty list would make A re-measured."""
    study = _study(tmp_path)
    a = add_record(study, {"precision": "fp32"}, fidelity="exact", tps=1000.0)
    b = add_record(
        study, {"precision": "fp32", "gradient_checkpointing": "full"}, fidelity="exact", tps=980.0
    )
    runner = RecordedRunner(
        {
            f"confirm-{a}-0": _result("failed"),
            f"confirm-{a}-1": _result("oom"),
            f"confirm-{b}-0": _result("ok", 1100.0),
            f"confirm-{b}-1": _result("ok", 1120.0),
        }
    )
    assert remeasure(study, runner, 2) == 4
    assert study.user_attrs["remeasured"] == {str(b): [1100.0, 1120.0]}
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == b and sel.ties == []


def test_a_groups_stale_samples_are_dropped_and_another_groups_kept(tmp_path: Path) -> None:
    """By hand: exact A (1000), B (990), C (980), D (970) and adafactor E, F. Earlier samples:
    D [1500] (a finalist of another session, now fourth), E [700]. The exact group's
    finalists A B C are re-measured once at 1000, 1100, 1200: D's 1500 goes (another moment)
    and E's and F's stay. C wins (1200 is beyond 5% of 1100); kept, D's 1500 would win."""
    study = _study(tmp_path)
    a, b, c, d = (
        add_record(study, {"precision": "fp32", "micro_batch_size": m}, fidelity="exact", tps=s)
        for m, s in ((1, 1000.0), (2, 990.0), (4, 980.0), (8, 970.0))
    )
    e = add_record(study, {"optimizer": "adafactor"}, fidelity="other_optimizer", tps=700.0)
    f = add_record(
        study,
        {"optimizer": "adafactor", "gradient_checkpointing": "full"},
        fidelity="other_optimizer",
        tps=500.0,
    )
    study.set_user_attr("remeasured", {str(d): [1500.0], str(e): [700.0], str(f): [500.0]})
    assert finalists(study) == [[a, b, c]]
    runner = RecordedRunner(
        {f"confirm-{n}-0": _result("ok", s) for n, s in ((a, 1000.0), (b, 1100.0), (c, 1200.0))}
    )
    assert remeasure(study, runner, 1) == 3
    assert study.user_attrs["remeasured"] == {
        str(a): [1000.0],
        str(b): [1100.0],
        str(c): [1200.0],
        str(e): [700.0],
        str(f): [500.0],
    }
    assert select(study).classes["full"].winner.number == c  # type: ignore[union-attr]


def test_a_lone_feasible_and_a_remeasured_group_need_no_runs(tmp_path: Path) -> None:
    """By hand: one feasible configuration and one over the budget: no finalists (whatever
    the speeds). Two feasible ones both re-measured: none either; one of them not yet: both
    again; a lone one beside them (a group of one) never."""
    study = _study(tmp_path)
    add_record(study, {"precision": "fp32"}, fidelity="exact", tps=1000.0)
    add_record(
        study, {"precision": "fp32", "zero_stage": 2}, fidelity="exact", tps=990.0, peak=BUDGET + 1
    )
    add_record(study, {"quantization": "nf4"}, fidelity="adapters", tps=3000.0)
    assert finalists(study) == []
    c = add_record(study, {"optimizer": "adafactor"}, fidelity="other_optimizer", tps=700.0)
    d = add_record(
        study,
        {"optimizer": "adafactor", "gradient_checkpointing": "full"},
        fidelity="other_optimizer",
        tps=500.0,
    )
    assert finalists(study) == [[c, d]]
    study.set_user_attr("remeasured", {str(c): [700.0]})
    assert finalists(study) == [[c, d]]
    study.set_user_attr("remeasured", {str(c): [700.0], str(d): [690.0]})
    assert finalists(study) == []
