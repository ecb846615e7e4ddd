"""The loss guard on real training: the proxy probe of lossy numerics (several seeds, a noise band,
cached per model family), the exact check against the reference, the least-memory exact
reference queued once per study, and the fidelity restriction of the search."""

from __future__ import annotations

import statistics
from pathlib import Path

import optuna
import pytest

from autotune.availability import Hardware
from autotune.lossguard import (
    EXACT_RTOL,
    LossVerdict,
    Prober,
    ProbeSettings,
    judge,
    model_family,
    proxy_config,
)
from autotune.models import MODELS
from autotune.runner import SubprocessRunner, TrialRunner
from autotune.space import SearchSpace
from autotune.study import ensure_reference, least_memory_exact, no_reference_why, settings_of
from tests.conftest import cli, tiny_spec
from tests.studies import make_study
from trials.job import run_trial
from trials.spec import TrialResult, TrialSpec
from trials.techniques import classes_up_to, fidelity_class, numerics_of

STEPS = 30


class InProcessRunner(TrialRunner):
    """The real trial job, run in this process (no subprocess start-up), counting its runs."""

    def __init__(self) -> None:
        self.specs: list[TrialSpec] = []

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        self.specs.append(spec)
        return run_trial(spec)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path))
    return tmp_path


def _prober(runner: TrialRunner, model: str = "tiny-llama", steps: int = STEPS) -> Prober:
    return Prober(MODELS[model].config, ProbeSettings(steps, 2, 3e-3, "cpu"), runner)


@pytest.mark.real_trial
def test_probe_verdict_is_the_seed_paired_final_loss_difference(cache: Path) -> None:
    runner = InProcessRunner()
    verdict = _prober(runner).judge({"precision": "bf16", "optimizer": "lion"}, tolerance=0.02)
    assert verdict.via == "probe" and verdict.tolerance == 0.02
    # 2 seeds x (fp32 AdamW, bf16 Lion) on the proxy, nothing at full size
    assert len(runner.specs) == 4
    assert {s.model_config["hidden_size"] for s in runner.specs} == {64}
    assert {s.measured_steps for s in runner.specs} == {STEPS}
    # the oracle: the same proxy trained here by hand, the last 5 steps' mean loss per seed
    proxy = proxy_config(MODELS["tiny-llama"].config)

    def final(config: dict[str, str], seed: int) -> float:
        spec = TrialSpec(
            model_config=proxy,
            config={**config, "attention": "sdpa", "micro_batch_size": 8},
            seq_len=32,
            global_batch_size=8,
            warmup_steps=0,
            measured_steps=STEPS,
            seed=seed,
            lr=3e-3,
        )
        return statistics.fmean(run_trial(spec).losses[-5:])

    plain = {"precision": "fp32", "optimizer": "adamw", "quantization": "none"}
    lossy = {"precision": "bf16", "optimizer": "lion", "quantization": "none"}
    refs = [final(plain, s) for s in (0, 1)]
    diffs = [(final(lossy, s) - r) / r for s, r in zip((0, 1), refs, strict=True)]
    assert verdict.regression == pytest.approx(statistics.fmean(diffs), rel=1e-6)
    assert verdict.noise == pytest.approx(abs(refs[0] - refs[1]) / statistics.fmean(refs))
    assert verdict.noise > 0  # two seeds really differ: that is the band
    assert verdict.ok == (verdict.regression <= 0.02)


@pytest.mark.real_trial
def test_probes_are_cached_per_family(cache: Path) -> None:
    first = InProcessRunner()
    a = _prober(first).judge({"precision": "bf16"}, 0.02)
    again = InProcessRunner()
    b = _prober(again, "small-llama").judge({"precision": "bf16"}, 0.02)  # same family
    assert len(first.specs) == 4 and again.specs == []
    assert a == b
    # another combination of numerics reuses the fp32 AdamW curves: 2 new runs, not 4
    _prober(again).judge({"precision": "bf16", "optimizer": "adafactor"}, 0.02)
    assert len(again.specs) == 2
    # non-numerics choices share the probe
    assert _prober(again).judge({"precision": "bf16", "zero_stage": 2}, 0.02) == a
    assert len(again.specs) == 2
    assert model_family(MODELS["tiny-llama"].config) == model_family(MODELS["llama-7b"].config)


def test_a_failed_probe_is_not_cached(cache: Path, tmp_path: Path) -> None:
    """A probe that fails (here a real time limit: the job cannot start in 0.5 s) says why and is
    not cached: a later run probes again instead of saying "no probe" for good."""
    plain = numerics_of({})
    slow = SubprocessRunner(tmp_path / "runs", timeout_s=0.5)
    failed, why = _prober(slow, steps=3).curve(plain, 0)
    assert failed is None and "timed out" in why
    again = InProcessRunner()
    losses, why = _prober(again, steps=3).curve(plain, 0)
    assert losses and why == "" and len(again.specs) == 1
    assert _prober(InProcessRunner(), steps=3).curve(plain, 0) == (losses, "")  # now cached


@pytest.mark.real_trial
def test_exact_configurations_are_checked_against_the_reference() -> None:
    base = run_trial(tiny_spec({"gradient_checkpointing": "full"}, warmup_steps=1))
    other = run_trial(tiny_spec({"micro_batch_size": 2}, warmup_steps=1))
    bf16 = run_trial(tiny_spec({"precision": "bf16"}, warmup_steps=1))
    lion = run_trial(tiny_spec({"optimizer": "lion"}, warmup_steps=1))
    kw = {"no_reference_why": "", "prober": None, "no_probe_why": "off", "tolerance": 0.02}
    exact = judge(
        {"micro_batch_size": 2}, other.losses, is_reference=False, reference=base.losses, **kw
    )
    assert exact.via == "reference" and exact.ok and exact.tolerance == EXACT_RTOL
    worst = max(abs(a - b) / b for a, b in zip(other.losses, base.losses, strict=True))
    assert exact.regression == pytest.approx(worst)
    # another update rule's curve, passed off as exact, is caught (bf16 over 3 steps is not:
    # it stays within 1e-3 here, which is why lossy numerics go to the longer probe)
    caught = judge({}, lion.losses, is_reference=False, reference=base.losses, **kw)
    assert caught.ok is False and caught.regression is not None
    assert caught.regression > EXACT_RTOL
    # a lossy config without a probe gets no verdict, and says why; adapters are never compared
    lossy = judge({"precision": "bf16"}, bf16.losses, is_reference=False, reference=None, **kw)
    assert (lossy.via, lossy.ok, lossy.note) == ("none", None, "mixed; no loss probe: off")
    lora = judge({"quantization": "nf4"}, [], is_reference=False, reference=None, **kw)
    assert lora.via == "none" and "different problem" in lora.note


@pytest.mark.real_trial
def test_reference_is_the_least_memory_exact_configuration(tmp_path: Path) -> None:
    space = SearchSpace.from_dict(
        {
            "dimensions": {
                "gradient_checkpointing": {"choices": ["off", "full"]},
                "precision": {"choices": ["bf16", "fp32"]},
                "micro_batch_size": {"choices": [8, 2]},
            }
        }
    ).resolve(8, Hardware(backend="cpu"))
    spaced = tmp_path / "space.yaml"
    import yaml

    spaced.write_text(yaml.safe_dump(space.as_dict()))
    study = make_study(f"sqlite:///{tmp_path / 'db.sqlite'}", "ref", spaced, budget="1GB")
    chosen = least_memory_exact(space, settings_of(study))
    assert fidelity_class(chosen) == "exact"
    # the oracle: every exact configuration of the space, trained and measured for real
    peaks = {}
    for config in space.restrict(("exact",)).grid():
        result = run_trial(tiny_spec(config, warmup_steps=2, measured_steps=1))
        peaks[tuple(sorted(config.items()))] = result.peak_bytes
    assert peaks[tuple(sorted(chosen.items()))] == min(peaks.values())


def test_reference_is_queued_once_even_when_it_failed(tmp_path: Path) -> None:
    from tests.conftest import DATA

    study = make_study(f"sqlite:///{tmp_path / 'db.sqlite'}", "once", DATA / "tiny_space.yaml")
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    ensure_reference(study, space)
    ensure_reference(study, space)
    (queued,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert queued.user_attrs["role"] == "reference"
    trial = study.ask()  # the reference crashes (a real FAIL)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    ensure_reference(study, space)  # a later `run`: not queued again
    assert not study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert "reference_config" in study.user_attrs


def test_a_space_without_an_exact_configuration_has_no_reference(tmp_path: Path) -> None:
    """A bf16-only space (as scripts/gpu_acceptance.sh searches) has nothing exact to train as
    the reference: no reference is queued, the run goes on, and the verdicts say why."""
    path = tmp_path / "bf16.yaml"
    path.write_text(
        "dimensions:\n  gradient_checkpointing:\n    choices: [full]\n"
        "  precision:\n    choices: [bf16]\n  micro_batch_size:\n    choices: [8]\n"
    )
    study = make_study(f"sqlite:///{tmp_path / 'db.sqlite'}", "bf16", path)
    space = SearchSpace.from_dict(settings_of(study).space, "study")
    assert not space.has_exact()
    ensure_reference(study, space)
    assert not study.get_trials(deepcopy=False)
    assert "no exact configuration" in no_reference_why(study)
    # the tiny space has fp32: an exact reference exists there
    from tests.conftest import DATA

    assert SearchSpace.load(DATA / "tiny_space.yaml").has_exact()


@pytest.mark.real_trial
def test_allow_restricts_the_searched_classes() -> None:
    gpu = Hardware("cuda", (9, 0), 1, has_flash_attn=True, has_bitsandbytes=True, has_peft=True)
    space = SearchSpace.load()
    # a global batch of 2 (micro-batches 1 and 2): the classes do not depend on the batch, and
    # the GPU grid at 16 is about a million configurations (minutes to enumerate four times)
    gbs = 2
    default = space.resolve(gbs, gpu, classes_up_to("other_optimizer"))
    classes = {fidelity_class(c) for c in default.grid()}
    assert classes == {"exact", "mixed", "reduced_state", "other_optimizer"}
    assert any("quantization=nf4: fidelity class adapters" in d for d in default.dropped)
    mixed = space.resolve(gbs, gpu, classes_up_to("mixed"))
    assert {fidelity_class(c) for c in mixed.grid()} == {"exact", "mixed"}
    assert {fidelity_class(c) for c in space.resolve(gbs, gpu, ("exact",)).grid()} == {"exact"}
    everything = space.resolve(gbs, gpu, classes_up_to("adapters"))
    assert "adapters" in {fidelity_class(c) for c in everything.grid()}


def test_allow_is_validated_and_stored(in_tmp: Path) -> None:
    bad = cli("run", "--model", "tiny-llama", "--budget", "150MB", "--allow", "lora")
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert not (in_tmp / "autotune.db").exists()


def test_verdict_round_trips_through_attrs() -> None:
    v = LossVerdict("probe", True, 0.01, 0.02, 0.003, "proxy")
    assert LossVerdict.from_attrs(v.to_attrs()) == v
    assert LossVerdict.from_attrs(None) is None
