"""The selector's decisions (``autotune/selector.py``), each on a hand-made study whose answer is
worked out by hand in the test (real Optuna, trial records as the objective stores them).

The decisions, each with a test here that fails when it is inverted, swapped or fed the wrong
quantity (random studies against a brute force: ``tests/test_selector_oracle.py``):

1. feasible: finished, peak at most the budget (equal fits), loss verdict not rejected (no
   verdict is not a rejection); out-of-memory, failed and copied trials never are;
2. a configuration's speed: the median of its side-by-side re-measurements where it has some
   (the trial's own tokens/s, taken at another moment, is then left out), else the trial's own;
   its noise: the larger of the step-time spread and the re-measurements' range over that
   median; after a single re-measurement, the range over the trial's own tokens/s and it;
3. a tie: a feasible configuration whose speed is within the larger of 5%, the fastest's noise
   and its own noise, of the fastest; once a group has re-measured configurations, only they
   decide (a faster trial not re-measured was measured at another moment);
4. among ties the simplest wins: fewer techniques, then lower ZeRO stage, then fewer offloads,
   then the faster; the others are listed as ties, fastest first;
5. the class groups, most faithful first (full training exact or mixed, 8-bit state, other
   optimizers, adapters): each its own winner, the headline the first group that has one;
6. predictions (the estimate backend): the fastest is named (least memory among equal speeds),
   no simplicity, ties within the speed model's error;
7. the closest miss when nothing is feasible: the smallest measured peak among trials that ran
   or ran out of memory, never one pruned by the estimate;
8. the Pareto front: the finished, not rejected trials no other beats on speed and memory;
9. the loaded-machine warning: the median load per core or the median step spread over its
   threshold.
"""

from __future__ import annotations

from typing import Any

import optuna

from autotune.selector import decide, machine_load, rows_of, select
from tests.records import MB, add_record, memory_study

BUDGET = 200 * MB
PLAIN = {"precision": "fp32"}
CKPT = {"precision": "fp32", "gradient_checkpointing": "full"}
ZERO2 = {"precision": "fp32", "zero_stage": 2}
ZERO2_OFF = {"precision": "fp32", "zero_stage": 2, "offload_optimizer": "cpu"}
ZERO1 = {"precision": "fp32", "zero_stage": 1}


def _study(name: str = "s") -> optuna.Study:
    return memory_study(name, BUDGET)


def _exact(study: optuna.Study, config: dict[str, Any], **kw: Any) -> int:
    return add_record(study, config, fidelity="exact", **kw)


def test_a_contenders_own_noise_makes_it_a_tie() -> None:
    """By hand: the fastest re-measured once at 1100 (its trial 1100, spread 1%: noise 0) and a
    plain configuration re-measured at 850 and 1050 (median 950, range 200/950 = 21.05%).
    950 >= 1100 x (1 - 0.2105) = 868: a tie within the contender's own noise, and the simpler
    (plain) is named. Under the fastest's noise alone (5%: 1045) it would not tie."""
    study = _study()
    fast = _exact(study, CKPT, tps=1100.0, spread=0.01)
    plain = _exact(study, PLAIN, tps=1000.0, spread=0.01)
    study.set_user_attr("remeasured", {str(plain): [850.0, 1050.0], str(fast): [1100.0]})
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == plain
    assert [r.number for r in sel.ties] == [fast]
    assert abs(sel.classes["full"].margin - 200 / 950) < 1e-9


def test_the_fastests_own_noise_makes_it_a_tie() -> None:
    """By hand: the fastest at 1100 with a step spread of 12%, the plain one at 1000 (1%):
    1000 >= 1100 x 0.88 = 968, a tie; the plain one is named."""
    study = _study()
    fast = _exact(study, CKPT, tps=1100.0, spread=0.12)
    plain = _exact(study, PLAIN, tps=1000.0, spread=0.01)
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == plain
    assert [r.number for r in sel.ties] == [fast]


def test_beyond_every_noise_the_fastest_wins() -> None:
    """By hand: 1100 against 1000 with 1% spreads is 9% apart, beyond the 5% floor."""
    study = _study()
    fast = _exact(study, CKPT, tps=1100.0)
    _exact(study, PLAIN, tps=1000.0)
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == fast and sel.ties == []


def test_the_floor_is_five_percent() -> None:
    """By hand: 1000 against 960 (4% apart) tie; 1000 against 940 (6%) do not."""
    study = _study()
    _exact(study, CKPT, tps=1000.0)
    plain = _exact(study, PLAIN, tps=960.0)
    assert select(study).winner.number == plain  # type: ignore[union-attr]
    study2 = _study("b")
    fast = _exact(study2, CKPT, tps=1000.0)
    _exact(study2, PLAIN, tps=940.0)
    assert select(study2).winner.number == fast  # type: ignore[union-attr]


def test_speed_is_the_median_of_the_remeasurements_and_noise_their_range() -> None:
    """By hand: a trial at 5000 tokens/s (another moment, left out) re-measured at 1000, 1300
    and 1100: median 1100 (the mean would be 1133; with the trial's own, 1200), noise the range
    300/1100. Two re-measurements 1000 and 1010: median 1005, the step spread (2%) larger
    than 10/1005."""
    study = _study()
    n = _exact(study, PLAIN, tps=5000.0, spread=0.02)
    study.set_user_attr("remeasured", {str(n): [1000.0, 1300.0, 1100.0]})
    row = rows_of(study)[0]
    assert row.speed == 1100.0
    assert abs(row.spread - 300 / 1100) < 1e-12
    study.set_user_attr("remeasured", {str(n): [1000.0, 1010.0]})
    row = rows_of(study)[0]
    assert row.speed == 1005.0 and row.spread == 0.02


def test_one_remeasurement_its_noise_is_the_range_with_the_trials_own() -> None:
    """By hand: a trial at 1000 tokens/s (spread 1%) re-measured once at 1250: speed 1250,
    noise (1250 - 1000) / 1250 = 20% (a single sample has no range of its own)."""
    study = _study()
    n = _exact(study, PLAIN, tps=1000.0, spread=0.01)
    study.set_user_attr("remeasured", {str(n): [1250.0]})
    row = rows_of(study)[0]
    assert row.speed == 1250.0
    assert abs(row.spread - 0.2) < 1e-12


def test_once_remeasured_only_the_remeasured_decide() -> None:
    """By hand: a trial at 2000 tokens/s not re-measured (taken at another moment), beside
    checkpointing re-measured at 1000 and 1010 and plain at 900 and 905 (median 902.5, beyond
    5% of 1005): checkpointing wins, no ties. Deciding on every speed, the 2000 would win."""
    study = _study()
    _exact(study, ZERO2, tps=2000.0)
    ck = _exact(study, CKPT, tps=700.0)
    plain = _exact(study, PLAIN, tps=1500.0)
    study.set_user_attr("remeasured", {str(ck): [1000.0, 1010.0], str(plain): [900.0, 905.0]})
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == ck and sel.ties == []


def test_ties_go_to_fewer_techniques_then_lower_stage_then_fewer_offloads() -> None:
    """By hand, four configurations within 1% of each other: ZeRO-2 with offload (3 techniques),
    ZeRO-2 (1 technique, stage 2), ZeRO-1 (1 technique, stage 1), checkpointing (1, stage 0).
    The simplest is checkpointing; without it ZeRO-1; then ZeRO-2; the others fastest first."""
    study = _study()
    off = _exact(study, ZERO2_OFF, tps=1004.0)
    z2 = _exact(study, ZERO2, tps=1003.0)
    z1 = _exact(study, ZERO1, tps=1002.0)
    ck = _exact(study, CKPT, tps=1001.0)
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == ck
    assert [r.number for r in sel.ties] == [off, z2, z1]
    rows = [r for r in rows_of(study) if r.number != ck]
    assert decide(rows)[0].number == z1  # type: ignore[union-attr]
    rows = [r for r in rows if r.number != z1]
    assert decide(rows)[0].number == z2  # type: ignore[union-attr]


def test_fewer_techniques_before_a_lower_stage() -> None:
    """By hand: ZeRO-1 alone (1 technique, stage 1) against checkpointing with eager attention
    (2 techniques, stage 0), 1% apart: ZeRO-1 is the simpler."""
    study = _study()
    z1 = _exact(study, ZERO1, tps=1000.0)
    _exact(study, {**CKPT, "attention": "eager"}, tps=1010.0)
    assert select(study).winner.number == z1  # type: ignore[union-attr]


def test_among_equally_simple_ties_the_faster_wins() -> None:
    study = _study()
    _exact(study, ZERO1, tps=1000.0)
    faster = _exact(study, ZERO2 | {"zero_stage": 1, "gradient_checkpointing": "off"}, tps=1010.0)
    assert select(study).winner.number == faster  # type: ignore[union-attr]


def test_feasibility_budget_verdict_status_and_copies() -> None:
    """By hand: the fastest is over the budget by a byte, the next regressed the loss, the next
    ran out of memory, the next is a copy: the winner is the one exactly at the budget, and a
    trial with no verdict counts as not rejected."""
    study = _study()
    _exact(study, PLAIN, tps=5000.0, peak=BUDGET + 1)
    _exact(study, PLAIN, tps=4000.0, verdict_ok=False)
    _exact(study, PLAIN, tps=3000.0, status="oom", peak=BUDGET // 2)
    at = _exact(study, PLAIN, tps=1000.0, peak=BUDGET)
    _exact(study, PLAIN, tps=2000.0, duplicate_of=at)
    assert select(study).winner.number == at  # type: ignore[union-attr]
    none = _exact(study, CKPT, tps=1500.0, verdict_ok=None)
    assert select(study).winner.number == none  # type: ignore[union-attr]


def _four_groups(over: tuple[str, ...] = ()) -> tuple[optuna.Study, dict[str, int]]:
    """An adapter run (fastest), an other-optimizer run, an 8-bit-state run and a mixed one
    (slowest); those of the classes in ``over`` a byte over the budget."""
    study = _study("groups-" + "-".join(over))
    runs = [
        ("adapters", {"quantization": "nf4"}, 4000.0),
        ("other_optimizer", {"optimizer": "adafactor"}, 3000.0),
        ("reduced_state", {"optimizer": "adamw_8bit"}, 2000.0),
        ("mixed", {"precision": "bf16"}, 1000.0),
    ]
    numbers = {}
    for fidelity, config, tps in runs:
        peak = BUDGET + 1 if fidelity in over else BUDGET // 2
        numbers[fidelity] = add_record(study, config, fidelity=fidelity, tps=tps, peak=peak)
    return study, numbers


def test_groups_in_order_of_faithfulness() -> None:
    """By hand: each group names its own run; the headline is the full-training one however
    slow; with it over the budget the 8-bit one, then the other optimizer, then the adapters."""
    study, n = _four_groups()
    sel = select(study)
    got = {g: (c.winner.number if c.winner else None) for g, c in sel.classes.items()}
    assert got == {
        "full": n["mixed"],
        "reduced_state": n["reduced_state"],
        "other_optimizer": n["other_optimizer"],
        "adapters": n["adapters"],
    }
    assert sel.winner is not None and sel.winner.number == n["mixed"]
    over: tuple[str, ...] = ()
    for fidelity, expected in (
        ("mixed", "reduced_state"),
        ("reduced_state", "other_optimizer"),
        ("other_optimizer", "adapters"),
    ):
        over = (*over, fidelity)
        study, n = _four_groups(over)
        assert select(study).winner.number == n[expected]  # type: ignore[union-attr]


def test_predictions_name_the_fastest_then_the_least_memory() -> None:
    """By hand: predicted 1000 (checkpointing) and 970 (plain): 3% apart, within the speed
    model's 6% error: a tie, but the fastest is named (no simplicity for predictions); at equal
    speeds the smaller peak; 900 (10% slower) is no tie."""
    study = _study()
    fast = _exact(study, CKPT, tps=1000.0, peak=150 * MB, predicted=True)
    same = _exact(study, ZERO2, tps=1000.0, peak=120 * MB, predicted=True)
    plain = _exact(study, PLAIN, tps=970.0, predicted=True)
    _exact(study, ZERO1, tps=900.0, predicted=True)
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == same
    assert [r.number for r in sel.ties] == [fast, plain]
    assert sel.classes["full"].margin == 0.06


def test_the_closest_miss_is_the_smallest_measured_peak() -> None:
    """By hand: nothing fits; a pruned-by-estimate prediction at 210 MB, a failure, and two
    out-of-memory runs at 260 and 230 MB: the closest is the 230 MB run."""
    study = _study()
    _exact(study, PLAIN, status="oom", peak=260 * MB)
    near = _exact(study, CKPT, status="oom", peak=230 * MB)
    _exact(study, ZERO2, status="oom", peak=210 * MB, pruned_by_estimate=True, predicted=True)
    _exact(study, ZERO1, status="failed")
    sel = select(study)
    assert sel.winner is None and sel.closest is not None and sel.closest.number == near


def test_pareto_front_by_hand() -> None:
    """By hand: (speed, peak) A (1000, 100), B (900, 80), C (900, 120: beaten by A), D (1200,
    250: over the budget, still on the front), E (1300, 90, rejected: not on it)."""
    study = _study()
    a = _exact(study, PLAIN, tps=1000.0, peak=100 * MB)
    b = _exact(study, CKPT, tps=900.0, peak=80 * MB)
    _exact(study, ZERO1, tps=900.0, peak=120 * MB)
    d = _exact(study, ZERO2, tps=1200.0, peak=250 * MB)
    _exact(study, ZERO2_OFF, tps=1300.0, peak=90 * MB, verdict_ok=False)
    assert [r.number for r in select(study).pareto] == [b, a, d]


def test_loaded_machine_warning_thresholds() -> None:
    """By hand: load 1.0 per core and spread 10% are at the thresholds (no warning); 1.5 per
    core or a 20% median spread warn."""
    study = _study()
    for _ in range(3):
        _exact(study, PLAIN, spread=0.10, load_per_core=1.0)
    assert machine_load(rows_of(study)) == ""
    loaded = _study("loaded")
    for _ in range(3):
        _exact(loaded, PLAIN, spread=0.02, load_per_core=1.5)
    assert "load 1.5 per core" in machine_load(rows_of(loaded))
    noisy = _study("noisy")
    for _ in range(3):
        _exact(noisy, PLAIN, spread=0.20, load_per_core=0.2)
    assert "spread 20%" in machine_load(rows_of(noisy))
