"""The selector's rules on a real Optuna study whose trials carry measured-looking attrs: a winner
must beat the runner-up by more than the noise, ties go to the simplest configuration, each
fidelity class gets its own answer, and the stored loss verdict (never a recomputed one) decides
feasibility."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.display import describe
from autotune.lossguard import LossVerdict
from autotune.selector import class_summary, decide, select, simplicity
from autotune.storage import open_storage
from autotune.study import StudySettings, create_or_load
from trials.techniques import fidelity_class

MB = 2**20
PLAIN = {"gradient_checkpointing": "off", "precision": "fp32", "optimizer": "adamw"}


def _study(tmp_path: Path, allow: str = "other_optimizer") -> optuna.Study:
    settings = StudySettings(
        model="tiny-llama",
        model_config={},
        budget_bytes=200 * MB,
        budget_label="200MB",
        backend="cpu",
        seq_len=64,
        global_batch_size=8,
        space={},
        allow=allow,
    )
    return create_or_load(open_storage(f"sqlite:///{tmp_path / 'db.sqlite'}"), "s", settings)


def _add(
    study: optuna.Study,
    config: dict[str, Any],
    tps: float,
    peak_mib: float = 100,
    spread: float = 0.01,
    verdict: LossVerdict | None = None,
    **attrs: Any,
) -> int:
    config = {**PLAIN, **config}
    verdict = verdict or LossVerdict("reference", True, 1e-6, 1e-3)
    trial = optuna.trial.create_trial(
        values=[tps, peak_mib],
        user_attrs={
            "config": config,
            "fidelity": fidelity_class(config),
            "status": "ok",
            "peak_bytes": int(peak_mib * MB),
            "tokens_per_s": tps,
            "step_spread": spread,
            "loss_verdict": verdict.to_attrs(),
            **attrs,
        },
    )
    study.add_trial(trial)
    return study.trials[-1].number


def test_within_five_percent_is_a_tie_and_the_simpler_wins(tmp_path: Path) -> None:
    study = _study(tmp_path)
    simple = _add(study, {"gradient_checkpointing": "full"}, 1000)
    busy = _add(study, {"gradient_checkpointing": "full", "zero_stage": 2}, 1030)
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == simple  # 3% faster is noise
    assert [r.number for r in sel.ties] == [busy]


def test_beyond_the_noise_the_faster_wins(tmp_path: Path) -> None:
    study = _study(tmp_path)
    _add(study, {"gradient_checkpointing": "full"}, 1000)
    fast = _add(study, {"gradient_checkpointing": "full", "zero_stage": 2}, 1200)
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == fast and not sel.ties


def test_a_wide_measured_spread_widens_the_margin(tmp_path: Path) -> None:
    study = _study(tmp_path)
    simple = _add(study, {}, 1000, spread=0.02)
    _add(study, {"zero_stage": 2, "offload_optimizer": "cpu"}, 1150, spread=0.2)
    sel = select(study)  # 15% faster but its step times spread 20%: not beyond the noise
    assert sel.winner is not None and sel.winner.number == simple
    assert sel.classes["full"].margin == pytest.approx(0.2)


def test_remeasurements_decide(tmp_path: Path) -> None:
    study = _study(tmp_path)
    a = _add(study, {}, 1000)
    b = _add(study, {"gradient_checkpointing": "full"}, 1040)
    # interleaved re-measurements: b was lucky the first time, a is really faster
    study.set_user_attr("remeasured", {str(a): [1200.0, 1210.0], str(b): [1000.0, 1010.0]})
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == a
    assert sel.winner.speed == pytest.approx(1205.0)  # median of 1200 and 1210 alone


def test_each_class_has_its_own_answer_and_full_training_comes_first(tmp_path: Path) -> None:
    study = _study(tmp_path)
    mixed = _add(
        study, {"precision": "bf16"}, 1000, verdict=LossVerdict("probe", True, 0.001, 0.02, 0.003)
    )
    lion = _add(
        study, {"optimizer": "lion"}, 3000, verdict=LossVerdict("probe", True, 0.01, 0.02, 0.003)
    )
    _add(  # faster still, but its stored verdict rejects it
        study,
        {"optimizer": "adafactor"},
        5000,
        verdict=LossVerdict("probe", False, 0.2, 0.02, 0.003),
    )
    sel = select(study)
    assert sel.winner is not None and sel.winner.number == mixed  # 3x slower, but trains the model
    other = sel.classes["other_optimizer"].winner
    assert other is not None and other.number == lion
    lines = class_summary(sel, describe)
    assert lines[0].startswith(f"full training, exact or mixed precision: trial {mixed}:")
    assert "+0.10% ±0.30% seed noise on a probe" in lines[0]
    assert lines[1] == "if you accept 8-bit optimizer state: not tried"
    assert lines[2].startswith(f"if you accept another optimizer (Adafactor, Lion): trial {lion}")
    assert lines[3] == (
        "with LoRA adapters on a frozen base: not searched (--allow adapters includes it)"
    )


def test_a_class_whose_fitting_trials_regressed_says_so(tmp_path: Path) -> None:
    """'none fits' would send a user after more memory; the Adafactor trial fit and broke the
    loss guard, and one Lion trial ran out of memory: the line says which."""
    study = _study(tmp_path)
    _add(study, {}, 1000)
    _add(study, {"optimizer": "adafactor"}, 5000, verdict=LossVerdict("probe", False, 0.5, 0.02))
    _add(study, {"optimizer": "lion"}, 0, peak_mib=300, status="oom")
    lines = class_summary(select(study), describe)
    assert lines[2] == (
        "if you accept another optimizer (Adafactor, Lion): 2 tried, none passes: 1 fit 200 MiB "
        "but regress the loss"
    )


def test_host_memory_in_the_answer(tmp_path: Path) -> None:
    study = _study(tmp_path)
    _add(
        study,
        {"zero_stage": 2, "offload_optimizer": "cpu"},
        1000,
        memory_breakdown={"device": 100 * MB, "host_offloaded": 50 * MB},
    )
    (line, *_) = class_summary(select(study), describe)
    assert "peak 100 MiB of 200 MiB, host 50 MiB, 1,000 tokens/s" in line


def test_simplicity_order() -> None:
    plain = {**PLAIN, "zero_stage": 0}
    z1 = {**PLAIN, "zero_stage": 1}
    z1_off = {**z1, "offload_optimizer": "cpu"}
    ckpt = {**PLAIN, "gradient_checkpointing": "full"}
    assert simplicity(plain) < simplicity(ckpt) < simplicity(z1) < simplicity(z1_off)


def test_decide_without_feasible_rows() -> None:
    assert decide([]) == (None, [], 0.05)


def test_the_answer_lines_in_full(tmp_path: Path) -> None:
    """Every part of a class line, worked out by hand: the winner, its peak and speed, up to
    three ties and how many more, the margin, and each kind of loss verdict in words."""
    study = _study(tmp_path, allow="adapters")
    simplest = _add(
        study,
        {"gradient_checkpointing": "full"},
        1000,
        verdict=LossVerdict("reference", True, 0.0, 1e-3),
    )
    for tps in (1040, 1030, 1020, 1010):  # four ties within 5%, each a technique more
        _add(study, {"gradient_checkpointing": "full", "zero_stage": 2}, tps)
    _add(
        study,
        {"optimizer": "adamw_8bit"},
        900,
        verdict=LossVerdict("probe", False, 0.05, 0.02, None),
    )
    lion = _add(
        study, {"optimizer": "lion"}, 800, verdict=LossVerdict("none", None, note="probe failed: x")
    )
    lines = class_summary(select(study), describe)
    ties = "; ties with #1, #2, #3 and 1 more within 5%: the simplest is named"
    assert lines[0] == (
        f"full training, exact or mixed precision: trial {simplest}: "
        f"{describe({**PLAIN, 'gradient_checkpointing': 'full'})}: peak 100 MiB of 200 MiB, "
        f"1,000 tokens/s{ties}; loss: matches the reference to 0e+00 per step (within 1e-03)"
    )
    assert lines[1] == (
        "if you accept 8-bit optimizer state: 1 tried, none passes: 1 fit 200 MiB but regress "
        "the loss"
    )
    assert lines[2].endswith(
        f"trial {lion}: {describe({**PLAIN, 'optimizer': 'lion'})}: peak 100 MiB of 200 MiB, "
        "800 tokens/s; loss: no verdict: probe failed: x"
    )
    assert lines[3] == "with LoRA adapters on a frozen base: not tried"


def test_verdicts_in_words() -> None:
    from autotune.selector import Row, verdict_text

    def row(verdict: LossVerdict | None, role: str = "") -> Row:
        return Row(0, {}, "ok", 1, 1.0, None, None, True, None, role=role, verdict=verdict)

    assert verdict_text(row(None)) == "no verdict (did not run to the end)"
    ref = LossVerdict("reference", True, 0.0, 1e-3, note="this is the reference")
    assert verdict_text(row(ref, role="reference")) == "the reference"
    assert verdict_text(row(LossVerdict("reference", False, 0.02, 1e-3))) == (
        "matches the reference to 2e-02 per step (over 1e-03)"
    )
    assert verdict_text(row(LossVerdict("probe", True, -0.0123, 0.02, 0.004, "proxy p"))) == (
        "-1.23% ±0.40% seed noise on a probe, within tolerance 2% (proxy p)"
    )
    assert verdict_text(row(LossVerdict("probe", False, 0.05, 0.02, None, "proxy q"))) == (
        "+5.00% on a probe, over tolerance 2% (proxy q)"
    )
    assert verdict_text(row(LossVerdict("none", None, note="adapters"))) == "no verdict: adapters"


def test_simplicity_by_hand() -> None:
    """(techniques used, ZeRO stage, offloads): a choice differing from plain training is a
    technique; the micro-batch is not one."""
    assert simplicity({}) == (0, 0, 0)
    assert simplicity({**PLAIN, "micro_batch_size": 4, "attention": "sdpa"}) == (0, 0, 0)
    assert simplicity({"attention": "eager", "precision": "bf16"}) == (2, 0, 0)
    zero3 = {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
    assert simplicity(zero3) == (3, 3, 2)
    assert simplicity({"zero_stage": 2, "offload_optimizer": "none"}) == (1, 2, 0)


def test_show_json_carries_the_whole_answer(tmp_path: Path) -> None:
    import json

    from tests.conftest import cli

    study = _study(tmp_path)
    slow = _add(study, {"gradient_checkpointing": "full"}, 1000, spread=0.02)
    fast = _add(study, {"zero_stage": 2}, 1500, peak_mib=150)
    over = _add(study, {"zero_stage": 3}, 1520, peak_mib=400)  # over the 200 MB budget
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shown = json.loads(cli("show", "--storage", storage, "--study", "s", "--json").output)
    assert (shown["study"], shown["model"], shown["backend"]) == ("s", "tiny-llama", "cpu")
    assert shown["budget_bytes"] == 200 * MB
    assert (shown["winner"], shown["closest"], shown["ties"]) == (fast, None, [])
    assert shown["pareto"] == [slow, fast, over]  # over the budget, but no trial beats it
    full = shown["classes"]["full"]
    assert (full["winner"], full["ties"], full["margin"], full["searched"]) == (
        fast,
        [],
        0.05,
        True,
    )
    assert shown["classes"]["adapters"]["searched"] is False
    assert shown["load_warning"] == ""
    by_number = {t["number"]: t for t in shown["trials"]}
    assert by_number[slow]["speed"] == 1000 and by_number[slow]["spread"] == 0.02
    assert by_number[fast]["feasible"] is True
    assert by_number[over]["feasible"] is False and by_number[over]["fits"] is False
