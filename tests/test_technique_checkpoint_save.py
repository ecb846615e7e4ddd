"""Selective checkpointing per op (``checkpoint_save`` in ``trials/techniques/checkpointing.py``):
the same losses and gradients as plain checkpointing, the measured extra bytes of what it keeps
per layer equal to the estimator's within 10%, and its axolotl keys read by axolotl's loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import measured_and_predicted, tiny_loss_and_grads, tiny_spec
from trials.techniques import TECHNIQUES
from trials.techniques.base import Run
from trials.techniques.checkpointing import SAVED_OPS, checkpoint_kwargs

SAVES = ("attention", "matmuls")


@pytest.mark.parametrize("save", SAVES)
def test_the_same_loss_and_gradients_as_plain_checkpointing(save: str) -> None:
    plain_loss, plain = tiny_loss_and_grads({"gradient_checkpointing": "full"})
    loss, grads = tiny_loss_and_grads({"gradient_checkpointing": "full", "checkpoint_save": save})
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name])


def test_the_policy_reaches_torch_checkpoint_only_when_asked() -> None:
    assert checkpoint_kwargs({"gradient_checkpointing": "full"}) == {"use_reentrant": False}
    off = {"gradient_checkpointing": "off", "checkpoint_save": "matmuls"}
    assert checkpoint_kwargs(off) == {"use_reentrant": False}  # nothing checkpointed
    kwargs = checkpoint_kwargs({"gradient_checkpointing": "full", "checkpoint_save": "matmuls"})
    assert kwargs["use_reentrant"] is False and callable(kwargs["context_fn"])


def test_axolotl_reads_its_selective_checkpointing_keys() -> None:
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    from tests.test_export_consumers import AXOLOTL_USER

    technique = next(t for t in TECHNIQUES if t.family == "checkpointing")
    run = Run(1, 1, 1, "cuda", 1e-4)
    fragment = technique.axolotl(
        {"gradient_checkpointing": "full", "checkpoint_save": "matmuls"}, run
    )
    cfg = validate_config(DictDefault({**AXOLOTL_USER, "micro_batch_size": 1, **fragment}))
    assert cfg["gradient_checkpointing"] is True
    assert cfg["selective_checkpointing"]["save"] == [
        "attention",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
    ]
    companion = technique.companion(
        {"gradient_checkpointing": "full", "checkpoint_save": "attention"}, run
    )
    assert companion["checkpoint_save_ops"] == list(SAVED_OPS["attention"])
    assert (
        technique.companion({"gradient_checkpointing": "full"}, run)["checkpoint_save_ops"] is None
    )


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_what_it_keeps_is_what_the_estimator_counts(precision: str, tmp_path: Path) -> None:
    """Real CPU trials of tiny-llama with full checkpointing, saving nothing, the attention, and
    every matmul: the same losses; each saving policy's measured extra peak (what the layers
    keep besides their inputs) within 1% of the analytical estimator's, and tokens/s recorded
    per policy (on a CPU, recomputing is cheap next to the memory it saves; on a GPU the
    matmuls it skips are most of a layer's forward)."""
    peaks, predicted, losses = {}, {}, {}
    for save in ("none", *SAVES):
        spec = tiny_spec(
            {"gradient_checkpointing": "full", "checkpoint_save": save, "precision": precision},
            measured_steps=1,
        )
        result, predicted[save] = measured_and_predicted(spec, tmp_path / save)
        assert result.tokens_per_s > 0
        peaks[save], losses[save] = result.peak_bytes, result.losses
    for save in SAVES:
        assert losses[save] == losses["none"]
        measured_extra = peaks[save] - peaks["none"]
        assert measured_extra > 0
        # measured here: equal to the byte in all four cases (the issue asks 10%)
        assert predicted[save] - predicted["none"] == pytest.approx(measured_extra, rel=0.01)
