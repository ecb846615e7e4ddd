"""The search strategy's pruning and ordering decisions (``autotune/strategy.py`` and the memory
orders it reads from the techniques, ``Knob.memory_order``), against oracles outside it: the
analytical estimator's device peaks for the memory orders, and plans worked out by hand on tiny
candidate sets (the ridge corrections themselves: ``tests/test_strategy_oracles.py``).

The decisions, each with a test here that fails when it is inverted, swapped or fed the wrong
quantity:

1. every monotone dimension's memory order: a later value never needs less device memory, at
   the same other choices (offloading to the host needs less; checkpointing less than none; a
   smaller micro-batch less);
2. an OOM prunes the configurations that need no less memory (the same but for monotone
   dimensions, each at least as hungry), and only them: never one that offloads what the OOM
   kept on the device, never one that differs in a non-monotone dimension;
3. an OOM the estimator predicted (never run) implies nothing about other configurations;
4. a failed configuration is never proposed again;
5. among candidates with a chance to fit: fewest loss-breaking or crashing choices first, then
   the best expected gain weighted by that chance; a candidate that cannot fit waits while
   another can; when none is near a chance to fit, the smallest predicted peak.
"""

from __future__ import annotations

from typing import Any

import pytest

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.gpus import gpu_spec
from autotune.estimator.workload import Workload
from autotune.models import resolve_model
from autotune.strategy import AutotuneSampler, Observation, needs_no_less_memory
from trials.techniques import TECHNIQUES

Config = dict[str, Any]
MODEL = resolve_model("llama-7b").config
#: per monotone dimension, a configuration under which its values change the device peak
WHERE = {
    "gradient_checkpointing": {"precision": "bf16"},
    "checkpoint_save": {"precision": "bf16", "gradient_checkpointing": "full"},
    "offload_optimizer": {"precision": "bf16", "zero_stage": 2},
    "offload_param": {"precision": "bf16", "zero_stage": 3, "offload_optimizer": "cpu"},
    "fsdp_offload": {"precision": "bf16", "fsdp": "full_shard"},
    "micro_batch_size": {"precision": "bf16"},
}


def _peak(config: Config) -> int:
    return (
        AnalyticalEstimator()
        .estimate(
            Workload(
                MODEL,
                seq_len_tokens=2048,
                global_batch_sequences=8,
                processes=2,
                gpu=gpu_spec("a100-80gb"),
            ),
            config,
        )
        .peak_bytes
    )


@pytest.mark.parametrize("dim", sorted(WHERE))
def test_memory_orders_agree_with_the_estimators_device_peaks(dim: str) -> None:
    """For each pair of values the estimator tells apart, the one the order puts first has the
    smaller predicted device peak."""
    order = TECHNIQUES.memory_orders()[dim]
    knob = TECHNIQUES.knob(dim)
    values = list(knob.choices) if knob and knob.choices else [1, 2, 4, 8]
    peaks = {v: _peak({**WHERE[dim], dim: v}) for v in values}
    compared = 0
    for a in values:
        for b in values:
            if peaks[a] < peaks[b]:
                assert order(a) < order(b), (dim, a, b, peaks)
                compared += 1
    assert compared >= 1, (dim, peaks)


def test_offloading_the_optimizer_needs_less_device_memory_by_hand() -> None:
    """ZeRO-Offload moves AdamW's two fp32 moments (8 bytes a parameter) and the fp32 master
    weights off the device: at least 8 bytes a parameter less on it, by hand."""
    n = 6_738_415_616  # llama-7b's parameters
    base = WHERE["offload_optimizer"]
    saved = _peak({**base, "offload_optimizer": "none"}) - _peak(
        {**base, "offload_optimizer": "cpu"}
    )
    assert saved >= 8 * n // 2  # two ranks: each holds half of ZeRO-2's partitioned states
    order = TECHNIQUES.memory_orders()["offload_optimizer"]
    assert order("cpu") < order("none")


def _sampler(rows: list[tuple[Config, float, float]], budget: float) -> AutotuneSampler:
    table = {repr(sorted(c.items())): (peak, speed) for c, peak, speed in rows}
    return AutotuneSampler(
        [c for c, _, _ in rows], lambda c: table[repr(sorted(c.items()))], budget
    )


NONE = {"zero_stage": 2, "offload_optimizer": "none", "precision": "bf16"}
OFF = {"zero_stage": 2, "offload_optimizer": "cpu", "precision": "bf16"}


def test_an_oom_without_offload_keeps_the_offloaded_configuration() -> None:
    """By hand: the offloaded configuration needs less device memory than the one that ran out
    of it: still to be tried. The other way round, the non-offloaded one is pruned."""
    assert not needs_no_less_memory(OFF, NONE)
    assert needs_no_less_memory(NONE, OFF)
    rows = [(NONE, 50.0, 2000.0), (OFF, 40.0, 1000.0)]
    sampler = _sampler(rows, 100.0)
    assert sampler.plan([Observation(NONE, "oom", 120.0, 0.0)]) == OFF
    assert sampler.plan([Observation(OFF, "oom", 120.0, 0.0)]) is None


def test_an_oom_prunes_larger_micro_batches_and_less_checkpointing_only() -> None:
    """By hand: after micro-batch 4 with full checkpointing runs out of memory, micro-batch 8
    (same checkpointing) and micro-batch 4 without checkpointing are pruned; micro-batch 2 and
    another optimizer (not a monotone dimension) are not."""
    oom = {"gradient_checkpointing": "full", "micro_batch_size": 4, "optimizer": "adamw"}
    assert needs_no_less_memory({**oom, "micro_batch_size": 8}, oom)
    assert needs_no_less_memory({**oom, "gradient_checkpointing": "off"}, oom)
    assert needs_no_less_memory({**oom, "gradient_checkpointing": "selective"}, oom)
    assert not needs_no_less_memory({**oom, "micro_batch_size": 2}, oom)
    assert not needs_no_less_memory({**oom, "optimizer": "adafactor"}, oom)
    assert not needs_no_less_memory({**oom, "zero_stage": 2}, oom)  # another set of dimensions
    rows = [
        (oom, 10.0, 5000.0),
        ({**oom, "micro_batch_size": 8}, 10.0, 4000.0),
        ({**oom, "gradient_checkpointing": "off"}, 10.0, 3000.0),
        ({**oom, "optimizer": "adafactor"}, 10.0, 2000.0),
        ({**oom, "micro_batch_size": 2}, 10.0, 1000.0),
    ]
    sampler = _sampler(rows, 100.0)
    history = [Observation(oom, "oom", 120.0, 0.0)]
    assert sampler.plan(history) == {**oom, "optimizer": "adafactor"}
    history.append(Observation({**oom, "optimizer": "adafactor"}, "ok", 50.0, 2000.0))
    assert sampler.plan(history) == {**oom, "micro_batch_size": 2}


def test_a_predicted_oom_implies_nothing_about_other_configurations() -> None:
    """By hand: the offloaded configuration predicted out of memory (never run) is not tried,
    but the non-offloaded one, which a measured OOM of it would prune, still is."""
    sampler = _sampler([(OFF, 50.0, 2000.0), (NONE, 60.0, 1000.0)], 100.0)
    assert sampler.plan([Observation(OFF, "predicted_oom", 120.0, 0.0)]) == NONE
    assert sampler.plan([Observation(OFF, "oom", 120.0, 0.0)]) is None


def test_a_failed_configuration_is_never_proposed_again() -> None:
    rows = [(NONE, 50.0, 2000.0), (OFF, 40.0, 1000.0)]
    sampler = _sampler(rows, 100.0)
    assert sampler.plan([]) == NONE
    assert sampler.plan([Observation(NONE, "failed", 0.0, 0.0)]) == OFF
    # both failed: nothing is left to measure (not the one a crash model blames least)
    both = [Observation(NONE, "failed", 0.0, 0.0), Observation(OFF, "failed", 0.0, 0.0)]
    assert sampler.plan(both) is None


def test_a_configuration_that_cannot_fit_waits_and_the_smallest_peak_when_none_fits() -> None:
    """By hand: predicted (peak, speed) A (90, 1000), B (10,000, 5000: a hundred times the
    budget of 100, its chance to fit nil at any spread the peak's prior allows), C (60, 800).
    B is never proposed while A or C can fit, however fast it is predicted; once A is measured,
    C; with a budget of 10 (C six times over it: no candidate near a 20% chance) the smallest
    predicted peak, C."""
    a = {"micro_batch_size": 4, "gradient_checkpointing": "off"}
    b = {"micro_batch_size": 8, "gradient_checkpointing": "off"}
    c = {"micro_batch_size": 2, "gradient_checkpointing": "off"}
    rows = [(a, 90.0, 1000.0), (b, 10_000.0, 5000.0), (c, 60.0, 800.0)]
    assert _sampler(rows, 100.0).plan([]) in (a, c)
    assert _sampler(rows, 100.0).plan([Observation(a, "ok", 90.0, 1000.0)]) == c
    assert _sampler(rows, 100.0).plan([Observation(c, "ok", 60.0, 800.0)]) == a
    assert _sampler(rows, 10.0).plan([]) == c
