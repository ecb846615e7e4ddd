"""The loss guard's probe cache and the selector's class answers, pinned to values worked out by
hand: what the probe cache stores on disk and under which key (read back by a second Prober),
the per-probe lock (real threads: one key serializes, two keys run side by side), the family
digest hashed here by hand, the proxy's defaults, a failed probe's message, and the selector's
counts, closest miss and load warning on trial records written by hand."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune import lossguard
from autotune.lossguard import Prober, ProbeSettings, model_family, proxy_config
from autotune.runner import TrialRunner
from autotune.selector import class_summary, rows_of, select, verdict_text
from tests.studies import records_study
from trials.spec import TrialResult, TrialSpec

#: a family of its own: its non-size keys are model_type and hidden_act
TOY = {"model_type": "toy", "hidden_size": 32, "hidden_act": "silu"}
#: sha256 of '{"hidden_act": "silu", "model_type": "toy"}', worked out by hand
TOY_FAMILY = "toy-" + hashlib.sha256(b'{"hidden_act": "silu", "model_type": "toy"}').hexdigest()[:6]
SETTINGS = ProbeSettings(50, 2, 3e-3, "cpu")
PLAIN = {"precision": "fp32", "optimizer": "adamw"}
WAIT_S = 3.0  # how long a thread waits for the other before concluding it is blocked


def _curve(final: float) -> list[float]:
    return [5.0] * 45 + [final] * 5  # 50 steps: the final window is the last 5


class Scripted(TrialRunner):
    """Returns a result per (precision, seed); records every name and spec it was asked to run."""

    def __init__(self, results: dict[tuple[str, int], TrialResult]) -> None:
        self.results = results
        self.calls: list[tuple[str, TrialSpec]] = []

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        self.calls.append((name, spec))
        return self.results[(str(spec.config["precision"]), spec.seed)]


def _ok(final: float) -> TrialResult:
    return TrialResult(status="ok", losses=_curve(final))


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The probe cache folder of this test; the per-probe locks start empty."""
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(lossguard, "_PROBE_LOCKS", {})
    return tmp_path / "probes"


def _prober(runner: TrialRunner) -> Prober:
    return Prober(TOY, SETTINGS, runner)


# --- the cache on disk ----------------------------------------------------------------------


def test_the_cache_file_is_keyed_by_sorted_choices_steps_lr_seed_and_backend(cache: Path) -> None:
    runner = Scripted({("bf16", 1): _ok(2.5)})
    losses, why = _prober(runner).curve({"precision": "bf16", "optimizer": "lion"}, 1)
    assert (losses, why) == (_curve(2.5), "")
    key = "optimizer=lion,precision=bf16|steps=50|lr=0.003|seed=1|cpu"
    stored = json.loads((cache / f"{TOY_FAMILY}.json").read_text())
    assert stored == {key: {"losses": _curve(2.5)}}
    # the job's name is derived from the same key
    ((name, _),) = runner.calls
    assert name == "probe-" + hashlib.sha256(key.encode()).hexdigest()[:10]
    # a second Prober reads it back instead of running it
    again = Scripted({})
    assert _prober(again).curve({"optimizer": "lion", "precision": "bf16"}, 1) == (_curve(2.5), "")
    assert again.calls == []


def test_a_cache_file_that_is_not_a_mapping_is_read_as_empty_and_replaced(cache: Path) -> None:
    cache.mkdir(parents=True)
    (cache / f"{TOY_FAMILY}.json").write_text("[1, 2]")
    runner = Scripted({("fp32", 0): _ok(2.0)})
    assert _prober(runner).curve(PLAIN, 0) == (_curve(2.0), "")
    assert len(runner.calls) == 1
    stored = json.loads((cache / f"{TOY_FAMILY}.json").read_text())
    assert stored == {
        "optimizer=adamw,precision=fp32|steps=50|lr=0.003|seed=0|cpu": {"losses": _curve(2.0)}
    }


def test_a_store_cut_before_the_rename_leaves_the_cache_whole_and_a_tmp_beside_it(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new cache is written to a ``*.tmp`` file in the cache folder (same filesystem: the
    rename is atomic) and renamed over the old one; cut before the rename, the old file is intact
    and the partial write is a .tmp next to it, nothing in the system's temp folder."""
    elsewhere = tmp_path / "systmp"
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    runner = Scripted({("fp32", 0): _ok(2.0), ("fp32", 1): _ok(2.2)})
    _prober(runner).curve(PLAIN, 0)
    path = cache / f"{TOY_FAMILY}.json"
    before = path.read_text()

    def cut(src: str, dst: str) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(OSError, match="power cut"):
        _prober(runner).curve(PLAIN, 1)
    monkeypatch.undo()
    assert path.read_text() == before
    (tmp,) = [p for p in cache.iterdir() if p != path]
    assert tmp.name.endswith(".tmp") and tmp.name != ".tmp"
    assert len(json.loads(tmp.read_text())) == 2  # the merge of the old entry and the new one
    assert list(elsewhere.iterdir()) == []


# --- a failed probe ----------------------------------------------------------------------------


def test_an_ok_probe_without_losses_or_a_failed_one_with_losses_is_not_a_curve(
    cache: Path,
) -> None:
    runner = Scripted(
        {
            ("fp32", 0): TrialResult(status="ok", losses=[], error=""),
            ("fp32", 1): TrialResult(status="failed", losses=[2.0, 1.9], error="lost job"),
        }
    )
    assert _prober(runner).curve(PLAIN, 0) == (None, "ok: ")
    assert _prober(runner).curve(PLAIN, 1) == (None, "failed: lost job")
    assert not (cache / f"{TOY_FAMILY}.json").exists()  # nothing cached: both run again
    _prober(runner).curve(PLAIN, 0)
    assert len(runner.calls) == 3


def test_a_failed_probe_message_is_cut_at_300_characters(cache: Path) -> None:
    runner = Scripted({("fp32", 0): TrialResult(status="failed", error="x" * 500)})
    losses, why = _prober(runner).curve(PLAIN, 0)
    assert losses is None
    assert why == "failed: " + "x" * 292 and len(why) == 300


# --- the per-probe lock, with real threads -------------------------------------------------------


def test_two_trials_needing_the_same_probe_run_it_once(cache: Path) -> None:
    entered, release = threading.Event(), threading.Event()
    runs: list[int] = []

    class Slow(TrialRunner):
        def run(self, spec: TrialSpec, name: str) -> TrialResult:
            runs.append(spec.seed)
            entered.set()
            release.wait(WAIT_S)
            return _ok(2.0)

    results: list[Any] = []

    def probe() -> None:
        results.append(_prober(Slow()).curve(PLAIN, 0))

    first = threading.Thread(target=probe)
    first.start()
    assert entered.wait(WAIT_S)
    second = threading.Thread(target=probe)
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the first one's probe
    release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert runs == [0]  # the second read the first one's curve from the cache
    assert results == [(_curve(2.0), ""), (_curve(2.0), "")]


def test_two_different_probes_do_not_wait_for_each_other(cache: Path) -> None:
    """Seed 0 and seed 1 are two keys: each probe waits inside its run for the other to start,
    which only happens when they do not share a lock."""
    started = {0: threading.Event(), 1: threading.Event()}
    met: dict[int, bool] = {}

    class Meeting(TrialRunner):
        def run(self, spec: TrialSpec, name: str) -> TrialResult:
            started[spec.seed].set()
            met[spec.seed] = started[1 - spec.seed].wait(WAIT_S)
            return _ok(2.0 + spec.seed)

    results: dict[int, Any] = {}

    def probe(seed: int) -> None:
        results[seed] = _prober(Meeting()).curve(PLAIN, seed)

    threads = [threading.Thread(target=probe, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT_S + 1)
    assert met == {0: True, 1: True}
    assert results == {0: (_curve(2.0), ""), 1: (_curve(3.0), "")}


# --- the verdict's note, the family digest, the proxy's defaults -----------------------------


def test_the_noise_note_in_full(cache: Path) -> None:
    # references 2.0 and 2.2: noise 0.2 / 2.1 > 0.03
    runner = Scripted(
        {("fp32", 0): _ok(2.0), ("fp32", 1): _ok(2.2), ("bf16", 0): _ok(2.1), ("bf16", 1): _ok(2.2)}
    )
    v = _prober(runner).judge({"precision": "bf16"}, tolerance=0.03)
    assert v.note == (
        f"proxy {TOY_FAMILY} 2x64, 50 steps x 2 seeds; the noise band is wider than the "
        "tolerance: more --probe-steps"
    )


def test_the_family_digest_sorts_nested_keys() -> None:
    config = {
        "model_type": "toy",
        "hidden_size": 8,
        "rope_scaling": {"type": "linear", "factor": 2},
    }
    text = '{"model_type": "toy", "rope_scaling": {"factor": 2, "type": "linear"}}'
    assert model_family(config) == "toy-" + hashlib.sha256(text.encode()).hexdigest()[:6]
    reordered = {**config, "rope_scaling": {"factor": 2, "type": "linear"}}
    assert model_family(reordered) == model_family(config)


def test_proxy_without_any_width_takes_four_times_one() -> None:
    # no hidden_size, no intermediate_size: the ratio is 4 x 1 / 1 = 4, so 64 x 4
    assert proxy_config({"model_type": "toy"})["intermediate_size"] == 256
    # an MLP width without a model width: 8 / 1 = 8, so 64 x 8
    assert proxy_config({"model_type": "toy", "intermediate_size": 8})["intermediate_size"] == 512


def test_proxy_drops_the_head_dim() -> None:
    p = proxy_config({"model_type": "toy", "hidden_size": 32, "head_dim": 8})
    assert "head_dim" not in p
    assert (p["hidden_size"], p["num_attention_heads"]) == (64, 4)


# --- the selector on hand-written records ------------------------------------------------------

MB = 2**20


def _study(tmp_path: Path, trials: list[dict[str, Any]], allow: str = "adapters") -> optuna.Study:
    study = records_study(f"sqlite:///{tmp_path / 'db.sqlite'}", "x", 100 * MB, "100MB", allow)
    for attrs in trials:
        state = attrs.pop("state", TrialState.COMPLETE)
        values = [1.0, 1.0] if state == TrialState.COMPLETE else None
        study.add_trial(optuna.trial.create_trial(state=state, values=values, user_attrs=attrs))
    return study


REGRESSED = {"via": "probe", "ok": False, "regression": 0.2, "tolerance": 0.02}


def test_over_budget_regressions_are_not_counted_as_fitting(tmp_path: Path) -> None:
    # one trial ran, regressed, and needs 400 MB of a 100 MB budget: it does not fit
    study = _study(
        tmp_path,
        [{"status": "ok", "peak_bytes": 400 * MB, "tokens_per_s": 9.0, "loss_verdict": REGRESSED}],
    )
    sel = select(study)
    full = sel.classes["full"]
    assert (full.group, full.tried, full.regressed) == ("full", 1, 0)
    assert [c.group for c in sel.classes.values()] == [
        "full",
        "reduced_state",
        "other_optimizer",
        "adapters",
    ]
    assert class_summary(sel, str)[0] == (
        "full training, exact or mixed precision: 1 tried, none fits 100 MiB"
    )


def test_an_oom_alone_is_tried_and_the_closest_miss(tmp_path: Path) -> None:
    study = _study(tmp_path, [{"status": "oom", "peak_bytes": 150 * MB}], allow="mixed")
    sel = select(study)
    assert sel.winner is None
    assert sel.closest is not None and sel.closest.number == 0
    lines = class_summary(sel, str)
    assert lines == [
        "full training, exact or mixed precision: 1 tried, none fits 100 MiB",
        "if you accept 8-bit optimizer state: not searched (--allow reduced_state includes it)",
        "if you accept another optimizer (Adafactor, Lion): not searched "
        "(--allow other_optimizer includes it)",
        "with LoRA adapters on a frozen base: not searched (--allow adapters includes it)",
    ]


def test_only_a_trial_that_ran_to_the_end_carries_a_verdict(tmp_path: Path) -> None:
    """A stored verdict on a trial that did not end ok (an oom, a controller that died after
    storing it) is not read: the row has no verdict and no loss_ok."""
    study = _study(
        tmp_path,
        [
            {"status": "oom", "peak_bytes": 150 * MB, "loss_verdict": REGRESSED},
            {
                "state": TrialState.FAIL,
                "status": "ok",
                "peak_bytes": 50 * MB,
                "loss_verdict": REGRESSED,
            },
        ],
    )
    oom, died = rows_of(study)
    for row in (oom, died):
        assert (row.verdict, row.loss_ok, row.loss_regression, row.loss_tolerance) == (
            None,
            None,
            None,
            None,
        )
        assert verdict_text(row) == "no verdict (did not run to the end)"
    assert died.status == "failed"


def test_the_selection_carries_a_loaded_machine_warning(tmp_path: Path) -> None:
    trials = [
        {"status": "ok", "peak_bytes": 10 * MB, "tokens_per_s": 10.0, "load_per_core": 2.0},
        {"status": "ok", "peak_bytes": 20 * MB, "tokens_per_s": 11.0, "load_per_core": 2.0},
    ]
    assert select(_study(tmp_path, trials)).load_warning == (
        "the machine was loaded while measuring (load 2.0 per core, median step-time spread "
        "0%): speed differences within the noise are reported as ties"
    )
