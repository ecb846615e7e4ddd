"""The headline on a desktop: ``autotune run --model llama-7b --budget 24GB --host-memory 64GB``
(no GPU here: the estimate backend answers for an RTX 4090) names full training that fits both
memories, at a speed that agrees with torchtune's published full fine-tune on one RTX 4090;
without ``--host-memory`` the answer lists what more host RAM buys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import cli

GB = 10**9
GIB = 2**30


def _flops_per_token(layers: int, hidden: int, kv: int, ffn: int, vocab: int, seq: int) -> float:
    """Training FLOPs per token, by hand: 6 per matmul weight (q, k, v, o, the three MLP
    projections, the head; the embedding lookup is none) and 6 s h per layer of attention."""
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn
    return 6 * (layers * per_layer + vocab * hidden) + 6 * seq * hidden * layers


#: torchtune's README: Llama 3.1 8B full fine-tune on one RTX 4090 (pure bf16, paged 8-bit
#: AdamW, step in backward, checkpointing, chunked cross-entropy, compile), 2 x 2,048 tokens:
#: about 1,650 tokens/s; scaled to Llama 2 7B by FLOPs per token (8B: 32 layers, hidden 4096,
#: 8 KV heads of 128, MLP 14,336, vocabulary 128,256; 7B: 32 heads of 128, MLP 11,008, 32,000)
PUBLISHED_7B = (
    1650
    * _flops_per_token(32, 4096, 1024, 14336, 128256, 2048)
    / _flops_per_token(32, 4096, 4096, 11008, 32000, 2048)
)


def _flat(text: str) -> str:
    return " ".join(text.split())  # the console wraps long lines


def _size(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"MiB": 2**20, "GiB": GIB}[unit]


def test_full_training_fits_a_desktop_at_the_published_speed(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(in_tmp / "cache"))
    result = cli("run", "--model", "llama-7b", "--budget", "24GB", "--host-memory", "64GB")
    assert result.exit_code == 0, result.output
    out = _flat(result.output)
    assert "no full-training" not in out
    m = re.search(
        r"predicted best for NVIDIA GeForce RTX 4090 \(full training, (\w+)\): (.*?): peak "
        r"([\d.]+ [MG]iB) \(traced; analytical ([\d.]+ [MG]iB)\) of [\d.]+ GiB, host memory "
        r"([\d.]+ GiB), ([\d,]+) tokens/s",
        out,
    )
    assert m, result.output
    cls, config, traced, analytical, host, tps = m.groups()
    # pure bf16 (no fp32 masters) is what makes 64 GB of host RAM enough
    assert cls == "reduced_state" and "pure-bf16" in config, config
    assert "lora" not in config and "nf4" not in config
    assert max(_size(traced), _size(analytical)) <= 24 * GB
    assert _size(host) <= 64 * GB
    speed = float(tps.replace(",", ""))
    assert abs(speed / PUBLISHED_7B - 1) <= 0.20, (speed, PUBLISHED_7B)


def test_without_host_memory_the_answer_shows_what_more_ram_buys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache"))
    result = cli("estimate", "--model", "llama-7b", "--budget", "24GB")
    assert result.exit_code == 0, result.output
    out = _flat(result.output)
    steps = re.findall(
        r"with (\d+) GB of host RAM: (.*?) \((\w+)\): peak [\d.]+ [MG]iB, host ([\d.]+ [MG]iB), "
        r"([\d,]+) tokens/s",
        out,
    )
    assert len(steps) >= 2, result.output
    sizes = [int(s[0]) for s in steps]
    assert sizes == sorted(sizes) and sizes[0] <= 64
    # each step holds in its size, and the first one is the --host-memory 64GB answer's class
    assert all(_size(host) <= int(size) * GB for size, _, _, host, _ in steps)
    assert steps[0][2] == "reduced_state" and "pure-bf16" in steps[0][1]
    # more host memory buys fp32 master weights (mixed precision) at least as fast: the answer
    # without a host limit is the last step
    speeds = [float(s[4].replace(",", "")) for s in steps]
    assert steps[-1][2] in ("exact", "mixed") and speeds[-1] >= speeds[0] * 0.94
    head = re.search(r"predicted best full training \((\w+)\)", out)
    assert head and head.group(1) == steps[-1][2]
