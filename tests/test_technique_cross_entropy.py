"""Chunked cross-entropy (``trials/techniques/cross_entropy.py``): the loss and its gradients are
transformers' own (``ForCausalLMLoss`` is the oracle), a real CPU trial keeps the same losses at
a lower measured peak, and the estimator's saving agrees with the measured one within 10%."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from tests.conftest import TINY, measured_and_predicted, tiny_spec
from trials.build import build_model
from trials.techniques import TECHNIQUES
from trials.techniques.base import Run
from trials.techniques.cross_entropy import CHUNKS, chunked_causal_lm_loss

VOCAB, HIDDEN = 96, 16


@pytest.mark.parametrize("tokens", [40, 37])  # a multiple of the slices and a ragged tail
@pytest.mark.parametrize("items", [None, 50])  # the mean, or transformers' num_items_in_batch
def test_the_loss_and_its_gradients_are_transformers(tokens: int, items: int | None) -> None:
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, tokens, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, tokens))
    labels[0, :5] = -100  # masked tokens are not counted

    expected = ForCausalLMLoss(head(hidden), labels, VOCAB, num_items_in_batch=items)
    expected.backward()
    want_hidden, want_head = hidden.grad.clone(), head.weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad, head.weight.grad = None, None

    got = chunked_causal_lm_loss(hidden, labels, VOCAB, num_items_in_batch=items, head=head)
    got.backward()

    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(hidden.grad, want_hidden)
    torch.testing.assert_close(head.weight.grad, want_head)


def test_the_model_trains_the_same_and_keeps_its_head() -> None:
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    plain = build_model(TINY, "sdpa", seed=3)
    chunked = TECHNIQUES.apply(
        build_model(TINY, "sdpa", seed=3), {"cross_entropy": "chunked"}, "cpu"
    )
    head_before = dict(plain.named_parameters())

    plain(input_ids=ids, labels=ids).loss.backward()
    loss = chunked(input_ids=ids, labels=ids).loss
    loss.backward()

    assert loss.item() == pytest.approx(plain(input_ids=ids, labels=ids).loss.item(), rel=1e-6)
    # the same parameters (the head moved under the passthrough, under its own name)
    renamed = {n.replace("lm_head.lm_head.", "lm_head."): p for n, p in chunked.named_parameters()}
    assert renamed.keys() == head_before.keys()
    for name, p in renamed.items():
        torch.testing.assert_close(p.grad, head_before[name].grad, rtol=1e-4, atol=1e-6)


def test_full_leaves_the_model_alone() -> None:
    model = build_model(TINY, "sdpa", seed=3)
    head = model.get_output_embeddings()
    assert TECHNIQUES.apply(model, {"cross_entropy": "full"}, "cpu").get_output_embeddings() is head


def test_exports() -> None:
    """Liger's fused linear cross-entropy alone on CUDA; axolotl's chunked loss on a CPU; the
    slices in the companion file; nothing for the plain loss."""
    technique = next(t for t in TECHNIQUES if t.family == "cross_entropy")
    chunked = {"cross_entropy": "chunked"}
    cuda, cpu = Run(1, 1, 1, "cuda", 1e-4), Run(1, 1, 1, "cpu", 1e-4)
    args = technique.training_arguments(chunked, cuda)
    assert args["use_liger_kernel"] is True
    assert [k for k, on in args["liger_kernel_config"].items() if on] == [
        "fused_linear_cross_entropy"
    ]
    assert technique.training_arguments(chunked, cpu) == {}
    assert technique.axolotl(chunked, cuda)["liger_fused_linear_cross_entropy"] is True
    assert technique.axolotl(chunked, cpu)["chunked_cross_entropy"] is True
    assert technique.companion(chunked, cpu) == {"loss_chunks": CHUNKS}
    plain = {"cross_entropy": "full"}
    assert technique.training_arguments(plain, cuda) == technique.axolotl(plain, cuda) == {}


def test_axolotl_reads_the_cpu_keys() -> None:
    """axolotl 0.19's own loader keeps the chunked-loss keys its patch manager reads
    (``chunked_cross_entropy``, ``chunked_cross_entropy_num_chunks``)."""
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    from tests.test_export_consumers import AXOLOTL_USER

    technique = next(t for t in TECHNIQUES if t.family == "cross_entropy")
    fragment = technique.axolotl({"cross_entropy": "chunked"}, Run(1, 1, 1, "cpu", 1e-4))
    cfg = validate_config(DictDefault({**AXOLOTL_USER, "micro_batch_size": 1, **fragment}))
    assert cfg["chunked_cross_entropy"] is True
    assert cfg["chunked_cross_entropy_num_chunks"] == CHUNKS


@pytest.mark.slow
def test_a_real_trial_saves_what_the_estimator_says(tmp_path: Path) -> None:
    """tiny-llama at seq 64, micro-batch 8, fp32 (the logits are 8192 wide: 33.5 MB of fp32
    logits and log-softmax): the same losses, a measured peak lower by the estimator's saving
    within 10%, and both runs' tokens/s recorded."""
    results, predicted = {}, {}
    for ce in ("full", "chunked"):
        spec = tiny_spec({"cross_entropy": ce}, measured_steps=2)
        results[ce], predicted[ce] = measured_and_predicted(spec, tmp_path / ce)
    full, chunked = results["full"], results["chunked"]
    assert chunked.losses == pytest.approx(full.losses, rel=1e-5)
    measured_saving = full.peak_bytes - chunked.peak_bytes
    assert measured_saving > 20e6
    assert predicted["full"] - predicted["chunked"] == pytest.approx(measured_saving, rel=0.10)
    assert full.tokens_per_s > 0 and chunked.tokens_per_s > 0
