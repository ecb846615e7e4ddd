"""The techniques' rules and conditions: declared in their modules, inherited by every search
space, refused by the job. The bundled spaces state only their dimensions, choices and own rules;
sampled and enumerated, they give the configurations ``tests/data/space_record.json`` recorded
when the same rules and ``when`` conditions were written out in each YAML file (the grid's size
and digest, and a seeded TPE study's 25 trials)."""

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
from trials.techniques import TECHNIQUES, Forbid, Knob, Technique, When

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
    assert recorded_as(resolved(case).grid(), case)


def recorded_as(grid: list[dict[str, Any]], case: dict[str, Any]) -> bool:
    if case["space"] == "estimate":
        # the estimate space's full-training configurations are the recorded ones; its adapters
        # (LoRA/DoRA) have their own grid beside them (tests/test_estimate_adapters.py)
        grid = [
            {k: v for k, v in c.items() if k != "adapter"}
            for c in grid
            if c.get("adapter", "none") == "none"
        ]
    digest = hashlib.sha256(json.dumps(grid, sort_keys=True).encode()).hexdigest()
    return (len(grid), digest) == (case["size"], case["sha256"])


@pytest.mark.parametrize("case", grid_cases(large=False))
def test_the_feasible_space_is_the_one_the_written_rules_gave(case: dict[str, Any]) -> None:
    check_grid(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", grid_cases(large=True))
def test_the_default_feasible_space_is_the_one_the_written_rules_gave(
    case: dict[str, Any],
) -> None:
    check_grid(case)


def check_minimal_file(case: dict[str, Any], tmp_path: Path) -> None:
    """A user's --space file naming the bundled space's dimensions and choices and nothing else
    (no ``when``, no rule): its grid, less the configurations the bundled file's own rules
    forbid (filtered here by hand), is the grid recorded when the bundled file wrote every
    condition out."""
    raw = yaml.safe_load(
        resources.files("search_spaces").joinpath(f"{case['space']}.yaml").read_text()
    )
    minimal = {"dimensions": {k: {"choices": v["choices"]} for k, v in raw["dimensions"].items()}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(minimal, sort_keys=False))
    space = SearchSpace.load(path).resolve(
        case["global_batch"], HARDWARE[case["hardware"]], documents=case["documents"]
    )
    own = [
        {k: v if isinstance(v, list) else [v] for k, v in r["forbid"].items()}
        for r in raw.get("rules") or []
    ]
    grid = [
        c
        for c in space.grid()
        if not any(all(k in c and c[k] in vals for k, vals in rule.items()) for rule in own)
    ]
    assert recorded_as(grid, case)


@pytest.mark.parametrize("case", grid_cases(large=False))
def test_a_minimal_space_file_gets_the_conditions_the_bundled_file_wrote(
    case: dict[str, Any], tmp_path: Path
) -> None:
    check_minimal_file(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", grid_cases(large=True))
def test_a_minimal_default_space_file_gets_the_conditions_the_bundled_file_wrote(
    case: dict[str, Any], tmp_path: Path
) -> None:
    check_minimal_file(case, tmp_path)


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
    """fp16 and the step in backward, fp16 and FSDP2, FSDP2 only without the step in backward:
    a --space file that names the dimensions, no rule and no condition never gets these
    combinations (enumerated by hand below; None: the dimension is absent)."""
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
        (c["precision"], c["optimizer_in_backward"], c.get("fsdp"))
        for c in space.resolve(8, Hardware("cpu")).grid()
    )
    assert got == [
        ("fp16", False, "off"),
        ("fp32", False, "full_shard"),
        ("fp32", False, "off"),
        ("fp32", True, None),
    ]


def test_a_file_adds_its_own_when_to_the_inherited_conditions() -> None:
    """offload_optimizer exists only under ZeRO 1-3 (its module's condition); the file narrows
    it to stage 3; zero_stage exists only without FSDP2 (FSDP2's condition)."""
    space = SearchSpace.from_dict(
        {
            "dimensions": {
                "fsdp": {"choices": ["off", "full_shard"]},
                "zero_stage": {"choices": [0, 2, 3]},
                "offload_optimizer": {"choices": ["none", "cpu"], "when": {"zero_stage": [2, 3]}},
                "offload_param": {"choices": ["none", "cpu"], "when": {"zero_stage": [0, 3]}},
            }
        }
    )
    got = sorted(
        tuple(str(c.get(k)) for k in ("fsdp", "zero_stage", "offload_optimizer", "offload_param"))
        for c in space.grid()
    )
    assert got == [
        ("full_shard", "None", "None", "None"),
        ("off", "0", "None", "None"),
        ("off", "2", "cpu", "None"),
        ("off", "2", "none", "None"),
        ("off", "3", "cpu", "cpu"),
        ("off", "3", "cpu", "none"),
        ("off", "3", "none", "cpu"),
        ("off", "3", "none", "none"),
    ]


@pytest.mark.parametrize(
    ("dimensions", "message"),
    [
        (
            {"offload_param": ["none", "cpu"]},
            "'offload_param' exists only where zero_stage is 3 .*: add 'zero_stage' to the space",
        ),
        (
            {"zero_stage": [0, 2], "fsdp": ["off", "full_shard"]},
            "'zero_stage' exists only where fsdp is off .*: declare 'fsdp' before 'zero_stage'",
        ),
        (
            {"compile": [True], "fsdp": ["off", "full_shard"]},
            "'fsdp' exists only where compile is False .*: no choice of 'compile'",
        ),
    ],
    ids=["missing", "declared-after", "never"],
)
def test_a_space_where_a_condition_cannot_hold_is_refused_in_one_line(
    dimensions: dict[str, list[Any]], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        SearchSpace.from_dict({"dimensions": {k: {"choices": v} for k, v in dimensions.items()}})


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


class _ToyEngine(Technique):
    """A technique defined here alone: a dimension whose presence picks a way of training that
    exists only with fp32 (as ``zero_stage`` picks DeepSpeed)."""

    family = "toy_engine"
    knobs = (Knob("toy_engine", ("a", "b")),)
    whens = (When("toy_engine", {"precision": "fp32"}, "toy_engine trains in fp32", job=True),)


def test_a_new_techniques_condition_reaches_the_space_and_the_job() -> None:
    with TECHNIQUES.extended(_ToyEngine()):
        space = SearchSpace.from_dict(
            {
                "dimensions": {
                    "precision": {"choices": ["fp32", "bf16"]},
                    "toy_engine": {"choices": ["a", "b"]},
                }
            }
        )
        got = sorted((c["precision"], c.get("toy_engine", "")) for c in space.grid())
        assert got == [("bf16", ""), ("fp32", "a"), ("fp32", "b")]
        with pytest.raises(ValueError, match="toy_engine trains in fp32"):
            run_trial(tiny_spec({"precision": "bf16", "toy_engine": "a"}, measured_steps=1))
        assert run_trial(tiny_spec({"precision": "bf16"}, measured_steps=1)).status == "ok"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"zero_stage": 0, "optimizer_in_backward": True}, "without DeepSpeed, which owns"),
        ({"precision": "fp16", "optimizer_in_backward": True}, "fp16's loss scaler"),
        ({"precision": "fp16", "fsdp": "full_shard"}, "fsdp runs without fp16"),
        ({"optimizer_in_backward": True, "fsdp": "full_shard"}, "without the optimizer step"),
    ],
    ids=["deepspeed-in-backward", "fp16-in-backward", "fp16-fsdp", "in-backward-fsdp"],
)
def test_the_job_refuses_what_a_rule_says_cannot_run(config: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        run_trial(tiny_spec(config, measured_steps=1))
