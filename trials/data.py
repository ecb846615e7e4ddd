"""Deterministic, learnable synthetic token data.

Each sequence is an arithmetic progression modulo a small alphabet (``start + stride * t``), with
``start`` and ``stride`` drawn from a generator seeded by (seed, step). The next token is a
function of the previous two, so a causal LM's loss falls within a few steps, and every trial
with the same seed sees exactly the same tokens in the same order.
"""

from __future__ import annotations

import torch

#: Tokens are drawn from the first ``LEARNABLE_ALPHABET`` ids, so even a few steps move the loss
#: visibly (from ln(vocab) towards ln(alphabet) and below) and lossy techniques show their cost.
LEARNABLE_ALPHABET = 256


def batch_for_step(
    step: int, batch_size: int, seq_len: int, vocab_size: int, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    alphabet = min(vocab_size, LEARNABLE_ALPHABET)
    max_stride = max(2, min(16, alphabet // 4))
    start = torch.randint(0, alphabet, (batch_size, 1), generator=gen)
    stride = torch.randint(1, max_stride, (batch_size, 1), generator=gen)
    positions = torch.arange(seq_len).unsqueeze(0)
    return (start + stride * positions) % alphabet
