"""The loss verdict's arithmetic, against numbers worked out by hand: the exact check's per-step
relative tolerance, the final-loss window, the probe's seed-paired regression and noise band, and
which rule each fidelity class gets. Fast (no training): the probe curves are replayed by a
runner that returns recorded loss curves, where tests/test_lossguard.py trains them for real."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autotune.lossguard import (
    EXACT_RTOL,
    LossVerdict,
    Prober,
    ProbeSettings,
    against_reference,
    final_loss,
    judge,
    model_family,
    proxy_config,
)
from autotune.models import MODELS
from autotune.runner import TrialRunner
from trials.engines import trial_deepspeed_config
from trials.spec import TrialResult, TrialSpec

LLAMA = MODELS["tiny-llama"].config


# --- exact: every step within 1e-3 of the reference -------------------------------------------


def test_identical_curves_pass_with_zero_regression() -> None:
    v = against_reference([2.0, 1.5, 1.25], [2.0, 1.5, 1.25])
    assert (v.via, v.ok, v.regression, v.tolerance) == ("reference", True, 0.0, 1e-3)
    assert v.note == "3 steps"


def test_one_step_off_by_two_thousandths_fails_and_reports_the_worst_step() -> None:
    # step 2 differs by 0.003 on a reference of 1.5: 0.002 relative, twice the tolerance
    v = against_reference([2.0, 1.503, 1.25], [2.0, 1.5, 1.25])
    assert v.ok is False
    assert v.regression == pytest.approx(0.002, rel=1e-9)


def test_the_difference_is_relative_to_the_reference_and_two_sided() -> None:
    # 0.0009 relative to 1.0 (passes), below as well as above; 0.0011 fails
    assert against_reference([0.9991], [1.0]).ok is True
    assert against_reference([1.0009], [1.0]).ok is True
    assert against_reference([0.9989], [1.0]).ok is False
    # relative to the reference, not to the candidate: |9.99 - 10| / 10 = 0.001 is at the edge
    edge = against_reference([9.99], [10.0])
    assert edge.ok is True and edge.regression == pytest.approx(0.001, rel=1e-9)
    assert against_reference([9.9889], [10.0]).ok is False


def test_only_the_common_steps_are_compared() -> None:
    # the reference ran 2 steps, the candidate 4 (a longer run): the last two are not compared
    v = against_reference([2.0, 1.0, 9.0, 9.0], [2.0, 1.0])
    assert v.ok is True and v.note == "2 steps"


def test_a_non_finite_loss_fails_and_no_curve_gives_no_verdict() -> None:
    nan = against_reference([2.0, math.nan], [2.0, 1.9])
    assert nan.ok is False and nan.regression == math.inf and nan.note == "non-finite loss"
    inf = against_reference([math.inf], [2.0])
    assert inf.ok is False
    empty = against_reference([], [2.0])
    assert (empty.via, empty.ok) == ("none", None)


# --- the final loss of a probe: the mean of the last tenth, at least 5 steps --------------------


def test_final_loss_window() -> None:
    assert final_loss([9.0] * 90 + [1.0, 2.0, 3.0, 4.0, 5.0] * 2) == 3.0  # 100 steps: last 10
    curve = [9.0] * 90 + [1.0] * 5 + [3.0] * 5
    assert final_loss(curve) == 2.0
    assert final_loss([9.0] * 190 + [1.0] * 20) == pytest.approx(29 / 21)  # 210: the last 21
    assert final_loss([9.0] * 189 + [1.0] * 21) == 1.0
    assert final_loss([9.0] * 15 + [2.0] * 5) == 2.0  # 20 steps: at least 5
    assert final_loss([4.0, 2.0]) == 3.0  # fewer steps than the window: all of them
    assert math.isnan(final_loss([]))


# --- lossy: the probe, seed-paired ----------------------------------------------------------------


class ReplayRunner(TrialRunner):
    """Returns recorded loss curves by (precision, seed); counts what it was asked to run."""

    def __init__(self, curves: dict[tuple[str, int], list[float] | None]) -> None:
        self.curves = curves
        self.runs: list[tuple[str, int]] = []

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        key = (str(spec.config["precision"]), spec.seed)
        self.runs.append(key)
        losses = self.curves[key]
        if losses is None:
            return TrialResult(status="failed", error="the machine was busy")
        return TrialResult(status="ok", losses=losses)


def _curve(final: float, steps: int = 50) -> list[float]:
    return [5.0] * (steps - 5) + [final] * 5  # 50 steps: the final window is the last 5


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path))
    return tmp_path


def _probe(curves: dict[tuple[str, int], list[float] | None], seeds: int = 2) -> Prober:
    return Prober(LLAMA, ProbeSettings(50, seeds, 3e-3, "cpu"), ReplayRunner(curves))


RECORDED: dict[tuple[str, int], list[float] | None] = {
    ("fp32", 0): _curve(2.0),
    ("fp32", 1): _curve(2.2),
    ("bf16", 0): _curve(2.1),  # +0.1 / 2.0 = +5%
    ("bf16", 1): _curve(2.2),  # 0%
}


def test_probe_regression_is_the_mean_paired_difference_and_noise_the_seed_spread(
    cache: Path,
) -> None:
    # regression = (5% + 0%) / 2 = 2.5%; noise = (2.2 - 2.0) / mean(2.0, 2.2) = 0.2 / 2.1
    v = _probe(RECORDED).judge({"precision": "bf16"}, tolerance=0.03)
    assert v.via == "probe" and v.ok is True
    assert v.regression == pytest.approx(0.025, rel=1e-9)
    assert v.noise == pytest.approx(0.2 / 2.1, rel=1e-9)
    assert v.tolerance == 0.03
    assert "noise band is wider than the tolerance" in v.note
    assert v.note.startswith("proxy llama-")
    assert "2x64, 50 steps x 2 seeds" in v.note


def test_probe_fails_above_the_tolerance_and_passes_below_it(cache: Path) -> None:
    assert _probe(RECORDED).judge({"precision": "bf16"}, tolerance=0.02).ok is False
    assert _probe(RECORDED).judge({"precision": "bf16"}, tolerance=0.0251).ok is True
    # a tolerance wider than the noise band says nothing about the noise
    wide = _probe(RECORDED).judge({"precision": "bf16"}, tolerance=0.5)
    assert "noise band" not in wide.note


def test_probe_is_paired_by_seed(cache: Path) -> None:
    # swapping the candidate's seeds changes the paired differences: (2.2-2.0)/2.0 = 10% and
    # (2.1-2.2)/2.2 = -4.545%: mean 2.727%, where unpaired means would give 2.38%
    swapped = {**RECORDED, ("bf16", 0): _curve(2.2), ("bf16", 1): _curve(2.1)}
    v = _probe(swapped).judge({"precision": "bf16"}, tolerance=0.03)
    assert v.regression == pytest.approx((0.1 - 0.1 / 2.2) / 2, rel=1e-9)


def test_probe_with_a_diverged_candidate_fails(cache: Path) -> None:
    diverged = {**RECORDED, ("bf16", 1): _curve(math.nan)}
    v = _probe(diverged).judge({"precision": "bf16"}, tolerance=0.5)
    assert v.ok is False and v.regression == math.inf


def test_a_better_loss_is_a_negative_regression_and_passes(cache: Path) -> None:
    better = {**RECORDED, ("bf16", 0): _curve(1.9), ("bf16", 1): _curve(2.2)}
    v = _probe(better).judge({"precision": "bf16"}, tolerance=0.0)
    assert v.ok is True and v.regression == pytest.approx(-0.025, rel=1e-9)


def test_probes_are_run_once_then_read_from_the_cache(cache: Path) -> None:
    first = _probe(RECORDED)
    first.judge({"precision": "bf16"}, tolerance=0.03)
    assert sorted(first.runner.runs) == [("bf16", 0), ("bf16", 1), ("fp32", 0), ("fp32", 1)]
    again = _probe(RECORDED)
    assert again.judge({"precision": "bf16"}, tolerance=0.03).regression == pytest.approx(0.025)
    assert again.runner.runs == []
    # a third seed runs only the new seed's two curves
    three = _probe({**RECORDED, ("fp32", 2): _curve(2.0), ("bf16", 2): _curve(2.0)}, seeds=3)
    three.judge({"precision": "bf16"}, tolerance=0.03)
    assert sorted(three.runner.runs) == [("bf16", 2), ("fp32", 2)]


def test_a_failed_probe_gives_no_verdict_and_says_which(cache: Path) -> None:
    ref_failed = _probe({**RECORDED, ("fp32", 0): None}).judge({"precision": "bf16"}, 0.03)
    assert (ref_failed.via, ref_failed.ok) == ("none", None)
    assert ref_failed.note.startswith("probe of fp32 AdamW failed: failed: the machine was busy")
    cand_failed = _probe({**RECORDED, ("bf16", 1): None}).judge({"precision": "bf16"}, 0.03)
    assert (cand_failed.via, cand_failed.ok) == ("none", None)
    assert cand_failed.note.startswith("probe failed: failed: the machine was busy")


# --- which rule each class gets ------------------------------------------------------------------


def _judge(config: dict, **kw: object) -> LossVerdict:
    args: dict = dict(
        is_reference=False,
        reference=[2.0, 1.5],
        no_reference_why="",
        prober=None,
        no_probe_why="--probe-steps 0",
        tolerance=0.03,
    )
    args.update(kw)
    return judge(config, [2.0, 1.5], **args)


def test_each_fidelity_class_gets_its_rule(cache: Path) -> None:
    assert _judge({"precision": "fp32"}, is_reference=True) == LossVerdict(
        "reference", True, 0.0, EXACT_RTOL, note="this is the reference"
    )
    exact = _judge({"precision": "fp32", "gradient_checkpointing": "full"})
    assert (exact.via, exact.ok, exact.note) == ("reference", True, "2 steps")
    assert _judge({"precision": "fp32"}, reference=[2.0, 1.6]).ok is False
    no_ref = _judge({"precision": "fp32"}, reference=None, no_reference_why="nothing exact fits")
    assert (no_ref.via, no_ref.ok) == ("none", None)
    assert no_ref.note == "exact; no reference curve: nothing exact fits"
    adapters = _judge({"quantization": "nf4"})
    assert (adapters.via, adapters.ok) == ("none", None)
    assert adapters.note.startswith("adapters train a different problem")
    unprobed = _judge({"precision": "bf16"})
    assert (unprobed.via, unprobed.ok) == ("none", None)
    assert unprobed.note == "mixed; no loss probe: --probe-steps 0"
    # a lossy configuration is judged by the probe, never by the reference curve
    probed = _judge({"precision": "bf16"}, prober=_probe(RECORDED), reference=[9.0, 9.0])
    assert probed.via == "probe" and probed.regression == pytest.approx(0.025)


def test_a_verdict_round_trips_through_trial_attrs() -> None:
    v = LossVerdict("probe", False, 0.05, 0.02, 0.01, "proxy")
    assert LossVerdict.from_attrs(v.to_attrs()) == v
    assert LossVerdict.from_attrs(None) is None and LossVerdict.from_attrs({}) is None


# --- the proxy: the same architecture, small ---------------------------------------------


def test_proxy_keeps_the_family_and_the_grouped_query_ratio() -> None:
    llama7b = MODELS["llama-2-7b"].config
    llama3 = MODELS["llama-3-8b"].config  # 32 heads, 8 KV heads, 14336 / 4096 = 3.5
    p = proxy_config(llama3)
    assert (p["hidden_size"], p["num_hidden_layers"], p["num_attention_heads"]) == (64, 2, 4)
    assert p["num_key_value_heads"] == 1  # 4 heads x 8 / 32
    assert p["intermediate_size"] == 224  # 64 x 3.5
    assert p["vocab_size"] == 512 and p["max_position_embeddings"] == 64
    assert "head_dim" not in p
    assert p["model_type"] == llama3["model_type"] and p["rope_theta"] == llama3["rope_theta"]
    assert proxy_config(llama7b)["num_key_value_heads"] == 4  # multi-head: kv = heads
    assert proxy_config({"model_type": "x", "vocab_size": 100})["vocab_size"] == 100
    # two sizes of one family share probes; another non-size setting is another family
    assert model_family(llama7b) == model_family(MODELS["llama-2-13b"].config)
    assert model_family(llama7b) != model_family({**llama7b, "rms_norm_eps": 1e-6 * 3})
    assert model_family(llama7b).startswith("llama-") and len(model_family(llama7b)) == 12


def test_the_tolerances_are_inclusive() -> None:
    # |1001 - 1000| / 1000 is exactly 1e-3 in floating point: at the tolerance passes
    at = against_reference([1001.0], [1000.0])
    assert at.ok is True and at.regression == EXACT_RTOL
    assert against_reference([], [1.0]).note == "no loss curve to compare"
    nan = against_reference([math.nan], [1.0])
    assert (nan.via, nan.tolerance) == ("reference", EXACT_RTOL)


def test_probe_tolerance_and_noise_band_boundaries(cache: Path) -> None:
    # references 1.0 and 3.0: noise (3 - 1) / 2 = 1.0; candidates 1.25 and 3.75: +25% each
    exact = {
        ("fp32", 0): _curve(1.0),
        ("fp32", 1): _curve(3.0),
        ("bf16", 0): _curve(1.25),
        ("bf16", 1): _curve(3.75),
    }
    v = _probe(exact).judge({"precision": "bf16"}, tolerance=0.25)
    assert (v.regression, v.noise) == (0.25, 1.0)
    assert v.ok is True  # a regression at the tolerance passes
    assert "noise band" in v.note  # 1.0 > 0.25
    at_noise = _probe(exact).judge({"precision": "bf16"}, tolerance=1.0)
    assert "noise band" not in at_noise.note  # the band at the tolerance is not wider


def test_the_probe_trains_the_proxy_as_specified(cache: Path) -> None:
    """The spec a probe runs: the numerics under test on the proxy, sdpa, a batch of 8 x 32
    tokens, no warm-up, the probe's steps, seed and lr, on the study's backend."""
    specs: list[TrialSpec] = []

    class Recording(ReplayRunner):
        def run(self, spec: TrialSpec, name: str) -> TrialResult:
            specs.append(spec)
            assert name.startswith("probe-") and len(name) == len("probe-") + 10
            return super().run(spec, name)

    prober = Prober(LLAMA, ProbeSettings(50, 1, 3e-3, "cuda"), Recording(RECORDED))
    prober.judge({"precision": "bf16", "optimizer": "adamw"}, tolerance=0.03)
    ref, cand = specs
    assert ref.config == {
        "precision": "fp32",
        "master_weights": "fp32",
        "optimizer": "adamw",
        "quantization": "none",
        "adapter": "none",
        "attention": "sdpa",
        "micro_batch_size": 8,
    }
    assert cand.config["precision"] == "bf16"
    for spec in specs:
        assert (spec.seq_len, spec.global_batch_size, spec.budget_bytes) == (32, 8, None)
        assert (spec.warmup_steps, spec.measured_steps, spec.seed, spec.lr) == (0, 50, 0, 3e-3)
        assert spec.backend == "cuda"
        assert spec.model_config == proxy_config(LLAMA)


def test_a_pure_bf16_probe_runs_under_zero(cache: Path) -> None:
    """Pure bf16 exists only in DeepSpeed's ZeRO optimizers: its probe trains the proxy under
    ZeRO-1 with DeepSpeed's bf16 master weights and states, not the plain engine's autocast
    (which would measure mixed bf16 and call it pure)."""
    specs: list[TrialSpec] = []

    class Recording(ReplayRunner):
        def run(self, spec: TrialSpec, name: str) -> TrialResult:
            specs.append(spec)
            return super().run(spec, name)

    prober = Prober(LLAMA, ProbeSettings(50, 1, 3e-3, "cpu"), Recording(RECORDED))
    prober.judge({"precision": "bf16", "master_weights": "bf16", "zero_stage": 2}, 0.03)
    ref, cand = specs
    assert "zero_stage" not in ref.config
    assert cand.config["zero_stage"] == 1 and cand.config["master_weights"] == "bf16"
    bf16 = trial_deepspeed_config(cand)["bf16"]
    assert bf16 == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }


def test_a_failed_probe_runs_again_and_a_good_one_is_cached_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AUTOTUNE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    curves: dict[tuple[str, int], list[float] | None] = {**RECORDED, ("bf16", 0): None}
    first = _probe(curves)
    assert first.judge({"precision": "bf16"}, 0.03).via == "none"
    curves[("bf16", 0)] = _curve(2.1)
    again = _probe(curves)
    assert again.judge({"precision": "bf16"}, 0.03).via == "probe"
    assert ("bf16", 0) in again.runner.runs and ("fp32", 0) not in again.runner.runs
    (cached,) = (tmp_path / ".cache" / "autotune" / "probes").glob("llama-*.json")
    entries = json.loads(cached.read_text())
    assert len(entries) == 4 and all(e["losses"] for e in entries.values())


def test_proxy_defaults_for_a_config_that_leaves_sizes_out() -> None:
    # no heads, KV heads or MLP width given: 4 heads, KV = heads, MLP 4x the width
    p = proxy_config({"model_type": "toy", "hidden_size": 32})
    assert (p["num_attention_heads"], p["num_key_value_heads"]) == (4, 4)
    assert p["intermediate_size"] == 256 and p["vocab_size"] == 512
    # a family is its model_type and its non-size keys, whatever the sizes
    assert model_family({"model_type": "toy", "hidden_size": 1}) == model_family(
        {"model_type": "toy", "hidden_size": 2, "vocab_size": 9, "head_dim": 3}
    )
    assert model_family({}).startswith("model-")
