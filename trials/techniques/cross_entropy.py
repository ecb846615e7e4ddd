"""Chunked cross-entropy: the full-vocabulary logits never exist at once.

Plain training computes the logits of every token of the micro-batch (T x vocab), upcasts them
to fp32 for the loss and keeps the fp32 log-softmax for backward: 8-12 bytes per token per
vocabulary entry, the largest single tensor of a small model's step (tiny-llama at micro-batch 8:
50 MB of its 184 MB peak; Llama 3's 128k vocabulary at 8k tokens: 12 GB). ``chunked`` hands the
final hidden states to the loss instead, which applies the LM head to ``CHUNKS`` slices of the
tokens one at a time, each under non-reentrant activation checkpointing: forward keeps only the
hidden states, and backward recomputes one slice's logits at a time. The same math as the plain
loss (a sum over tokens divided by their count, reordered): exact. torchtune's
``CEWithChunkedOutputLoss`` chunks the same way (8 slices) but keeps each slice's logits;
Liger's fused linear cross-entropy (CUDA) goes further by computing the head's gradient in
forward. The export asks for Liger's on CUDA (``liger_kernel_config``) and records the chunking
in the companion file for a plain training loop.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from trials.techniques.base import Config, Knob, Run, Technique

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.techniques.terms import MemoryStep, SpeedStep

#: slices of the micro-batch's tokens the loss is computed over (torchtune's default)
CHUNKS = 8
IGNORE_INDEX = -100  # transformers' and PyTorch's label to skip


def is_chunked(config: Config) -> bool:
    return str(config.get("cross_entropy", "full")) == "chunked"


def loss_tokens(config: Config, tokens: int) -> int:
    """How many tokens' logits exist at once (the estimator's logits terms)."""
    return -(-tokens // CHUNKS) if is_chunked(config) else tokens


def _slice_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    *,
    head: nn.Module,
    **_: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (labels shifted by one, ``ignore_index`` skipped, the
    mean over the counted tokens) where ``logits`` are the final hidden states (``HiddenHead``
    passed them through) and the LM head ``head`` is applied slice by slice."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = logits.reshape(-1, logits.size(-1))
    targets = shift_labels.reshape(-1).to(hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, t in zip(hidden.chunk(CHUNKS), targets.chunk(CHUNKS), strict=True):
        total = total + checkpoint(_slice_loss, head, h, t, use_reentrant=False)
    count = num_items_in_batch
    if count is None:
        count = (targets != ignore_index).sum()
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
    return total / count


def _hidden_head_class() -> type[nn.Module]:
    from torch import nn

    class HiddenHead(nn.Module):
        """The model's output layer as a passthrough of the hidden states; the real head is its
        child, named ``lm_head`` as in the model, so what skips the head by name (the
        quantization swap, peft's ``all-linear``) still skips it."""

        def __init__(self, lm_head: nn.Module) -> None:
            super().__init__()
            self.lm_head = lm_head

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    return HiddenHead


def chunk_loss(model: nn.Module) -> nn.Module:
    """The model's loss computed over ``CHUNKS`` slices (in place): its output layer passes the
    hidden states through and its ``loss_function`` applies the real head per slice. Only the
    training loss is meant: the model's ``logits`` output becomes the hidden states."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    model.set_output_embeddings(_hidden_head_class()(head))  # type: ignore[operator]
    model.loss_function = partial(chunked_causal_lm_loss, head=head)  # type: ignore[assignment]
    return model


class CrossEntropy(Technique):
    family = "cross_entropy"
    traced = True
    knobs = (
        Knob(
            "cross_entropy",
            ("full", "chunked"),
            baseline="full",
            short=lambda v: "" if v == "full" else "ce/chunk",
            # no memory order: chunked keeps an eighth of the logits at a time but two
            # gradients of the head (one per slice, summed), so at small micro-batches it
            # needs more than full (tiny-llama, micro-batch 2: 154.5 against 141.9 MB traced)
        ),
    )

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        return chunk_loss(model) if is_chunked(config) else model

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        if not is_chunked(config) or run.device != "cuda":
            return {}
        # Liger's fused linear cross-entropy alone (not its norm/RoPE/SwiGLU kernels)
        return {
            "use_liger_kernel": True,
            "liger_kernel_config": {
                "fused_linear_cross_entropy": True,
                "cross_entropy": False,
                "rms_norm": False,
                "rope": False,
                "swiglu": False,
            },
        }

    def memory(self, step: MemoryStep) -> None:
        # one slice's logits at a time, recomputed in backward
        step.logit_tokens = loss_tokens(step.config, step.tokens)
        if step.logit_tokens < step.tokens:
            # the head's weight is used once per slice: autograd sums its slices' gradients in
            # a buffer before it reaches ``.grad`` (the sum so far and the new slice's: two
            # head-sized gradients, of the 16-bit weight copy under autocast); and the hidden
            # states' gradient filled slice by slice
            grad_bytes = 2 if step.half else 4
            # a frozen head (adapters, a quantized base with LoRA): none
            frozen = step.adapted or step.quantized
            head_grads = 0 if frozen else 2 * grad_bytes * step.head_params
            step.bwd_logits_extra += head_grads + 4 * step.stats.hidden * step.tokens

    def kernels(self, step: SpeedStep) -> None:
        # each slice's logits made again in backward: the LM head's matmul runs once more
        if not is_chunked(step.config):
            return
        st = step.stats
        flops, nbytes = 2 * step.tokens * st.vocab * st.hidden, step.wbytes * st.vocab * st.hidden
        step.recompute_compute += max(flops / step.peak, nbytes / step.hbm)

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        if not is_chunked(config):
            return {}
        if run.device == "cuda":
            return {
                "plugins": ["axolotl.integrations.liger.LigerPlugin"],
                "liger_fused_linear_cross_entropy": True,
            }
        return {"chunked_cross_entropy": True, "chunked_cross_entropy_num_chunks": CHUNKS}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {"loss_chunks": CHUNKS if is_chunked(config) else None}


TECHNIQUE = CrossEntropy()
