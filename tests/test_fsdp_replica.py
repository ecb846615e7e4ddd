"""FSDP2 with its shards offloaded, full activation checkpointing that saves the attention
kernel's outputs, and chunked cross-entropy (the estimate's answer for llama-7b on a 24 GB card)
on scale replicas of LLaMA that a CPU trial trains: the real step's measured peak is the oracle
for both estimators'.

The replicas keep llama-7b's decoder (SwiGLU MLP 2.69x wide, 128-wide heads) and vary what moves
the peak: a small vocabulary against the layers (llama-7b's 32,000 against 32 layers of 4,096 is
0.24 entries per layer width; here 1,024 against 4 layers of 256 is 1.0), where the peak is the
first layer's backward, every checkpointed layer's input and saved attention output still held;
and a large one (32,000 over 32 layers of 128), where it is the start of backward, one slice's
logits and the head's gradient beside every kept activation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from trials.job import run_trial
from trials.spec import TrialSpec

CONFIG = {
    "gradient_checkpointing": "full",
    "checkpoint_save": "attention",
    "cross_entropy": "chunked",
    "precision": "bf16",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 16,
    "fsdp": "full_shard",
    "fsdp_offload": "cpu",
}


def _llama(hidden: int, layers: int, vocab: int, mlp: int) -> dict[str, Any]:
    heads = hidden // 128
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_cache": False,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "seq_len", "moment"),
    [
        (_llama(256, 4, 1024, 688), 128, "first layer's backward"),
        (_llama(128, 32, 32000, 344), 64, "start of backward"),
    ],
    ids=["small-vocabulary", "large-vocabulary"],
)
def test_both_estimators_peaks_are_the_measured_one(
    model: dict[str, Any], seq_len: int, moment: str, tmp_path: Path
) -> None:
    kw: dict[str, Any] = {"seq_len": seq_len, "global_batch_size": 32}
    measured = run_trial(
        TrialSpec(
            model_config=model,
            config=dict(CONFIG),
            budget_bytes=None,
            warmup_steps=2,
            measured_steps=1,
            lr=1e-4,
            **kw,
        )
    )
    assert measured.status == "ok", measured.error
    workload = Workload(model, seq_len_tokens=seq_len, global_batch_sequences=32)  # on the CPU
    est = AnalyticalEstimator().estimate(workload, dict(CONFIG))
    assert f"peak at {moment}" in est.notes
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        est.peak_bytes,
        measured.peak_bytes,
        est.breakdown,
    )
    traced = TracedEstimator(cache=tmp_path).estimate(workload, dict(CONFIG))
    assert abs(traced.peak_bytes - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        traced.peak_bytes,
        measured.peak_bytes,
        traced.breakdown,
    )
