"""The host-memory frontier: the best full training at each host memory size where it changes,
in the estimate backend's answer (console and ``show --json``), limited by ``--host-memory``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from autotune.estimator.base import Estimate
from autotune.estimator.exhaustive import (
    Scored,
    best_per_class,
    headline,
    host_frontier,
    host_size_gb,
)
from autotune.estimator.speed import MODEL_ERROR
from tests.conftest import cli

GB = 10**9


def scored(host_gb: float, tps: float, fits: bool = True, **config: object) -> Scored:
    est = Estimate(10, {}, tokens_per_s=tps, host_breakdown={"offloaded states": int(host_gb * GB)})
    why = "" if fits else "host memory"
    return Scored({"precision": "bf16", **config}, est, fits, why)


def test_machine_sizes() -> None:
    assert host_size_gb(0) == 16
    assert host_size_gb(64 * GB) == 64 and host_size_gb(64 * GB + 1) == 128
    assert host_size_gb(170 * GB) == 192
    assert host_size_gb(5000 * GB + 1) == 5001  # past the table: whole GB


def test_frontier_keeps_each_size_where_the_best_gets_faster() -> None:
    rows = [
        scored(40, 1000),  # 64 GB
        scored(60, 1030),  # 64 GB: faster, same size: it is the 64 GB answer
        scored(100, 1050),  # 128 GB: within 6% of 1030: no change
        scored(150, 2000),  # 192 GB: faster
        scored(200, 1500),  # 256 GB: slower than what 192 GB already buys
        scored(300, 2500),  # 384 GB
        scored(10, 9000, quantization="nf4"),  # adapters: not full training
        scored(20, 5000, fits=False),  # over the device or host budget
    ]
    steps = host_frontier(rows)
    assert [(s.host_size_gb, s.best.estimate.tokens_per_s) for s in steps] == [
        (64, 1030),
        (192, 2000),
        (384, 2500),
    ]
    assert host_frontier([scored(20, 5000, fits=False)]) == []


def test_estimate_cli_shows_what_host_memory_buys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache"))
    result = cli("estimate", "--model", "tiny-llama", "--budget", "2GB", "--gpu", "rtx4090")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # the console wraps long lines
    steps = re.findall(r"with (\d+) GB of host RAM: .*? ([\d,]+) tokens/s", out)
    assert steps, result.output
    # the largest size buys the headline: the fastest of the best per fidelity class lines
    # (``best_per_class``) that train every weight with AdamW's update, or a more faithful class
    # within the speed model's error of it
    classes = re.findall(r" (exact|mixed|reduced_state) .*? ([\d,]+) tokens/s", out)
    best = max(float(tps.replace(",", "")) for _, tps in classes)
    last = float(steps[-1][1].replace(",", ""))
    assert best * (1 - MODEL_ERROR) <= last <= best, (steps, classes)
    head = re.search(r"predicted best full training \((\w+)\)", out)
    assert head and dict(classes)[head.group(1)] == steps[-1][1]


def test_run_records_the_frontier_for_show_json(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))
    run = cli(
        "run", "--model", "tiny-llama", "--budget", "2GB", "--backend", "estimate",
        "--gpu", "rtx4090", "--trials", "2", "--host-memory", "64GB",
    )  # fmt: skip
    assert run.exit_code == 0, run.output
    assert "GB of host RAM:" in run.output
    shown = cli("show", "--json")
    assert shown.exit_code == 0, shown.output
    frontier = json.loads(shown.output)["host_frontier"]
    assert frontier and all(step["host_bytes"] <= 64 * GB for step in frontier)
    assert all(step["host_size_gb"] <= 64 for step in frontier)
    speeds = [step["tokens_per_s"] for step in frontier]
    assert speeds == sorted(speeds)


def test_frontier_names_fp32_masters_where_more_memory_buys_them_at_the_same_speed() -> None:
    pure = scored(40, 1000, master_weights="bf16")  # reduced_state: 64 GB
    mixed = scored(100, 1000)  # fp32 masters, as fast: 128 GB
    faster = scored(300, 1500, master_weights="bf16")  # 384 GB
    steps = host_frontier([pure, mixed, faster])
    assert [(s.host_size_gb, s.best) for s in steps] == [(64, pure), (128, mixed), (384, faster)]


def test_headline_counts_pure_bf16_as_full_training_and_prefers_the_faithful_on_a_tie() -> None:
    pure = scored(40, 1000, master_weights="bf16")
    assert headline(best_per_class([pure])) is not None  # pure bf16 alone is an answer
    lion = scored(10, 5000, optimizer="lion")  # another optimizer: not the headline
    assert headline(best_per_class([lion])) is None
    mixed = scored(100, 960)  # within 6% of pure bf16: the faithful class wins the tie
    head = headline(best_per_class([pure, mixed, lion]))
    assert head is not None and head.best is mixed
    slow = scored(100, 900)  # 10% slower: pure bf16 wins
    head = headline(best_per_class([pure, slow]))
    assert head is not None and head.best is pure
