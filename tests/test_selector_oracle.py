"""The decision against an oracle written here from the raw trial records: on random studies of
measured-looking trials (real SQLite, real Optuna), `autotune show --json` names as winner the
fastest trial that finished, fits the budget and was not rejected by its stored loss verdict,
within the most faithful class group that has one; its Pareto front is the set no other
finished trial beats on both speed and memory; `autotune export` writes the winner's
configuration. Speeds are spaced more than the noise floor apart, so no tie decides."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.storage import open_storage
from autotune.study import StudySettings, create_or_load
from tests.conftest import cli

MB = 2**20
BUDGET = 200 * MB
#: class groups, most faithful first, from the fidelity each trial stores (the README's order)
ORDER = [("exact", "mixed"), ("reduced_state",), ("other_optimizer",), ("adapters",)]
#: within a group the configurations differ in simplicity, so "the simplest" is not "the fastest"
CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"precision": "fp32"}, "exact"),
    ({"precision": "fp32", "gradient_checkpointing": "full"}, "exact"),
    ({"precision": "fp32", "zero_stage": 2}, "exact"),
    ({"precision": "bf16"}, "mixed"),
    ({"precision": "bf16", "zero_stage": 3, "offload_optimizer": "cpu"}, "mixed"),
    ({"optimizer": "adamw8bit"}, "reduced_state"),
    (
        {"optimizer": "adamw8bit", "zero_stage": 2, "gradient_checkpointing": "full"},
        "reduced_state",
    ),
    ({"optimizer": "adafactor"}, "other_optimizer"),
    ({"optimizer": "adafactor", "gradient_checkpointing": "full"}, "other_optimizer"),
    ({"quantization": "nf4"}, "adapters"),
]


def _random_study(storage: str, seed: int) -> optuna.Study:
    settings = StudySettings(
        model="tiny-llama",
        model_config={},
        budget_bytes=BUDGET,
        budget_label="200MB",
        backend="cpu",
        seq_len=64,
        global_batch_size=8,
        space={},
        allow="adapters",
    )
    study = create_or_load(open_storage(storage), f"oracle-{seed}", settings)
    rng = random.Random(seed)
    # a third of the studies has nothing full-training within the budget, another third nothing
    # of the first two groups either: the answer then comes from a less faithful class
    over = [(), ("exact", "mixed"), ("exact", "mixed", "reduced_state")][seed % 3]
    # distinct speeds 15% apart (beyond the 5% noise floor), in random order
    speeds = [1000 * 1.15**i for i in range(30)]
    rng.shuffle(speeds)
    for speed in speeds[: rng.randint(8, 30)]:
        config, fidelity = rng.choice(CONFIGS)
        status = rng.choices(["ok", "oom", "failed"], [6, 2, 1])[0]
        peak = rng.randint(201 if fidelity in over else 50, 300) * MB
        verdict = rng.choice([None, True, True, False])
        attrs: dict[str, Any] = {
            "config": {**config, "micro_batch_size": rng.choice([1, 2, 4])},
            "fidelity": fidelity,
            "status": status,
            "peak_bytes": peak,
            "tokens_per_s": speed if status == "ok" else 0.0,
            "step_spread": 0.01,
        }
        if status == "ok" and verdict is not None:
            attrs["loss_verdict"] = {"via": "probe", "ok": verdict, "regression": 0.0}
        state = TrialState.COMPLETE if status != "failed" else TrialState.FAIL
        values = [attrs["tokens_per_s"], peak / MB] if state == TrialState.COMPLETE else None
        study.add_trial(optuna.trial.create_trial(state=state, values=values, user_attrs=attrs))
    return study


def _oracle(study: optuna.Study) -> dict[str, Any]:
    """The answer from the raw records, by the rules in the module docstring."""
    finished = []
    for t in study.trials:
        a = t.user_attrs
        if t.state != TrialState.COMPLETE or a["status"] != "ok":
            continue
        if (a.get("loss_verdict") or {}).get("ok") is False:
            continue
        finished.append(t)
    feasible = [t for t in finished if t.user_attrs["peak_bytes"] <= BUDGET]
    winner = None
    for group in ORDER:
        mine = [t for t in feasible if t.user_attrs["fidelity"] in group]
        if mine:
            winner = max(mine, key=lambda t: t.user_attrs["tokens_per_s"]).number
            break

    def beats(o: optuna.trial.FrozenTrial, t: optuna.trial.FrozenTrial) -> bool:
        so, st = o.user_attrs["tokens_per_s"], t.user_attrs["tokens_per_s"]
        mo, mt = o.user_attrs["peak_bytes"], t.user_attrs["peak_bytes"]
        return so >= st and mo <= mt and (so > st or mo < mt)

    pareto = sorted(
        (t for t in finished if not any(beats(o, t) for o in finished)),
        key=lambda t: t.user_attrs["peak_bytes"],
    )
    return {"winner": winner, "pareto": [t.number for t in pareto]}


@pytest.mark.parametrize("seed", range(9))
def test_show_names_the_fastest_feasible_trial_of_the_most_faithful_class(
    seed: int, tmp_path: Path
) -> None:
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = _random_study(storage, seed)
    shown = json.loads(
        cli("show", "--storage", storage, "--study", study.study_name, "--json").output
    )
    expected = _oracle(study)
    assert shown["winner"] == expected["winner"]
    assert shown["pareto"] == expected["pareto"]
    if expected["winner"] is None:
        return
    out = tmp_path / "ds.json"
    cli(
        "export",
        "--storage",
        storage,
        "--study",
        study.study_name,
        "--format",
        "deepspeed",
        "--out",
        str(out),
    )
    exported = json.loads(out.read_text())
    winner = study.trials[expected["winner"]].user_attrs["config"]
    # the exported DeepSpeed config trains the winner's micro-batch and ZeRO stage
    assert exported["train_micro_batch_size_per_gpu"] == winner["micro_batch_size"]
    assert exported.get("zero_optimization", {}).get("stage", 0) == winner.get("zero_stage", 0)
    assert bool(exported.get("bf16", {}).get("enabled")) == (winner.get("precision") == "bf16")


def test_the_oracle_sees_every_kind_of_trial(tmp_path: Path) -> None:
    """The random studies above hold what the rules are about: trials over the budget, OOMs,
    failures, rejected verdicts, and winners in more than one class group."""
    seen: dict[str, int] = {}
    groups = set()
    for seed in range(9):
        study = _random_study(f"sqlite:///{tmp_path / f'{seed}.db'}", seed)
        for t in study.trials:
            a = t.user_attrs
            seen[a["status"]] = seen.get(a["status"], 0) + 1
            if a["status"] == "ok" and a["peak_bytes"] > BUDGET:
                seen["over"] = seen.get("over", 0) + 1
            if (a.get("loss_verdict") or {}).get("ok") is False:
                seen["rejected"] = seen.get("rejected", 0) + 1
        w = _oracle(study)["winner"]
        if w is not None:
            groups.add(study.trials[w].user_attrs["fidelity"])
    assert all(seen.get(k, 0) >= 3 for k in ("ok", "oom", "failed", "over", "rejected")), seen
    assert len(groups) >= 3, groups
