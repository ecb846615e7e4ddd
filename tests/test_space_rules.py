"""The techniques' rules: declared in their modules, inherited by every search space, refused by
the job. The bundled spaces state only their own choices; sampled and enumerated, they give the
configurations ``tests/data/space_record.json`` recorded when the same rules were written out in
each YAML file (the grid's size and digest, and a seeded TPE study's 25 trials)."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from autotune.errors import UserError
from autotune.space import SearchSpace
from autotune.yaml_limits import parse_yaml
from tests.conftest import tiny_spec
from trials.hardware import Hardware
from trials.job import run_trial
from trials.techniques import TECHNIQUES, Forbid, Knob, Technique

RECORD = json.loads((Path(__file__).parent / "data" / "space_record.json").read_text())
HARDWARE = {
    "gpu": Hardware(
        "cuda",
        (9, 0),
        8,
        has_flash_attn=True,
        has_bitsandbytes=True,
        has_peft=True,
        has_torchao=True,
    ),
    "cpu": Hardware("cpu", None, 0, has_peft=True, has_torchao=True, cpu_fp16=True),
}
#: the grids that take seconds (the default space's run to about a million configurations)
LARGE = {"default"}


def bundled(name: str) -> SearchSpace:
    text = resources.files("search_spaces").joinpath(f"{name}.yaml").read_text()
    return SearchSpace.from_dict(parse_yaml(text, name), name)


def resolved(case: dict[str, Any]) -> SearchSpace:
    return bundled(case["space"]).resolve(
        case["global_batch"], HARDWARE[case["hardware"]], documents=case["documents"]
    )


def case_id(case: dict[str, Any]) -> str:
    return f"{case['space']}-{case['hardware']}-{case['global_batch']}"


def grid_cases(large: bool) -> list[Any]:
    return [
        pytest.param(c, id=case_id(c)) for c in RECORD["grids"] if (c["space"] in LARGE) == large
    ]


def check_grid(case: dict[str, Any]) -> None:
    grid = resolved(case).grid()
    digest = hashlib.sha256(json.dumps(grid, sort_keys=True).encode()).hexdigest()
    assert (len(grid), digest) == (case["size"], case["sha256"])


@pytest.mark.parametrize("case", grid_cases(large=False))
def test_the_feasible_space_is_the_one_the_written_rules_gave(case: dict[str, Any]) -> None:
    check_grid(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", grid_cases(large=True))
def test_the_default_feasible_space_is_the_one_the_written_rules_gave(
    case: dict[str, Any],
) -> None:
    check_grid(case)


@pytest.mark.parametrize("case", RECORD["studies"], ids=case_id)
def test_a_seeded_study_samples_the_trials_the_written_rules_gave(case: dict[str, Any]) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = resolved(case)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=7, n_startup_trials=10))
    trials = []
    for _ in range(len(case["trials"])):
        trial = study.ask()
        config = space.sample(trial.suggest_categorical)
        trials.append({"params": trial.params, "config": config})
        study.tell(trial, float(len(json.dumps(config, sort_keys=True)) % 17))
    assert json.loads(json.dumps(trials)) == case["trials"]


@pytest.mark.parametrize("name", ["default", "estimate", "demo"])
def test_no_bundled_space_restates_a_techniques_rule(name: str) -> None:
    """A YAML rule that forbids nothing a technique's rule does not would be a second copy to
    keep (a space's own rule may forbid more: the estimate space leaves ZeRO out of QLoRA)."""
    raw = yaml.safe_load(resources.files("search_spaces").joinpath(f"{name}.yaml").read_text())
    written = [
        {k: set(v) if isinstance(v, list) else {v} for k, v in r["forbid"].items()}
        for r in raw.get("rules") or []
    ]
    for rule in TECHNIQUES.forbids():
        declared = {k: set(v) for k, v in rule.choices.items()}
        assert not any(_within(w, declared) for w in written), rule


def _within(a: dict[str, set[Any]], b: dict[str, set[Any]]) -> bool:
    """Whether rule ``a`` forbids only what rule ``b`` forbids."""
    return set(a) == set(b) and all(a[k] <= b[k] for k in a)


def test_a_space_file_without_rules_inherits_the_techniques_rules() -> None:
    """fp16 and the step in backward, FSDP2 and quantized weights: a --space file that names the
    dimensions and no rule never gets these combinations (enumerated by hand below)."""
    space = SearchSpace.from_dict(
        {
            "dimensions": {
                "precision": {"choices": ["fp32", "fp16"]},
                "optimizer_in_backward": {"choices": [False, True]},
                "fsdp": {"choices": ["off", "full_shard"]},
            }
        }
    )
    got = sorted(
        (c["precision"], c["optimizer_in_backward"], c["fsdp"])
        for c in space.resolve(8, Hardware("cpu")).grid()
    )
    assert got == [
        ("fp16", False, "off"),
        ("fp32", False, "full_shard"),
        ("fp32", False, "off"),
        ("fp32", True, "off"),
    ]


def test_the_dimension_declared_last_loses_and_a_file_adds_its_own_rules() -> None:
    """Declared first, the step in backward is what fp16 narrows it to (false); declared after,
    it narrows precision instead. A file's own rule applies beside the inherited ones."""
    first = SearchSpace.from_dict(
        {
            "dimensions": {
                "optimizer_in_backward": {"choices": [False, True]},
                "precision": {"choices": ["fp32", "fp16", "bf16"]},
            },
            "rules": [{"forbid": {"optimizer_in_backward": False, "precision": "bf16"}}],
        }
    )
    assert [(r.target, r.forbidden) for r in first.rules] == [
        ("precision", ("bf16",)),
        ("precision", ("fp16",)),
    ]
    assert sorted((c["optimizer_in_backward"], c["precision"]) for c in first.grid()) == [
        (False, "fp16"),
        (False, "fp32"),
        (True, "bf16"),
        (True, "fp32"),
    ]


def test_a_stored_space_reloads_with_the_same_rules_once() -> None:
    """The study stores the resolved space with every rule it holds: reloaded, no rule is added
    twice, so what is stored is what was resolved."""
    space = resolved(RECORD["studies"][0])
    stored = space.as_dict()
    again = SearchSpace.from_dict(json.loads(json.dumps(stored)), "study")
    assert again.as_dict() == stored
    assert len(stored["rules"]) == len(space.rules)


def test_a_space_that_can_only_break_a_rule_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="no choice of 'optimizer_in_backward' is left where"):
        SearchSpace.from_dict(
            {
                "dimensions": {
                    "precision": {"choices": ["fp16"]},
                    "optimizer_in_backward": {"choices": [True]},
                }
            }
        )


class _Toy(Technique):
    """A technique defined here alone: a dimension whose "on" cannot run with fp16."""

    family = "toy_rule"
    knobs = (Knob("toy_rule", ("off", "on"), baseline="off"),)
    forbids = (Forbid({"precision": "fp16", "toy_rule": "on"}, "toy_rule on breaks fp16", True),)


def test_a_new_techniques_rule_reaches_the_space_and_the_job() -> None:
    with TECHNIQUES.extended(_Toy()):
        space = SearchSpace.from_dict(
            {
                "dimensions": {
                    "precision": {"choices": ["fp32", "fp16"]},
                    "toy_rule": {"choices": ["off", "on"]},
                }
            }
        )
        pairs = sorted((c["precision"], c["toy_rule"]) for c in space.grid())
        assert pairs == [("fp16", "off"), ("fp32", "off"), ("fp32", "on")]
        with pytest.raises(ValueError, match="toy_rule on breaks fp16"):
            run_trial(tiny_spec({"precision": "fp16", "toy_rule": "on"}, measured_steps=1))
        run_trial(tiny_spec({"precision": "fp32", "toy_rule": "on"}, measured_steps=1))


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"precision": "fp16", "optimizer_in_backward": True}, "fp16's loss scaler"),
        ({"precision": "fp16", "fsdp": "full_shard"}, "fsdp runs without fp16"),
        ({"optimizer_in_backward": True, "fsdp": "full_shard"}, "without the optimizer step"),
    ],
    ids=["fp16-in-backward", "fp16-fsdp", "in-backward-fsdp"],
)
def test_the_job_refuses_what_a_rule_says_cannot_run(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        run_trial(tiny_spec(config, measured_steps=1))
