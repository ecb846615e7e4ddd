"""The estimate backend's decisions (``autotune/estimator/prediction_runners.py``,
``exhaustive.py`` and ``autotune/estimate_backend.py``): which predictions fit, which trials
the GPU pre-screen skips, which configuration each class names. The predicted bytes come from
the analytical estimator; what is decided here is the comparison, and each test places the
budgets by hand between the device and the host figure so that the wrong one gives the other
answer.

The decisions, each with a test here that fails when it is inverted, swapped or fed the wrong
quantity:

1. a prediction is an ``oom`` when its device peak is over the device budget, or its host
   memory (not its device peak) over ``--host-memory``; at the budget it fits; the device is
   named first when both are over;
2. an ``ok`` prediction carries the predicted tokens/s, an ``oom`` none;
3. the pre-screen skips a trial only beyond the budget plus its margin, on the device or the
   host, and marks it pruned by the estimate; within the margin the real runner runs it;
4. scoring a space: a configuration fits both memories, or says which it is over (device first);
5. each fidelity class's best: the fastest that fits (least device memory among equal speeds),
   its ties within the speed model's error; the headline is the faster of the exact and mixed
   bests;
6. ``--host-memory`` by default: on the estimate backend the target GPU's server's system memory
   where its machine row gives one (unlimited where not), this machine's on the others.
"""

from __future__ import annotations

from typing import Any

from autotune.estimate_backend import host_budget, machine_memory
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import Estimate
from autotune.estimator.exhaustive import Scored, best_per_class, headline, score
from autotune.estimator.gpus import gpu_spec
from autotune.estimator.prediction_runners import PRUNED, EstimateRunner, PrescreenRunner
from autotune.estimator.workload import Workload
from autotune.models import resolve_model
from autotune.runner import TrialRunner
from trials.spec import TrialResult, TrialSpec

MODEL = resolve_model("llama-7b").config
N_PARAMS = 6_738_415_616
GPU = gpu_spec("a100-80gb")
#: offloaded: the host holds more than the device; not offloaded: the device more than the host
OFFLOADED = {
    "precision": "bf16",
    "zero_stage": 2,
    "offload_optimizer": "cpu",
    "micro_batch_size": 1,
}
ON_DEVICE = {"precision": "bf16", "zero_stage": 2, "micro_batch_size": 1}


def _spec(config: dict[str, Any], budget: int | None = None, host: int | None = None) -> TrialSpec:
    return TrialSpec(
        model_config=MODEL,
        config=config,
        seq_len=512,
        global_batch_size=1,
        budget_bytes=budget,
        host_budget_bytes=host,
    )


def _predict(config: dict[str, Any]) -> Estimate:
    return AnalyticalEstimator().estimate(
        Workload(MODEL, seq_len_tokens=512, global_batch_sequences=1, processes=1, gpu=GPU), config
    )


def test_the_two_figures_are_apart() -> None:
    """By hand: ZeRO-Offload keeps the fp32 master weights, the two Adam moments and the fp32
    gradients on the host, at least 16 bytes a parameter; the device keeps the 16-bit weights
    (2 bytes a parameter) and less than the host. Without offload it is the other way round."""
    off, dev = _predict(OFFLOADED), _predict(ON_DEVICE)
    assert off.host_bytes >= 16 * N_PARAMS > off.peak_bytes >= 2 * N_PARAMS
    assert dev.peak_bytes > dev.host_bytes


def test_host_memory_is_compared_with_the_predicted_host_bytes() -> None:
    runner = EstimateRunner(AnalyticalEstimator(), GPU)
    off, dev = _predict(OFFLOADED), _predict(ON_DEVICE)
    # offloaded: a host budget above the device peak but below the host bytes is exceeded
    host = (off.peak_bytes + off.host_bytes) // 2
    over = runner.run(_spec(OFFLOADED, host=host), "t")
    assert over.status == "oom" and "host memory" in over.error and over.tokens_per_s == 0.0
    assert runner.run(_spec(OFFLOADED, host=off.host_bytes), "t").status == "ok"
    # not offloaded: a host budget below the device peak but above the host bytes fits
    host = (dev.peak_bytes + dev.host_bytes) // 2
    fits = runner.run(_spec(ON_DEVICE, host=host), "t")
    assert fits.status == "ok" and fits.tokens_per_s == dev.tokens_per_s > 0
    assert fits.host_peak_bytes == dev.host_bytes
    assert runner.run(_spec(ON_DEVICE, host=dev.host_bytes - 1), "t").status == "oom"


def test_the_device_budget_at_and_over_the_peak_and_named_first() -> None:
    runner = EstimateRunner(AnalyticalEstimator(), GPU)
    dev = _predict(ON_DEVICE)
    assert runner.run(_spec(ON_DEVICE, budget=dev.peak_bytes), "t").status == "ok"
    over = runner.run(_spec(ON_DEVICE, budget=dev.peak_bytes - 1), "t")
    assert over.status == "oom" and "over the budget" in over.error
    both = runner.run(_spec(ON_DEVICE, budget=dev.peak_bytes - 1, host=1), "t")
    assert "over the budget" in both.error and "host" not in both.error


class _Ran(TrialRunner):
    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, spec: TrialSpec, name: str) -> TrialResult:
        self.ran.append(name)
        return TrialResult(status="ok", peak_bytes=1, tokens_per_s=1.0)


def test_the_prescreen_skips_only_beyond_the_margin_on_device_or_host() -> None:
    """By hand, margin 25%: a budget of peak / 1.2 is within it (runs), peak / 1.3 beyond it
    (skipped); the same for the host against the host bytes, not the device peak."""
    inner = _Ran()
    screen = PrescreenRunner(inner, AnalyticalEstimator(), 0.25)
    cpu = AnalyticalEstimator().estimate(
        Workload(MODEL, seq_len_tokens=512, global_batch_sequences=1), ON_DEVICE
    )
    assert screen.run(_spec(ON_DEVICE, budget=int(cpu.peak_bytes / 1.2)), "a").status == "ok"
    skipped = screen.run(_spec(ON_DEVICE, budget=int(cpu.peak_bytes / 1.3)), "b")
    assert skipped.status == "oom" and skipped.error.startswith(PRUNED)
    assert screen.attrs_for(skipped) == {"pruned_by_estimate": True, "predicted": True}
    off = AnalyticalEstimator().estimate(
        Workload(MODEL, seq_len_tokens=512, global_batch_sequences=1), OFFLOADED
    )
    assert screen.run(_spec(OFFLOADED, host=int(off.host_bytes / 1.2)), "c").status == "ok"
    host_skip = screen.run(_spec(OFFLOADED, host=int(off.host_bytes / 1.3)), "d")
    assert host_skip.status == "oom" and "host memory" in host_skip.error
    # a host budget between the device peak and the host bytes (beyond the margin of neither
    # if compared with the device peak) still skips the offloaded run
    assert off.peak_bytes * 1.25 < off.host_bytes / 1.3
    assert inner.ran == ["a", "c"]


def test_scoring_says_which_memory_is_over() -> None:
    off, dev = _predict(OFFLOADED), _predict(ON_DEVICE)
    host = (off.peak_bytes + off.host_bytes) // 2
    assert dev.host_bytes < host < dev.peak_bytes
    scored = score(
        Workload(MODEL, seq_len_tokens=512, global_batch_sequences=1, processes=1, gpu=GPU),
        [OFFLOADED, ON_DEVICE],
        budget_bytes=dev.peak_bytes,
        host_budget_bytes=host,
    )
    assert [(s.fits, s.why_not) for s in scored] == [(False, "host memory"), (True, "")]
    tight = score(
        Workload(MODEL, seq_len_tokens=512, global_batch_sequences=1, processes=1, gpu=GPU),
        [OFFLOADED, ON_DEVICE],
        budget_bytes=off.peak_bytes - 1,
        host_budget_bytes=1,
    )
    assert [s.why_not for s in tight] == ["device memory", "device memory"]


def _scored(config: dict[str, Any], tps: float, peak: int, fits: bool = True) -> Scored:
    return Scored(config, Estimate(peak, {}, tokens_per_s=tps), fits)


def test_each_class_names_its_fastest_fit_then_least_memory_and_its_ties() -> None:
    """By hand: exact A 1000 (peak 5), B 1000 (peak 3), C 950 (5% slower: a tie within 6%),
    D 900 (10%: no tie), E 2000 that does not fit; mixed F 1100. The exact best is B; the
    headline is the faster of exact and mixed: F."""
    a = _scored({"gradient_checkpointing": "full"}, 1000.0, 5)
    b = _scored({"zero_stage": 2}, 1000.0, 3)
    c = _scored({"zero_stage": 1}, 950.0, 1)
    d = _scored({"zero_stage": 3}, 900.0, 1)
    e = _scored({"micro_batch_size": 8}, 2000.0, 1, fits=False)
    f = _scored({"precision": "bf16"}, 1100.0, 9)
    per = best_per_class([a, b, c, d, e, f])
    assert per["exact"].best is b and per["exact"].ties == [a, c]
    assert per["mixed"].best is f
    top = headline(per)
    assert top is not None and top.best is f
    slow = _scored({"precision": "bf16"}, 500.0, 9)
    top = headline(best_per_class([a, slow]))
    assert top is not None and top.best is a


def test_host_memory_default_per_backend() -> None:
    assert host_budget(None, "estimate") is None
    assert host_budget(None, "cpu") == machine_memory() > 0
    assert host_budget("64GB", "estimate") == 64 * 10**9
    # the target's server: NVIDIA's DGX H100 datasheet, "System Memory 2TB" (32 x 64 GiB DIMMs);
    # the DGX A100 320GB's 1 TB; a PCIe desktop card's box is its owner's choice: unlimited
    assert host_budget(None, "estimate", gpu_spec("h100")) == 2 * 2**40
    assert host_budget(None, "estimate", gpu_spec("a100-40gb")) == 2**40
    assert host_budget(None, "estimate", gpu_spec("rtx4090")) is None
    assert host_budget("64GB", "estimate", gpu_spec("h100")) == 64 * 10**9  # the user's wins
