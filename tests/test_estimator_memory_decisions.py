"""The estimator's memory decisions (``autotune/estimator/analytical.py``, ``activations.py``,
``states.py``: what each moment of a step holds, and which moment is the peak), against hand
computations on a LLaMA-shaped model (h 1024, MLP 2816, 8 layers, 16 heads, vocabulary 256,
103,302,144 parameters; fp32 sdpa on the CPU keeps 4 x (6h + 3q + 2kd + 4I) bytes a token in a
layer, the module docstring's count). The speed decisions:
``tests/test_estimator_speed_decisions.py``.

The decisions, each with a test here that fails when it is inverted, swapped or fed the wrong
quantity:

1. the peak is the largest of the step's moments, not their sum nor the last one;
2. full checkpointing: the end of backward holds every layer's input (4h bytes a token) and
   the one layer recomputed at that time, beside the gradients;
3. selective checkpointing every k-th layer keeps the others whole;
4. the start of backward holds the logits' and the log-softmax's gradients (12 bytes a token per
   vocabulary entry) with every kept activation and the final norm's and head's inputs;
5. gradient accumulation holds the earlier micro-batches' gradients through forward and backward.
"""

from __future__ import annotations

from typing import Any

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.workload import Workload
from autotune.models import stats_of

MODEL = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
}
H, INTER, LAYERS, VOCAB = 1024, 2816, 8, 256
N = 2 * VOCAB * H + LAYERS * (4 * H * H + 3 * H * INTER + 2 * H) + H
STATES = 16 * N  # fp32 weights, gradients and AdamW's two moments


def _layer(tokens: int) -> int:
    """One layer's kept activations, fp32 sdpa (q = kd = h here)."""
    return 4 * (6 * H + 3 * H + 2 * H + 4 * INTER) * tokens


def _estimate(config: dict[str, Any]) -> Any:
    return AnalyticalEstimator().estimate(
        Workload(MODEL, seq_len_tokens=2048, global_batch_sequences=8), config
    )


def test_the_hand_model_has_the_parameters_counted_here() -> None:
    assert stats_of(MODEL).n_params == N == 103_302_144


def test_full_checkpointing_end_of_backward_holds_the_inputs_and_one_recomputed_layer() -> None:
    """By hand: 16 x N of states, 8 layer inputs of 4h bytes a token and one whole layer
    recomputed, 8 x 2048 tokens: 1,652,834,304 + 536,870,912 + 1,476,395,008 bytes."""
    tokens = 8 * 2048
    est = _estimate({"gradient_checkpointing": "full"})
    hand = STATES + LAYERS * 4 * H * tokens + _layer(tokens)
    assert est.peak_bytes == hand == 3_666_100_224
    assert est.notes[0] == "peak at end of backward"


def test_selective_checkpointing_keeps_the_other_layers_whole() -> None:
    """By hand, every 2nd layer checkpointed: at the start of backward 4 inputs, 4 whole layers,
    the final norm's fp32 input and output and the head's input (12h a token), the logits'
    gradients (12 v a token), and the weights and moments (12 N; no gradient yet)."""
    tokens = 8 * 2048
    est = _estimate({"gradient_checkpointing": "selective", "checkpoint_every": 2})
    hand = 12 * N + 4 * 4 * H * tokens + 4 * _layer(tokens) + 12 * H * tokens + 12 * VOCAB * tokens
    assert est.peak_bytes == hand
    assert est.notes[0] == "peak at start of backward"


def test_without_checkpointing_the_peak_is_the_start_of_backward_not_a_sum() -> None:
    """By hand: every layer whole, the head's inputs and the logits' gradients over 12 N; not
    the sum of that and the end of backward's gradients."""
    tokens = 8 * 2048
    est = _estimate({})
    hand = 12 * N + LAYERS * _layer(tokens) + 12 * H * tokens + 12 * VOCAB * tokens
    assert est.peak_bytes == hand == 13_302_444_032


def test_accumulation_holds_the_earlier_gradients_in_backward() -> None:
    """By hand, two micro-batches of 4: the start of backward holds the first micro-batch's
    gradients (4 N) beside half the activations and logits."""
    tokens = 4 * 2048
    est = _estimate({"micro_batch_size": 4})
    hand = 16 * N + LAYERS * _layer(tokens) + 12 * H * tokens + 12 * VOCAB * tokens
    assert est.peak_bytes == hand
    assert est.breakdown["gradients"] == 4 * N
