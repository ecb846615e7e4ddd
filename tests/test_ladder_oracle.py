"""The ablation ladder (``autotune/ladder.py``) against a brute force over the raw trial records
of random studies (real Optuna): every configuration of a five-technique space has a record
(measured, out of memory, failed, predicted, or a copy), with random peaks and speeds around the
budget, and the ladder ``build_ladder`` reads from them is compared with the one the rules below
give when followed by hand over the records.

The decisions the module makes, each with a test here that fails when it is inverted, swapped
or fed the wrong quantity:

1. the first rung: plain training (each technique's baseline value, the whole global batch as
   one micro-batch);
2. the candidates of a rung: the rung below plus one more of the target's techniques;
3. which candidate becomes the next rung: while the rung below is over the budget (or has no
   measurement), the one with the smallest peak (the biggest saving); once it fits, the
   fastest candidate that fits, and only if none fits the one with the smallest peak; a
   candidate over the budget never ranks as a fit however fast; a failed or unmeasured
   candidate ranks last;
4. "fits": a measured peak (finished, or out of memory when run without the budget) that is
   positive and at most the budget;
5. which record stands for a configuration: a finished or unbounded (ladder, reference) or
   predicted one, measured before predicted, the original before a copy, a failure last; a
   trial stopped by the budget (its peak is not the true one) never;
6. each rung's saving alone: the baseline's peak less the peak of the same technique applied to
   the baseline alone (not to the rung below);
7. what is missing: the baseline and the candidates of the first rung that lack a record.
"""

from __future__ import annotations

import random
from typing import Any

import optuna
import pytest

from autotune.ladder import build_ladder
from autotune.selector import select
from autotune.space import SearchSpace
from tests.records import MB, add_record, memory_study
from trials.techniques import fidelity_class

BUDGET = 200 * MB
DIMS = ["gradient_checkpointing", "precision", "attention", "optimizer", "micro_batch_size"]
SPACE = SearchSpace.from_dict(
    {
        "dimensions": {
            "gradient_checkpointing": {"choices": ["off", "full"]},
            "precision": {"choices": ["fp32", "bf16"]},
            "attention": {"choices": ["sdpa", "eager"]},
            "optimizer": {"choices": ["adamw", "adafactor"]},
            "micro_batch_size": {"choices": [8, 2]},
        }
    },
    "ladder-oracle",
)
#: plain training at global batch 8, by hand
BASELINE = {
    "gradient_checkpointing": "off",
    "precision": "fp32",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 8,
}


def _key(config: dict[str, Any]) -> str:
    return repr(sorted(config.items()))


def _random_study(seed: int) -> optuna.Study:
    """One to three records per configuration of the space. Peaks are distinct, from half to
    one and a half times the budget; speeds distinct. Out-of-memory records are ladder trials
    (run without the budget: a true peak) or, as another record, one stopped by the budget (a
    peak that is not the true one, to be ignored); some configurations only have a prediction,
    a failure, or a measurement and its copy; some measured ones a prediction besides."""
    rng = random.Random(seed)
    study = memory_study(f"ladder-{seed}", BUDGET)
    grid = SPACE.grid()
    peaks = rng.sample(range(100 * MB, 300 * MB, MB // 4), 2 * len(grid))
    speeds = rng.sample(range(500, 5000), 2 * len(grid))
    for i, config in enumerate(grid):
        kind = rng.choices(["ok", "ladder-oom", "failed", "predicted", "copy"], [5, 3, 1, 1, 1])[0]
        peak, tps = peaks[2 * i], float(speeds[2 * i])
        fidelity = fidelity_class(config)
        if rng.random() < 0.3:  # a trial stopped by the budget first: never the record used
            add_record(
                study, config, fidelity=fidelity, status="oom", peak=BUDGET + MB, tps=0.0, role=""
            )
        if kind == "failed":
            add_record(study, config, fidelity=fidelity, status="failed")
            continue
        status = "ok" if peak <= BUDGET else "oom"
        extra: dict[str, Any] = {"role": "ladder"}
        if kind == "predicted":
            extra = {"predicted": True, "role": ""}
        if kind == "copy":
            # the original (a measured trial), then a later copy of it with other numbers
            first = add_record(study, config, fidelity=fidelity, status=status, peak=peak, tps=tps)
            other = peaks[2 * i + 1]
            add_record(
                study,
                config,
                fidelity=fidelity,
                status="ok" if other <= BUDGET else "oom",
                peak=other,
                tps=float(speeds[2 * i + 1]),
                role="ladder",
                duplicate_of=first,
            )
            continue
        add_record(study, config, fidelity=fidelity, status=status, peak=peak, tps=tps, **extra)
        if kind in ("ok", "ladder-oom") and rng.random() < 0.3:
            # a prediction of a configuration also measured: the measurement stands for it
            other = peaks[2 * i + 1]
            add_record(
                study,
                config,
                fidelity=fidelity,
                status="ok" if other <= BUDGET else "oom",
                peak=other,
                tps=float(speeds[2 * i + 1]),
                predicted=True,
            )
    return study


def _records(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """config -> the record that stands for it (rule 5), from the raw trials."""
    out: dict[str, dict[str, Any]] = {}
    for t in study.trials:
        a = t.user_attrs
        true_peak = a["status"] == "ok" or a.get("role") == "ladder" or a.get("predicted")
        if a["status"] != "failed" and not true_peak:
            continue
        rank = (a["status"] == "failed", bool(a.get("predicted")), "duplicate_of" in a, t.number)
        key = _key(a["config"])
        if key not in out or rank < out[key]["rank"]:
            out[key] = {**a, "number": t.number, "rank": rank}
    return out


def _fits(rec: dict[str, Any] | None) -> bool:
    return rec is not None and rec["status"] in ("ok", "oom") and 0 < rec["peak_bytes"] <= BUDGET


def _oracle(study: optuna.Study, target: dict[str, Any]) -> list[dict[str, Any]]:
    """The rungs by the rules of the module docstring: techniques, trial number, saving alone."""
    recs = _records(study)
    first = recs.get(_key(BASELINE))
    rungs = [{"techniques": (), "number": first["number"] if first else None, "alone": None}]
    remaining = [d for d in DIMS if target[d] != BASELINE[d]]
    applied: list[str] = []
    current = first
    while remaining:
        candidates = []
        for dim in remaining:
            config = {**BASELINE, **{d: target[d] for d in [*applied, dim]}}
            candidates.append((dim, recs.get(_key(config))))
        usable = [
            (d, r) for d, r in candidates if r and r["status"] != "failed" and r["peak_bytes"] > 0
        ]
        fitting = [(d, r) for d, r in usable if _fits(r)]
        if not usable:
            dim, rec = candidates[0]
        elif _fits(current) and fitting:
            dim, rec = max(fitting, key=lambda c: c[1]["tokens_per_s"])  # type: ignore[index]
        else:
            dim, rec = min(usable, key=lambda c: c[1]["peak_bytes"])  # type: ignore[index]
        alone_rec = recs.get(_key({**BASELINE, dim: target[dim]}))
        alone = None
        true_peak = alone_rec is not None and (
            alone_rec["status"] == "ok"
            or alone_rec.get("role") == "ladder"
            or bool(alone_rec.get("predicted"))
        )
        if applied and true_peak and first is not None:
            assert alone_rec is not None
            alone = first["peak_bytes"] - alone_rec["peak_bytes"]
        applied.append(dim)
        remaining.remove(dim)
        rungs.append(
            {"techniques": tuple(applied), "number": rec["number"] if rec else None, "alone": alone}
        )
        current = rec
    return rungs


def _ladder(study: optuna.Study, target: dict[str, Any] | None) -> list[dict[str, Any]]:
    ladder = build_ladder(study, SPACE, target)
    return [
        {
            "techniques": s.techniques,
            "number": s.row.number if s.row else None,
            "alone": s.alone_saving,
        }
        for s in ladder.steps
    ]


@pytest.mark.parametrize("seed", range(30))
def test_ladder_to_a_random_target_matches_the_brute_force(seed: int) -> None:
    study = _random_study(seed)
    rng = random.Random(seed)
    target = rng.choice([c for c in SPACE.grid() if c != BASELINE])
    ladder = build_ladder(study, SPACE, target)
    assert ladder.steps[0].config == BASELINE
    assert ladder.steps[-1].config == target
    assert ladder.missing == []
    assert _ladder(study, target) == _oracle(study, target)


@pytest.mark.parametrize("seed", range(30, 40))
def test_ladder_to_the_winner_matches_the_brute_force(seed: int) -> None:
    study = _random_study(seed)
    winner = select(study).winner
    ladder = build_ladder(study, SPACE)
    if winner is None:  # nothing to climb to: the baseline alone
        assert ladder.target is None and [s.config for s in ladder.steps] == [BASELINE]
        return
    assert ladder.target is not None and ladder.target.number == winner.number
    assert _ladder(study, None) == _oracle(study, winner.config)


def test_the_random_studies_hold_what_the_rules_are_about() -> None:
    """Rungs chosen in each regime: over the budget by saving; fitting, where the fastest
    candidate is over the budget and a slower one fits; fitting with no candidate that fits;
    and a failed or budget-stopped record beside the one used."""
    seen = {"over": 0, "fit_beats_faster_over": 0, "none_fits": 0, "stopped": 0, "failed": 0}
    for seed in range(30):
        study = _random_study(seed)
        recs = _records(study)
        seen["stopped"] += any(
            t.user_attrs["status"] == "oom" and not t.user_attrs.get("role") for t in study.trials
        )
        seen["failed"] += any(r["status"] == "failed" for r in recs.values())
        target = random.Random(seed).choice([c for c in SPACE.grid() if c != BASELINE])
        applied: list[str] = []
        current = recs.get(_key(BASELINE))
        for rung in _oracle(study, target)[1:]:
            dim = rung["techniques"][-1]
            others = [d for d in DIMS if target[d] != BASELINE[d] and d not in applied]
            cands = [
                recs.get(_key({**BASELINE, **{d: target[d] for d in [*applied, o]}}))
                for o in others
            ]
            cands = [c for c in cands if c and c["status"] != "failed"]
            if not _fits(current):
                seen["over"] += 1
            else:
                fit = [c for c in cands if _fits(c)]
                fastest = max(cands, key=lambda c: c["tokens_per_s"], default=None)
                if fit and fastest is not None and not _fits(fastest):
                    seen["fit_beats_faster_over"] += 1
                if cands and not fit:
                    seen["none_fits"] += 1
            applied.append(dim)
            current = recs.get(_key({**BASELINE, **{d: target[d] for d in applied}}))
    assert all(n >= 3 for n in seen.values()), seen


def test_missing_rungs_are_the_first_undecided_ones() -> None:
    """By hand: only the baseline (over the budget) and one of two first-rung candidates are
    recorded: the ladder asks for the other candidate, nothing further up."""
    study = memory_study("missing", BUDGET)
    target = {**BASELINE, "gradient_checkpointing": "full", "precision": "bf16"}
    add_record(study, BASELINE, fidelity="exact", status="oom", peak=250 * MB, role="ladder")
    ckpt = {**BASELINE, "gradient_checkpointing": "full"}
    add_record(study, ckpt, fidelity="exact", peak=150 * MB, role="ladder")
    ladder = build_ladder(study, SPACE, target)
    assert ladder.missing == [{**BASELINE, "precision": "bf16"}]
    assert not ladder.complete


def test_a_rung_exactly_at_the_budget_fits() -> None:
    """By hand: the baseline peaks exactly at the budget, so it fits and the next rung is the
    fastest candidate that fits: bf16 (2000 tokens/s), itself exactly at the budget, over
    checkpointing (1000 tokens/s, the smaller peak)."""
    study = memory_study("at-budget", BUDGET)
    target = {**BASELINE, "gradient_checkpointing": "full", "precision": "bf16"}
    add_record(study, BASELINE, fidelity="exact", peak=BUDGET, tps=900.0, role="ladder")
    ckpt = {**BASELINE, "gradient_checkpointing": "full"}
    add_record(study, ckpt, fidelity="exact", peak=150 * MB, tps=1000.0, role="ladder")
    bf16 = {**BASELINE, "precision": "bf16"}
    add_record(study, bf16, fidelity="mixed", peak=BUDGET, tps=2000.0, role="ladder")
    add_record(study, target, fidelity="mixed", peak=120 * MB, tps=1500.0, role="ladder")
    ladder = build_ladder(study, SPACE, target)
    assert [s.techniques for s in ladder.steps] == [
        (),
        ("precision",),
        ("precision", "gradient_checkpointing"),
    ]
