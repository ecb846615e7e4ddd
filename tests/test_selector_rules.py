"""The selector's rules one at a time, on rows whose answers are worked out by hand here: the
estimate backend's predicted winner and ties, the measured winner among contenders at the
boundary of the noise margin, the Pareto front's domination at equal speed, the loaded-machine
warning's thresholds, and the closest miss when nothing fits (real SQLite, real Optuna)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.selector import (
    Row,
    class_summary,
    decide,
    machine_load,
    margin_between,
    pareto_front,
    select,
    selection_json,
)
from tests.studies import records_study

MB = 2**20


def _row(number: int, speed: float, peak: int = 10 * MB, **kw: Any) -> Row:
    fields: dict[str, Any] = {
        "config": {"precision": "fp32"},
        "status": "ok",
        "loss_regression": None,
        "loss_tolerance": None,
        "fits": True,
        "loss_ok": True,
    }
    fields.update(kw)
    return Row(number=number, peak_bytes=peak, tokens_per_s=speed, **fields)


def test_predicted_winner_is_the_fastest_and_ties_are_within_the_model_error() -> None:
    # the speed model's error is 6%: 94 of 100 ties, 93.9 does not
    rows = [
        _row(0, 93.9, predicted=True),
        _row(1, 100.0, predicted=True),
        _row(2, 94.0, predicted=True),
        _row(3, 97.0, predicted=True),
    ]
    winner, ties, margin = decide(rows)
    assert winner is rows[1]
    assert [r.number for r in ties] == [3, 2]  # fastest first, the winner not among them
    assert margin == 0.06


def test_predicted_equal_speeds_go_to_the_least_memory_then_the_first() -> None:
    rows = [
        _row(4, 100.0, 50 * MB, predicted=True),
        _row(5, 100.0, 40 * MB, predicted=True),
        _row(6, 100.0, 40 * MB, predicted=True),
    ]
    winner, ties, _ = decide(rows)
    assert winner is rows[1]
    assert {r.number for r in ties} == {4, 6}


def test_measured_contender_at_the_margin_ties_and_the_simplest_wins() -> None:
    fast = _row(0, 100.0, config={"precision": "bf16", "zero_stage": 2})
    edge = _row(1, 95.0, config={"precision": "fp32"})  # exactly 5% slower: within the floor
    winner, ties, margin = decide([fast, edge])
    assert winner is edge  # plain fp32 is simpler than bf16 + ZeRO-2
    assert ties == [fast] and margin == 0.05
    # beyond the margin the faster one wins outright
    slower = _row(2, 94.9, config={"precision": "fp32"})
    assert decide([fast, slower])[0] is fast


def test_equally_simple_contenders_go_to_the_faster() -> None:
    a = _row(0, 98.0, config={"precision": "bf16"})
    b = _row(1, 100.0, config={"precision": "bf16"})
    winner, ties, _ = decide([a, b])
    assert winner is b and ties == [a]


def test_margin_is_the_noisier_of_the_two() -> None:
    quiet = _row(0, 100.0, step_spread=0.01)
    noisy = _row(1, 100.0, step_spread=0.2)
    assert margin_between(quiet, noisy) == 0.2
    assert margin_between(noisy, quiet) == 0.2
    assert margin_between(quiet, quiet) == 0.05


def test_pareto_front_drops_equal_speed_at_more_memory() -> None:
    small = _row(0, 100.0, 10 * MB)
    big = _row(1, 100.0, 20 * MB)
    faster = _row(2, 150.0, 30 * MB)
    same = _row(3, 100.0, 10 * MB)  # identical to ``small``: neither beats the other
    assert {r.number for r in pareto_front([small, big, faster, same])} == {0, 2, 3}


def test_loaded_machine_warning_thresholds() -> None:
    calm = [_row(i, 100.0, load_per_core=1.0, step_spread=0.10) for i in range(3)]
    assert machine_load(calm) == ""  # at the thresholds: not loaded
    loaded = [_row(i, 100.0, load_per_core=1.2, step_spread=0.01) for i in range(3)]
    assert "load 1.2 per core" in machine_load(loaded)
    spread = [_row(i, 100.0, load_per_core=0.1, step_spread=0.3) for i in range(3)]
    assert "spread 30%" in machine_load(spread)
    # only measured trials that ran count: predictions, duplicates and OOMs are left out
    ignored = [
        _row(10, 1.0, load_per_core=9.0, step_spread=0.9, predicted=True),
        _row(11, 1.0, load_per_core=9.0, step_spread=0.9, duplicate_of=0),
        _row(12, 1.0, load_per_core=9.0, step_spread=0.9, status="oom"),
    ]
    assert machine_load(calm + ignored) == ""
    assert machine_load(ignored) == ""


def _study(tmp_path: Path, trials: list[dict[str, Any]], allow: str = "adapters") -> optuna.Study:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = records_study(url, "r", 100 * MB, "100MB", allow)
    for attrs in trials:
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.COMPLETE, values=[1.0, 1.0], user_attrs=attrs
            )
        )
    return study


def test_closest_miss_is_the_smallest_measured_peak(tmp_path: Path) -> None:
    study = _study(
        tmp_path,
        [
            {"status": "ok", "peak_bytes": 300 * MB, "tokens_per_s": 10.0},
            {"status": "oom", "peak_bytes": 250 * MB},
            {"status": "oom", "peak_bytes": 0},  # died before measuring anything
            {"status": "oom", "peak_bytes": 120 * MB, "pruned_by_estimate": True},  # never run
            {"status": "failed", "peak_bytes": 110 * MB},
            {"status": "ok", "peak_bytes": 90 * MB, "loss_verdict": {"via": "probe", "ok": False}},
            # over the budget and regressing: not counted as "fits but regresses"
            {"status": "ok", "peak_bytes": 400 * MB, "loss_verdict": {"via": "probe", "ok": False}},
        ],
    )
    sel = select(study)
    assert sel.winner is None
    # the loss-rejected trial fits but is no answer; it is still the smallest that ran
    assert sel.closest is not None and sel.closest.number == 5
    assert selection_json(study)["closest"] == 5
    full = sel.classes["full"]
    assert full.group == "full"
    assert (full.tried, full.regressed) == (6, 1)  # ok and oom (predicted too); one regresses
    lines = class_summary(sel, str)
    assert lines[0].endswith("6 tried, none passes: 1 fit 100 MiB but regress the loss")
    assert lines[1].endswith(": not tried")
    assert len(lines) == 4


def test_closest_miss_may_be_an_oom(tmp_path: Path) -> None:
    study = _study(
        tmp_path,
        [
            {"status": "ok", "peak_bytes": 300 * MB, "tokens_per_s": 10.0},
            {"status": "oom", "peak_bytes": 101 * MB},
        ],
    )
    sel = select(study)
    assert sel.closest is not None and sel.closest.number == 1
    assert class_summary(sel, str)[0].endswith(": 2 tried, none fits 100 MiB")


def test_not_searched_groups_are_named_and_the_rest_follow(tmp_path: Path) -> None:
    study = _study(
        tmp_path, [{"status": "ok", "peak_bytes": 10 * MB, "tokens_per_s": 10.0}], allow="mixed"
    )
    lines = class_summary(select(study), str)
    assert len(lines) == 4 and "trial 0" in lines[0]
    assert lines[1].endswith("not searched (--allow reduced_state includes it)")
    assert lines[3].endswith("not searched (--allow adapters includes it)")


def test_selection_carries_the_load_warning(tmp_path: Path) -> None:
    trials = [
        {"status": "ok", "peak_bytes": 10 * MB, "tokens_per_s": 10.0 + i, "load_per_core": 3.0}
        for i in range(3)
    ]
    assert "load 3.0 per core" in select(_study(tmp_path, trials)).load_warning


def test_no_closest_when_a_winner_exists(tmp_path: Path) -> None:
    study = _study(
        tmp_path,
        [
            {"status": "ok", "peak_bytes": 50 * MB, "tokens_per_s": 10.0},
            {"status": "oom", "peak_bytes": 20 * MB},
        ],
    )
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == 0
    assert sel.closest is None and selection_json(study)["closest"] is None


def test_ties_beyond_three_are_counted(tmp_path: Path) -> None:
    configs = [{"precision": "fp32"}] + [
        {"precision": "fp32", "gradient_checkpointing": "full", "micro_batch_size": m}
        for m in (1, 2, 3, 4)
    ]
    trials = [
        {"status": "ok", "peak_bytes": 10 * MB, "tokens_per_s": 100.0 - i, "config": c}
        for i, c in enumerate(configs)
    ]
    sel = select(_study(tmp_path, trials))
    line = class_summary(sel, lambda c: "cfg")[0]
    assert "ties with #1, #2, #3 and 1 more within 5%" in line
    (tmp_path / "b").mkdir()
    sel3 = select(_study(tmp_path / "b", trials[:4]))
    line3 = class_summary(sel3, lambda c: "cfg")[0]
    assert "ties with #1, #2, #3 within 5%" in line3 and "more" not in line3
