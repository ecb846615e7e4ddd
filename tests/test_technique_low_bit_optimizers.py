"""Low-bit optimizers (``optimizer`` in ``trials/techniques/optimizer.py``): torchao's 8-bit and
4-bit AdamW trained for real on the CPU (their compiled step run eagerly under the tracker), the
estimators' state bytes against torchao's own states, the real trials' peaks against both
estimators, the space's rules, and transformers' Trainer picking the exported optimizer."""

from __future__ import annotations

import pytest
import torch

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.states import param_shapes
from autotune.estimator.traced import TracedEstimator
from autotune.estimator.workload import Workload
from autotune.space import SearchSpace
from tests.conftest import TINY, tiny_spec
from trials.build import build_model
from trials.hardware import Hardware
from trials.job import run_trial
from trials.techniques import OPTIMIZERS

pytest.importorskip("torchao")

LOW_BIT = ["adamw_torchao_8bit", "adamw_torchao_4bit"]
#: full checkpointing and chunked cross-entropy: the peak is at the optimizer step
STEP_BOUND = {"gradient_checkpointing": "full", "cross_entropy": "chunked"}


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every moment torchao keeps (each tensor its state subclass flattens to: codes,
    scales, code book; or an fp32 moment), the step counters left out as the estimators leave
    them out."""
    total = 0
    for state in optimizer.state.values():
        for name, value in state.items():
            if name == "step":
                continue
            names = value.__tensor_flatten__()[0] if hasattr(value, "__tensor_flatten__") else []
            inner = [getattr(value, n) for n in names] or [value]
            total += sum(t.numel() * t.element_size() for t in inner)
    return total


@pytest.mark.parametrize("name", LOW_BIT)
def test_state_bytes_are_torchaos(name: str) -> None:
    """tiny-llama's parameters stepped once by torchao's own optimizer (eagerly): the bytes it
    keeps equal the estimators' formula for the same shapes (the embeddings and matrices
    quantized block-wise, the norms' vectors in fp32)."""
    model = build_model(TINY, "sdpa", seed=1)
    optimizer = OPTIMIZERS[name].factory(model.parameters(), 1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    assert _state_bytes(optimizer) == OPTIMIZERS[name].state_bytes(param_shapes(TINY))
    assert _state_bytes(optimizer) < OPTIMIZERS["adamw"].state_bytes(param_shapes(TINY)) / 3


@pytest.mark.parametrize("name", LOW_BIT)
def test_a_real_trial_keeps_less_state_and_both_estimators_count_it(name: str) -> None:
    """A CPU trial with torchao's optimizer against AdamW: the optimizer states the tracker
    tagged are torchao's bytes (and a 4-byte step per tensor); the peak's difference within 10%
    of the analytical estimator's, the peak within 1% of both estimators' (measured 8-bit
    185,078,696 B, predicted 185,041,408 analytical and 185,045,760 traced; 4-bit 177,927,336 B,
    177,857,280 and 177,861,632; AdamW 134,522,268 B): at this step-bound peak the eager step's
    temporaries (13.25 fp32 copies of the largest tensor) outweigh the states saved; the losses
    within 1% of AdamW's over 3 steps."""
    plain_spec = tiny_spec(STEP_BOUND, measured_steps=1)
    spec = tiny_spec({**STEP_BOUND, "optimizer": name}, measured_steps=1)
    plain, result = run_trial(plain_spec), run_trial(spec)
    assert plain.status == result.status == "ok", result.error
    tensors = len(param_shapes(TINY))
    states = OPTIMIZERS[name].state_bytes(param_shapes(TINY))
    assert result.memory_breakdown["optimizer_states"] == states + 4 * tensors
    kw = {"seq_len_tokens": spec.seq_len, "global_batch_sequences": spec.global_batch_size}
    analytical = AnalyticalEstimator()
    predicted = analytical.estimate(Workload(TINY, **kw), spec.config).peak_bytes
    predicted_saving = (
        analytical.estimate(Workload(TINY, **kw), plain_spec.config).peak_bytes - predicted
    )
    assert predicted_saving == pytest.approx(plain.peak_bytes - result.peak_bytes, rel=0.10)
    assert predicted == pytest.approx(result.peak_bytes, rel=0.01)
    traced = TracedEstimator(use_cache=False).estimate(Workload(TINY, **kw), spec.config)
    assert traced.peak_bytes == pytest.approx(result.peak_bytes, rel=0.01)
    assert result.losses == pytest.approx(plain.losses, rel=0.01)


def test_the_space_keeps_them_off_zero_offload_and_fsdp() -> None:
    """With torchao installed, its optimizers are searched with ZeRO stage 0 (or without
    DeepSpeed) only, never with offload or FSDP; without it they are dropped with the reason;
    bitsandbytes' paged 8-bit AdamW is dropped on a CPU."""
    space = SearchSpace.load().resolve(16, Hardware(backend="cpu", has_torchao=True))
    low_bit = [c for c in space.grid() if c["optimizer"] in LOW_BIT]
    assert {c["optimizer"] for c in low_bit} == set(LOW_BIT)
    assert {c.get("zero_stage") for c in low_bit} == {0, None}
    assert not any(c.get("offload_optimizer") == "cpu" for c in low_bit)
    assert {c.get("fsdp") for c in low_bit} <= {"off", None}
    assert "optimizer=paged_adamw_8bit: bitsandbytes needs a CUDA GPU" in space.dropped
    without = SearchSpace.load().resolve(16, Hardware(backend="cpu", has_torchao=False))
    assert any(
        d.startswith("optimizer=adamw_torchao_4bit: torchao is not installed")
        for d in without.dropped
    )


@pytest.mark.parametrize("name", LOW_BIT)
def test_transformers_trainer_picks_the_exported_optimizer(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``TrainingArguments(optim=...)`` as exported: transformers' Trainer resolves it to
    torchao's own class."""
    from torchao import optim as ao
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), optim=OPTIMIZERS[name].hf_name)
    model = build_model(TINY, "sdpa", seed=1)
    cls, _ = Trainer.get_optimizer_cls_and_kwargs(args, model)
    assert cls is {"adamw_torchao_8bit": ao.AdamW8bit, "adamw_torchao_4bit": ao.AdamW4bit}[name]


def test_step_temporaries_eager_on_the_cpu_backend_compiled_on_cuda() -> None:
    """Bytes of the step's temporaries for a tensor of n values, by hand from the measured
    copies: torchao's eager step (the CPU backend) 13.25 fp32 copies, 53 n B; compiled (CUDA)
    2 copies for 8 bits, 8 n B, and 6.5 for 4 bits, 26 n B; torch's AdamW 2 copies, 8 n B,
    either way."""
    n = 2_097_152
    assert OPTIMIZERS["adamw_torchao_8bit"].step_temporaries(n, cuda=False) == 53 * n
    assert OPTIMIZERS["adamw_torchao_4bit"].step_temporaries(n, cuda=False) == 53 * n
    assert OPTIMIZERS["adamw_torchao_8bit"].step_temporaries(n, cuda=True) == 8 * n
    assert OPTIMIZERS["adamw_torchao_4bit"].step_temporaries(n, cuda=True) == 26 * n
    for cuda in (False, True):
        assert OPTIMIZERS["adamw"].step_temporaries(n, cuda=cuda) == 8 * n


def test_a_gpu_prediction_counts_the_compiled_step() -> None:
    """The analytical estimator for a GPU counts torchao's compiled step, for the CPU backend
    its eager one: at this step-bound peak the two differ by (13.25 - 2) x 4 B x the largest
    tensor (tiny-llama's embedding, 2,097,152 values), by hand."""
    from autotune.estimator.gpus import GPUS

    kw = {"seq_len_tokens": 64, "global_batch_sequences": 8}
    config = {**STEP_BOUND, "optimizer": "adamw_torchao_8bit", "micro_batch_size": 8}
    analytical = AnalyticalEstimator()
    cpu = analytical.estimate(Workload(TINY, **kw), config)
    gpu = analytical.estimate(Workload(TINY, gpu=GPUS["a100-80gb"], **kw), config)
    assert cpu.breakdown["temporaries"] - gpu.breakdown["temporaries"] == 45 * 2_097_152
