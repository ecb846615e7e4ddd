"""The fine-tuning configurations at scale on a CPU: the scale replica of test_real_size.py
(a 91M-parameter LLaMA whose embedding and head are 72% of it), bf16, micro-batch 4 x 64 tokens,
no checkpointing, one rank, against both estimators.

``REPLICA_MEASURED`` holds real trials of this machine's CPU tracker (the command:
``python -m pytest -p no:xdist -m slow tests/test_replica_fine_tuning.py`` re-measures one of
them; each takes a minute or more on 2 busy cores). The fast test checks both estimators against
the recorded peaks; the slow one re-measures the pure bf16 row."""

from __future__ import annotations

import pytest

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from tests.test_real_size import REPLICA
from trials.spec import TrialSpec

BASE = {
    "gradient_checkpointing": "off",
    "attention": "sdpa",
    "optimizer": "adamw",
    "micro_batch_size": 4,
    "precision": "bf16",
}

#: (extra config, measured training peak in B; estimate / measured - 1 reached, analytical and
#: traced): pure bf16 -0.00% / +0.00%; pure bf16 with the step in backward +0.06% / +0.01%;
#: LoRA r16 every linear -0.22% / +0.45%; DoRA r8 attention -2.90% / -2.85%; FSDP2 full_shard
#: pure bf16 -2.96% / -2.96%; the step in backward (autocast) +0.09% / +0.00% (was +4.3%: the
#: head's 16-bit weight copy counted at its own step, after its backward freed it); FSDP2
#: full_shard with the shards offloaded -0.00% / -0.00% (the traced estimate was 2,048 B: the
#: trace's step, not its start of backward, with the model states taken off); FSDP2 full_shard
#: offloaded with full checkpointing -0.00% / -0.00% (the root's reduction at the end of
#: backward)
REPLICA_MEASURED: list[tuple[dict, int]] = [
    ({"master_weights": "bf16"}, 860_926_548),
    ({"master_weights": "bf16", "optimizer_in_backward": True}, 770_266_716),
    ({"adapter": "lora", "lora_rank": 16, "lora_targets": "all_linear"}, 315_883_912),
    ({"adapter": "dora", "lora_rank": 8, "lora_targets": "attention"}, 329_503_080),
    ({"fsdp": "full_shard", "master_weights": "bf16"}, 887_144_544),
    ({"optimizer_in_backward": True}, 1_571_966_556),
    ({"fsdp": "full_shard", "fsdp_offload": "cpu"}, 393_224_200),
    ({"fsdp": "full_shard", "fsdp_offload": "cpu", "gradient_checkpointing": "full"}, 393_224_200),
]


def _estimates(config: dict, seq_len: int = 64, batch: int = 4, traced: bool = True) -> list[int]:
    estimators = [AnalyticalEstimator(), *([TracedEstimator(use_cache=False)] if traced else [])]
    return [
        estimator.estimate(
            Workload(REPLICA, seq_len_tokens=seq_len, global_batch_sequences=batch), config
        ).peak_bytes
        for estimator in estimators
    ]


@pytest.mark.parametrize(("extra", "measured"), REPLICA_MEASURED)
def test_the_analytical_estimate_within_5_percent_of_the_measured_replica(
    extra: dict, measured: int
) -> None:
    for peak in _estimates({**BASE, **extra}, traced=False):
        assert peak == pytest.approx(measured, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "measured"), REPLICA_MEASURED)
def test_the_traced_estimate_within_5_percent_of_the_measured_replica(
    extra: dict, measured: int
) -> None:
    """A fake-tensor step of the replica each (seconds)."""
    traced = TracedEstimator(use_cache=False).estimate(
        Workload(REPLICA, seq_len_tokens=64, global_batch_sequences=4), {**BASE, **extra}
    )
    assert traced.peak_bytes == pytest.approx(measured, rel=0.05)


@pytest.mark.slow
def test_fsdp2_offload_at_a_longer_sequence_as_measured() -> None:
    """The replica, FSDP2 full_shard offloaded, one sequence of 512 tokens: measured 393,226,248
    B (the root's reduction at the end of backward); analytical +0.40%, traced -0.00% (were
    +17.1% and +13.7%: the head's gradient counted beside the full loss's logits gradients,
    which are gone before the head's backward)."""
    config = {**BASE, "fsdp": "full_shard", "fsdp_offload": "cpu", "micro_batch_size": 1}
    for peak in _estimates(config, seq_len=512, batch=1):
        assert peak == pytest.approx(393_226_248, rel=0.01)


@pytest.mark.slow
def test_fsdp2_offload_at_llama_7b_both_estimators_agree() -> None:
    """llama-7b, FSDP2 full_shard with the shards offloaded, bf16, micro-batch 4 x 2,048 on one
    GPU: the two estimators give the same peak within 1% (reached 50.17 against 50.20 GiB). They
    differed by 14%, 63.4 against 72.1 GiB, and neither was right: the trace ran the model
    under autocast over fp32 weights where FSDP2 computes on 16-bit copies (the analytical
    counted its layers as autocast's too), and both counted the head's gradient beside the
    full loss's logits gradients (the replica at 512 tokens above)."""
    from autotune.estimator.gpus import GPUS
    from autotune.models import MODELS

    config = {**BASE, "fsdp": "full_shard", "fsdp_offload": "cpu"}
    kw = {"seq_len_tokens": 2048, "global_batch_sequences": 4, "gpu": GPUS["a100-80gb"]}
    model = MODELS["llama-7b"].config
    analytical = AnalyticalEstimator().estimate(Workload(model, **kw), config).peak_bytes
    traced = TracedEstimator(use_cache=False).estimate(Workload(model, **kw), config).peak_bytes
    assert traced == pytest.approx(analytical, rel=0.01)


@pytest.mark.slow
def test_the_pure_bf16_replica_peaks_as_recorded() -> None:
    """One row of the table re-measured: pure bf16 on the torch engine."""
    from trials.job import run_trial

    extra, recorded = REPLICA_MEASURED[0]
    spec = TrialSpec(
        model_config=REPLICA,
        config={**BASE, **extra},
        seq_len=64,
        global_batch_size=4,
        budget_bytes=None,
        warmup_steps=1,
        measured_steps=1,
        lr=3e-3,
    )
    result = run_trial(spec)
    assert result.status == "ok", result.error
    assert result.training_peak_bytes == pytest.approx(recorded, rel=0.01)
    for peak in _estimates(spec.config):
        assert peak == pytest.approx(result.training_peak_bytes, rel=0.05)
