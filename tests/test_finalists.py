"""The finalists (``autotune/finalists.py``) against answers computed here from the raw trial
records of random studies (real SQLite, real Optuna), and their re-measurement with a runner
that returns recorded results (the decision under test is which configurations are re-measured
and what is kept of each result, not the measurement itself).

The decisions the module makes, each with a test here that fails when it is inverted, swapped
or fed the wrong quantity:

1. which configurations are finalists: per class group, those within the noise of its fastest
   (the selector's contenders), the fastest ``MAX_FINALISTS`` of them when there are more
   (never the slowest ones), fastest first;
2. which groups need a re-measurement: a group with two finalists or more, of which at least
   one has no re-measurement yet (a lone winner, or a group wholly re-measured, needs none);
3. the order of the runs: interleaved rounds (A B C A B C), every finalist once per round,
   ``rounds`` rounds, each run under the study's budget;
4. what a run contributes: the tokens/s of a run that finished; a run that failed or ran out of
   memory adds no sample (never a 0 tokens/s one), and a finalist with no sample stores none;
5. where the samples go: the study's ``remeasured`` attr (trial number -> samples), merged with
   the ones stored before, which the selector then decides on (the median of a finalist's
   samples, their range as its noise).
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
    """Trials whose speeds crowd within a few percent of each other, so that groups have ties of
    two to more than ``MAX_FINALISTS`` configurations, beside failures, OOMs, trials over the
    budget and rejected verdicts; some finalists already re-measured."""
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
    """Per group, its feasible trials as {number, speed, spread, simple} from the raw records."""
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
            samples = [a["tokens_per_s"], *done.get(str(t.number), [])]
            speed = statistics.median(samples)
            spread = max(a["step_spread"], (max(samples) - min(samples)) / speed)
            config = {k: v for k, v in a["config"].items() if k != "micro_batch_size"}
            mine.append(
                {
                    "number": t.number,
                    "speed": speed,
                    "spread": spread,
                    "simple": simple[repr(sorted(config.items()))],
                }
            )
        out.append(mine)
    return out


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
    done = study.user_attrs.get("remeasured") or {}
    out = []
    for rows in _feasible_by_group(study):
        fastest = sorted(_contenders(rows), key=lambda r: -r["speed"])[:MAX_FINALISTS]
        if len(fastest) > 1 and any(str(r["number"]) not in done for r in fastest):
            out.append([r["number"] for r in fastest])
    return out


def _oracle_winner(study: optuna.Study) -> int | None:
    for rows in _feasible_by_group(study):
        tied = _contenders(rows)
        if tied:
            return min(tied, key=lambda r: (*r["simple"], -r["speed"], r["number"]))["number"]  # type: ignore[no-any-return]
    return None


class RecordedRunner(TrialRunner):
    """Returns, per configuration, the next of the results recorded for it, and keeps the order
    of the calls and the budget each ran under."""

    def __init__(self, results: dict[str, list[TrialResult]]) -> None:
        self.results = results
        self.calls: list[tuple[str, int | None]] = []

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        self.calls.append((name, spec.budget_bytes))
        return self.results[repr(sorted(spec.config.items()))].pop(0)


@pytest.mark.parametrize("seed", range(40))
def test_finalists_are_the_fastest_contenders_of_each_group(seed: int, tmp_path: Path) -> None:
    study = _random_study(tmp_path, seed)
    assert finalists(study) == _oracle_finalists(study)


def test_the_random_studies_hold_what_the_rules_are_about(tmp_path: Path) -> None:
    """Groups with more contenders than ``MAX_FINALISTS``, groups with exactly two, groups whose
    finalists were all re-measured already, and lone winners: each rule above is met."""
    seen = {"more": 0, "two": 0, "all_done": 0, "lone": 0}
    for seed in range(40):
        study = _random_study(tmp_path, seed)
        done = study.user_attrs.get("remeasured") or {}
        for rows in _feasible_by_group(study):
            tied = sorted(_contenders(rows), key=lambda r: -r["speed"])
            seen["more"] += len(tied) > MAX_FINALISTS
            seen["two"] += len(tied) == 2
            seen["lone"] += len(tied) == 1
            fastest = tied[:MAX_FINALISTS]
            seen["all_done"] += len(fastest) > 1 and all(str(r["number"]) in done for r in fastest)
    assert all(n >= 2 for n in seen.values()), seen


def _result(status: str, tps: float = 0.0) -> TrialResult:
    return TrialResult(status=status, peak_bytes=120 * MB, tokens_per_s=tps)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(12))
def test_remeasure_interleaves_keeps_finished_runs_only_and_the_selector_decides_on_them(
    seed: int, tmp_path: Path
) -> None:
    """Each finalist's runs return recorded results (some failed or out of memory); the runs
    interleave round by round under the budget; only finished runs' tokens/s are stored, merged
    with the earlier samples; the winner is then the one the raw records and those samples name."""
    study = _random_study(tmp_path, seed)
    rng = random.Random(1000 + seed)
    groups = _oracle_finalists(study)
    configs = {t.number: t.user_attrs["config"] for t in study.trials}
    rounds = rng.choice([1, 2, 3])
    results: dict[str, list[TrialResult]] = {}
    expected: dict[str, list[float]] = dict(study.user_attrs.get("remeasured") or {})
    for numbers in groups:
        for n in numbers:
            outcomes = []
            for _ in range(rounds):
                status = rng.choices(["ok", "oom", "failed"], [3, 1, 1])[0]
                outcomes.append(_result(status, rng.uniform(850.0, 1150.0)))
            key = repr(sorted(configs[n].items()))
            results.setdefault(key, []).extend(outcomes)
            kept = [r.tokens_per_s for r in outcomes if r.status == "ok"]
            if kept:
                expected[str(n)] = kept
    runner = RecordedRunner(results)
    ran = remeasure(study, runner, rounds)
    order = [f"confirm-{n}-{i}" for numbers in groups for i in range(rounds) for n in numbers]
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


def test_five_tied_contenders_the_fastest_four_are_remeasured(tmp_path: Path) -> None:
    """By hand: five configurations within 4% of each other (spreads 1%) all tie under the 5%
    floor; the four fastest are re-measured, fastest first, the slowest (960) is left out."""
    study = _study(tmp_path)
    speeds = [960.0, 1000.0, 990.0, 980.0, 970.0]
    numbers = [
        add_record(study, {"precision": "fp32", "micro_batch_size": m}, fidelity="exact", tps=s)
        for m, s in zip([1, 2, 4, 8, 16], speeds, strict=True)
    ]
    assert finalists(study) == [[numbers[1], numbers[2], numbers[3], numbers[4]]]


def test_a_failed_or_oom_remeasurement_is_no_sample(tmp_path: Path) -> None:
    """By hand: A (1000 tokens/s, 1% spread) and B (980) tie; A's re-measurements fail and run
    out of memory, B's finish at 1100 and 1120. A keeps its one sample (1000); B's median is
    1100 and its range (1120 - 980) / 1100 = 12.7%, so 1000 >= 1100 x (1 - 0.127) = 960: they
    tie and the simpler, A (plain), is named. Counted as 0 tokens/s samples, the failures would
    make A's median 0 and B the winner."""
    study = _study(tmp_path)
    a = add_record(study, {"precision": "fp32"}, fidelity="exact", tps=1000.0)
    b = add_record(
        study, {"precision": "fp32", "gradient_checkpointing": "full"}, fidelity="exact", tps=980.0
    )
    runner = RecordedRunner(
        {
            repr(sorted({"precision": "fp32"}.items())): [_result("failed"), _result("oom")],
            repr(sorted({"precision": "fp32", "gradient_checkpointing": "full"}.items())): [
                _result("ok", 1100.0),
                _result("ok", 1120.0),
            ],
        }
    )
    assert remeasure(study, runner, 2) == 4
    assert study.user_attrs["remeasured"] == {str(b): [1100.0, 1120.0]}
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == a
    assert [r.number for r in sel.ties] == [b]


def test_a_lone_winner_and_a_remeasured_group_need_no_runs(tmp_path: Path) -> None:
    """By hand: 1000 against 800 tokens/s is 20% apart, beyond the noise: no finalists. Two
    ties both re-measured: none either; one of them not yet: both again."""
    study = _study(tmp_path)
    add_record(study, {"precision": "fp32"}, fidelity="exact", tps=1000.0)
    add_record(study, {"precision": "fp32", "zero_stage": 2}, fidelity="exact", tps=800.0)
    assert finalists(study) == []
    c = add_record(study, {"optimizer": "adafactor"}, fidelity="other_optimizer", tps=700.0)
    d = add_record(
        study,
        {"optimizer": "adafactor", "gradient_checkpointing": "full"},
        fidelity="other_optimizer",
        tps=690.0,
    )
    assert finalists(study) == [[c, d]]
    study.set_user_attr("remeasured", {str(c): [700.0]})
    assert finalists(study) == [[c, d]]
    study.set_user_attr("remeasured", {str(c): [700.0], str(d): [690.0]})
    assert finalists(study) == []
