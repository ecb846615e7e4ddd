"""The fine-tuning terms of the speed model and the paging model, each against a hand
computation, and the published fine-tuning benchmark's arithmetic on a few rows (not timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.estimator import speed
from autotune.estimator.activations import layer_activation_bytes
from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import Estimate
from autotune.estimator.gpus import GPUS
from autotune.estimator.paging import apply_budget, page, paged_state_bytes
from autotune.estimator.workload import Workload
from autotune.models import MODELS, stats_of

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

LLAMA7B = MODELS["llama-7b"].config
LLAMA31 = MODELS["llama-3.1-8b"].config
TINY = MODELS["tiny-llama"].config
BASE = {"precision": "bf16", "attention": "sdpa", "optimizer": "adamw", "micro_batch_size": 4}


def step(model: dict, gpu: str = "a100-80gb", seq: int = 2048, gbs: int = 4, **extra: object):
    config = {**BASE, **extra}
    st = stats_of(model)
    acts = layer_activation_bytes(st, config, seq, int(config["micro_batch_size"]))
    return speed.step_time(Workload(model, seq, gbs, gpu=GPUS[gpu]), config, acts)


# --- the paging model ----------------------------------------------------------------------------


def test_paged_states_are_bitsandbytes_8bit_states_of_the_big_tensors() -> None:
    # llama-3.1-8b: every tensor but the 65 RMSNorm weights (4,096 values) has >= 100,000
    # values; bitsandbytes keeps 2 bytes per value and an fp32 absmax per 256 for each moment
    st = stats_of(LLAMA31)
    big = st.n_params - 65 * 4096
    hand = 2 * big + 8 * big // 256  # every big tensor's size is a multiple of 256
    assert paged_state_bytes(LLAMA31, {"optimizer": "paged_adamw_8bit"}) == hand
    assert paged_state_bytes(LLAMA31, {"optimizer": "adamw_8bit"}) == 0
    frozen = {"optimizer": "paged_adamw_8bit", "quantization": "nf4"}
    assert paged_state_bytes(LLAMA31, frozen) == 0


def test_the_spill_follows_from_the_budget() -> None:
    gib = 2**30
    # 34 GiB with every state resident, 15 GiB of them paged, a 24 GiB budget: 10 GiB spill
    p = page(34 * gib, 15 * gib, 24 * gib)
    assert (p.peak, p.on_host, p.allocator_peak, p.fits) == (24 * gib, 10 * gib, 19 * gib, True)
    # within the budget nothing moves
    assert page(20 * gib, 15 * gib, 24 * gib).on_host == 0
    # more to spill than is paged: it does not fit, every paged byte on the host
    q = page(45 * gib, 15 * gib, 24 * gib)
    assert (q.fits, q.on_host, q.peak) == (False, 15 * gib, 30 * gib)
    # migrated each way at once over PCIe 4 x16 (32 GB/s at 80%): 10 GiB in 0.42 s
    assert p.seconds(GPUS["rtx4090"]) == pytest.approx(10 * gib / (32e9 * 0.8))


def test_apply_budget_moves_the_spill_to_the_host_and_prices_its_transfer() -> None:
    gib = 2**30
    paged = paged_state_bytes(LLAMA31, {"optimizer": "paged_adamw_8bit"})
    peak = paged + 12 * gib
    est = Estimate(peak, {"optimizer_states": paged}, tokens_per_s=1000.0, step_time_s=4.0)
    workload = Workload(LLAMA31, 2048, 2, gpu=GPUS["rtx4090"])
    p = apply_budget(est, workload, {"optimizer": "paged_adamw_8bit"}, 20 * gib)
    assert p is not None
    spill = peak - 20 * gib
    assert est.peak_bytes == 20 * gib
    assert est.host_breakdown["offloaded states"] == spill
    assert est.breakdown["optimizer_states"] == paged - spill
    extra = spill / (32e9 * 0.8)
    assert est.step_time_s == pytest.approx(4.0 + extra)
    assert est.tokens_per_s == pytest.approx(4000.0 / (4.0 + extra))


def test_the_estimate_backend_pages_where_the_states_do_not_fit() -> None:
    from autotune.estimator.exhaustive import score

    config = {**BASE, "optimizer": "paged_adamw_8bit", "micro_batch_size": 1}
    config["gradient_checkpointing"] = "full"
    kw = {
        "seq_len_tokens": 512,
        "global_batch_sequences": 1,
        "processes": 1,
        "gpu": GPUS["rtx4090"],
    }
    full = AnalyticalEstimator().estimate(Workload(LLAMA7B, **kw), config)
    paged = paged_state_bytes(LLAMA7B, config)
    budget = full.peak_bytes - paged // 2
    (s,) = score(Workload(LLAMA7B, **kw), [config], budget_bytes=budget)
    assert s.fits and s.estimate.peak_bytes == budget
    assert s.estimate.host_bytes - full.host_bytes == paged // 2 + paged % 2
    (t,) = score(Workload(LLAMA7B, **kw), [config], budget_bytes=full.peak_bytes - paged - 1)
    assert not t.fits and t.why_not == "device memory"


# --- the speed model's fine-tuning terms ---------------------------------------------------------


def test_a_tiny_micro_batch_is_bound_by_the_cpus_launches() -> None:
    # tiny-llama, 8 tokens: the GPU's work is microseconds; the CPU launches 4 layers x (48
    # forward + 96 backward) operators at 10 us each: 5.76 ms per micro-batch
    t = step(TINY, seq=8, gbs=1, micro_batch_size=1)
    assert t.compute + t.memory + t.launch == pytest.approx(4 * 144 * 10e-6)
    # compiled: 35% of the launches remain
    c = step(TINY, seq=8, gbs=1, micro_batch_size=1, compile=True)
    assert c.compute + c.memory + c.launch == pytest.approx(0.35 * 4 * 144 * 10e-6)
    # a big micro-batch is not launch-bound
    assert step(LLAMA7B).launch == 0.0


def test_compile_fuses_the_element_wise_passes() -> None:
    # 1.5 instead of 4 passes over the kept activations (fused chains): the memory-bound part
    # of a step scales by 1.5 / 4 (the same kept bytes here: compile also keeps fewer)
    st = stats_of(LLAMA7B)
    acts = layer_activation_bytes(st, BASE, 2048, 4)
    gpu = GPUS["a100-80gb"]
    workload = Workload(LLAMA7B, 2048, 4, gpu=gpu)
    plain = speed.step_time(workload, BASE, acts)
    compiled = speed.step_time(workload, {**BASE, "compile": True}, acts)
    assert compiled.memory == pytest.approx(plain.memory * 1.5 / 4)
    assert compiled.compute == plain.compute


def test_low_bit_states_pay_their_quantisation_and_per_tensor_python() -> None:
    st = stats_of(LLAMA7B)
    hbm = 2039e9 * 0.75
    adamw, bnb = step(LLAMA7B).optimizer, step(LLAMA7B, optimizer="adamw_8bit").optimizer
    # AdamW moves 28 B/param; bitsandbytes 16 + 24 of (de)quantisation, and 20 launches' worth
    # of Python per tensor (291 tensors in llama-7b)
    assert adamw == pytest.approx(28 * st.n_params / hbm)
    assert bnb == pytest.approx(40 * st.n_params / hbm + len(st.shapes) * 20 * 10e-6)
    # the step in backward steps each tensor alone: torch's single-tensor AdamW's 12 ops
    inbwd = step(LLAMA7B, optimizer_in_backward=True, micro_batch_size=4).optimizer
    assert inbwd == pytest.approx(adamw + len(st.shapes) * 12 * 10e-6)


def test_clipping_reads_the_gradients_twice_and_writes_them_once() -> None:
    st = stats_of(LLAMA7B)
    config = {**BASE}
    acts = layer_activation_bytes(st, config, 2048, 4)
    gpu = GPUS["a100-80gb"]
    workload = Workload(LLAMA7B, 2048, 4, gpu=gpu)
    plain = speed.step_time(workload, config, acts)
    clipped = speed.step_time(workload, config, acts, clip=True)
    assert clipped.optimizer - plain.optimizer == pytest.approx(
        3 * 2 * st.n_params / (2039e9 * 0.75)
    )


def test_zero_offload_gradients_cross_pcie_every_micro_batch() -> None:
    # ZeRO-2 offload, llama-7b on one A100 (PCIe 4: 32 GB/s at 80%), 4 micro-batches: each
    # copies its 16-bit gradients out; after the first the host's fp32 sums go up and back;
    # the CPU-Adam step (30 B/param at 100 GB/s) and the 16-bit weights back
    psi = stats_of(LLAMA7B).n_params
    pcie = 32e9 * 0.8
    t = step(LLAMA7B, gbs=16, zero_stage=2, offload_optimizer="cpu")
    hand = 4 * 2 * psi / pcie + 3 * 8 * psi / pcie + 30 * psi / 100e9 + 2 * psi / pcie
    assert t.offload == pytest.approx(hand)
    # ZeRO-3 adds each micro-batch's gradients on the host: no round trip
    t3 = step(LLAMA7B, gbs=16, zero_stage=3, offload_optimizer="cpu")
    assert t3.offload == pytest.approx(hand - 3 * 8 * psi / pcie)


def test_side_stream_activation_offload_hides_behind_compute() -> None:
    st = stats_of(LLAMA7B)
    config = {**BASE, "gradient_checkpointing": "full", "activation_offload": "cpu"}
    acts = layer_activation_bytes(st, config, 2048, 4)
    gpu = GPUS["a100-80gb"]
    moved = 2 * 4096 * 4 * 2048 * 32  # the layers' 16-bit inputs, 4 x 2048 tokens
    workload = Workload(LLAMA7B, 2048, 4, gpu=gpu)
    compute = speed.step_time(workload, config, acts, moved)
    side = speed.step_time(workload, {**config, "activation_offload_stream": "side"}, acts, moved)
    assert compute.offload == pytest.approx(2 * moved / (32e9 * 0.8))
    assert side.offload == 0.0  # 1.1 GB in 43 ms each way, behind seconds of compute


def test_lora_on_a_bf16_base_skips_weight_gradients_without_dequantising() -> None:
    full, lora = step(LLAMA7B), step(LLAMA7B, adapter="lora", lora_rank=16)
    nf4 = step(LLAMA7B, quantization="nf4")
    # forward 2 + backward 2 (input gradients only) of 2 + 4 FLOPs per parameter per token
    assert lora.compute < 0.75 * full.compute
    assert nf4.memory > lora.memory  # the nf4 base is dequantised before every use


# --- the published benchmark's arithmetic ---------------------------------------------------------


def test_benchmark_rows_have_sources_and_the_ladder_keeps_its_directions() -> None:
    import finetune_anchors as fa

    assert all(r.source.startswith("https://github.com/pytorch/torchtune") for r in fa.ROWS)
    labels = {r.label for r in fa.ROWS}
    assert {"8B full, RTX 4090", "8B LoRA, RTX 4090", "8B QLoRA, RTX 4090"} <= labels
    rungs = [r for r in fa.ROWS if r.ladder]
    preds = [fa.predict(r) for r in rungs[1:6]]  # packing .. step in backward
    assert all(ok for _, ok, _ in fa.directions(preds))
    # the error is the prediction against the published figure
    p = preds[0]
    assert p.speed_error == pytest.approx(100 * (p.tokens_per_s / p.row.tokens_per_s - 1))


def test_benchmark_reports_rows_the_space_cannot_express_yet() -> None:
    import finetune_anchors as fa

    qlora = next(r for r in fa.ROWS if r.label == "8B QLoRA, RTX 4090")
    assert fa.not_expressible(qlora.config, qlora.gpu, 2) == ""
    assert "unknown_knob" in fa.not_expressible({"unknown_knob": 1}, "rtx4090", 2)
    # compile over quantized weights is forbidden by the space's rules
    why = fa.not_expressible({**qlora.config, "compile": True}, "rtx4090", 2)
    assert why and "not allowed" in why


def test_adapter_rows_are_priced_within_ten_percent_of_the_published_memory() -> None:
    """torchtune's published peaks (the allocator's) as the oracle: QLoRA's frozen head has no
    gradient under chunked cross-entropy, its nf4 weights are double-quantized (4.127 bits);
    torchtune's LoRA compiled, outside the estimate space (its adapters train eagerly), is priced
    by the estimator directly."""
    import finetune_anchors as fa

    for label in ("3B QLoRA", "8B LoRA, RTX 4090"):
        p = fa.predict(next(r for r in fa.ROWS if r.label == label))
        assert p.memory_error is not None and abs(p.memory_error) <= 10, (label, p.memory_gib)
    lora = fa.predict(next(r for r in fa.ROWS if r.label == "8B LoRA, RTX 4090"))
    assert "compile" in lora.why_not  # and says why the space leaves it out


def test_qlora_steps_its_adapters_not_the_frozen_head() -> None:
    """A quantized base with LoRA steps only the adapters: AdamW's temporaries at the step are an
    adapter's, not the frozen head's. A big head (32,000 x 128, 4.1M values: 16 MB per fp32
    temporary) over a small model and 8 tokens: the peak stays within the states plus one
    head-sized fp32 tensor, by hand."""
    model = {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }  # fmt: skip
    config = {**BASE, "quantization": "nf4", "micro_batch_size": 1}
    est = AnalyticalEstimator().estimate(
        Workload(model, seq_len_tokens=8, global_batch_sequences=1), config
    )
    states = est.breakdown["parameters"] + est.breakdown["optimizer_states"]
    assert est.peak_bytes - states < 4 * 32000 * 128, est.breakdown


def test_compiled_pure_bf16_rungs_are_priced_within_ten_percent_of_the_published_memory() -> None:
    """torchtune's Llama 3.2 3B table (the allocator's peak as published) as the oracle for the
    compiled rungs of a pure bf16 model: the compiled layers keep 8h + 2I bytes per token less
    (measured on a real compiled trial, tests/test_technique_compile.py), 8.8 GiB of 28 layers'
    8,192 tokens; the rungs keep their published direction."""
    import finetune_anchors as fa

    rows = {r.label: r for r in fa.ROWS}
    preds = [fa.predict(rows[f"3B {x}"]) for x in ("+ packing", "+ compile")]
    preds.append(fa.predict(rows["3B + chunked cross-entropy"]))
    for p in preds[1:]:
        assert p.memory_error is not None and abs(p.memory_error) <= 10, (p.row.label, p.memory_gib)
    assert all(mem for _, _, mem in fa.directions(preds))


def test_the_8bit_rung_is_torchaos_adamw8bit_with_its_compiled_step_temporaries() -> None:
    """torchtune's 3B "+ 8-bit AdamW" rung (17.6 GiB) against the three 8-bit AdamWs: paged
    bitsandbytes keeps its states out of the allocator's peak (far below), bitsandbytes' plain
    AdamW8bit has no step temporaries; torchao's AdamW8bit is the closest. Its states by hand from
    torchao's ``OptimState8bit`` (a uint8 code per value, an fp32 scale per 256, a 256-entry fp32
    code book, per moment) for Llama 3.2 3B's tensors, the 3,072-value norms (below 4,096) in
    bf16 moments; the temporaries two fp32 moments of the tied 128,256 x 3,072 embedding."""
    import finetune_anchors as fa

    row = next(r for r in fa.ROWS if r.label == "3B + 8-bit AdamW")
    assert row.config["optimizer"] == "adamw_torchao_8bit"
    h, kv, inter, vocab, layers = 3072, 1024, 8192, 128256, 28
    layer = [h * h, kv * h, kv * h, h * h, inter * h, inter * h, h * inter]
    matrices = [vocab * h] + layers * layer
    norms = (2 * layers + 1) * [h]
    states = sum(2 * (n + 4 * (n // 256) + 4 * 256) for n in matrices) + sum(4 * n for n in norms)
    model, gpu = MODELS[row.model].config, GPUS[row.gpu]
    workload = Workload(model, seq_len_tokens=row.seq, global_batch_sequences=2, gpu=gpu)
    est = AnalyticalEstimator().estimate(workload, row.config)
    assert est.breakdown["optimizer_states"] == states
    assert est.breakdown["temporaries"] == 2 * 4 * vocab * h
    errors = {}
    for optimizer in ("adamw_torchao_8bit", "adamw_8bit", "paged_adamw_8bit"):
        other = fa.Row(**{**vars(row), "config": {**row.config, "optimizer": optimizer}})
        errors[optimizer] = abs(fa.predict(other).memory_error or 0.0)
    assert min(errors, key=errors.__getitem__) == "adamw_torchao_8bit", errors
    assert errors["paged_adamw_8bit"] > 40, errors


def test_alpacas_rows_come_from_its_published_size() -> None:
    """The baseline's alpaca rows by hand: 47,764,738 bytes over 52,002 examples, less four
    4-byte string offsets: 902.5 characters, two copies of the content and one template (205
    characters with an input, 140 without, 40% with: 166); content 368.3, formatted row 534.3
    characters, 133.6 tokens at 4 a token, 144.6 with Llama 3's 11 chat tokens: rows of 50 to 239
    tokens have that mean."""
    import finetune_anchors as fa

    assert [len(t) for t in fa.ALPACA_TEMPLATES] == [205, 140]
    docs = fa.alpaca_documents()
    assert (docs.shortest, docs.longest) == (50, 239)
    baseline = next(r for r in fa.ROWS if r.label == "3B baseline")
    assert baseline.documents == docs
