"""Roofline speed model: step time from FLOPs, memory traffic, ZeRO communication and offload.

* compute: 6 Psi per token (forward 2 + backward 4) plus the attention score/context matmuls
  (12 L s h per token), + one more forward for full recompute (2 Psi + 4 L s h), 1/k of it for
  checkpointing every k-th layer; LoRA on a frozen quantized base skips the weight gradients
  (4 Psi); at ``MFU`` of the GPU's dense peak for the compute precision.
* memory-bound parts at HBM bandwidth: weights read three times per micro-batch, the optimizer
  reading and writing weights, gradients and states once per step, eager attention's s x s
  score matrices (about four passes over them).
* ZeRO communication over NVLink (or PCIe without it): stages 0-2 move 2 Psi x bytes per step
  (ring all-reduce / reduce-scatter + all-gather), stage 3 moves 3 Psi x bytes (parameter
  all-gather in forward and backward plus gradient reduce-scatter); not overlapped.
* offload over PCIe: optimizer offload sends gradients down and weights up once per step and
  runs the CPU Adam at ``CPU_ADAM_PARAMS_PER_S``; parameter offload brings the weights up
  twice per micro-batch.
"""

from __future__ import annotations

from typing import Any

from autotune.estimator.base import Estimate
from autotune.estimator.gpus import GpuSpec
from autotune.estimator.states import numel, param_shapes, uses_deepspeed

MFU = 0.45  # model FLOPs utilisation typical of well-tuned dense training (PaLM, MegatronLM)
CPU_ADAM_PARAMS_PER_S = 1.0e9  # DeepSpeed CPU-Adam on a server host, order of magnitude
EAGER_SCORE_PASSES = 4
GB = 1e9


def roofline(
    est: Estimate,
    model_cfg: dict[str, Any],
    config: dict[str, Any],
    seq_len: int,
    global_batch_size: int,
    nproc: int,
    gpu: GpuSpec,
) -> Estimate:
    """Fill ``est.step_time_s`` and ``est.tokens_per_s`` (all GPUs) for ``gpu``."""
    n_params = sum(numel(s) for s in param_shapes(model_cfg))
    layers = int(model_cfg["num_hidden_layers"])
    h = int(model_cfg["hidden_size"])
    heads = int(model_cfg["num_attention_heads"])
    precision = str(config.get("precision", "fp32"))
    half = precision in ("bf16", "fp16")
    wbytes = 2 if half else 4
    micro = int(config.get("micro_batch_size", global_batch_size))
    accum = max(1, global_batch_size // micro)
    tokens = global_batch_size * seq_len  # per GPU per step
    n = max(1, nproc)
    stage = int(config.get("zero_stage", 0) or 0)
    quant = str(config.get("quantization", "none") or "none") != "none"

    dense = (4 if quant else 6) * n_params
    attn = 12 * layers * seq_len * h
    flops_tok = float(dense + attn)
    ckpt = str(config.get("gradient_checkpointing", "off"))
    if ckpt != "off":
        every = 1 if ckpt == "full" else int(config.get("checkpoint_every", 2))
        flops_tok += (2 * n_params + attn / 3) / every
    compute_s = flops_tok * tokens / (gpu.flops_per_s(precision) * MFU)

    state_bytes = sum(est.breakdown.get(k, 0) for k in ("parameters", "gradients"))
    state_bytes += est.breakdown.get("optimizer_states", 0)
    hbm = 3 * wbytes * n_params * accum + 2 * state_bytes
    if config.get("attention") == "eager":
        hbm += EAGER_SCORE_PASSES * 2 * layers * heads * seq_len**2 * global_batch_size
    hbm_s = hbm / (gpu.hbm_gbps * GB)

    comm_s = 0.0
    if n > 1:
        volume = (3 if stage >= 3 else 2) * wbytes * n_params * (n - 1) / n
        comm_s = volume / (gpu.interconnect_gbps * GB)
    offload_s = 0.0
    if config.get("offload_optimizer", "none") == "cpu" and uses_deepspeed(config):
        offload_s += (wbytes + 4) * n_params / n / (gpu.pcie_gbps * GB)
        offload_s += n_params / n / CPU_ADAM_PARAMS_PER_S
    if config.get("offload_param", "none") == "cpu" and stage >= 3:
        offload_s += 2 * accum * wbytes * n_params / n / (gpu.pcie_gbps * GB)

    step = compute_s + hbm_s + comm_s + offload_s
    est.step_time_s = step
    est.tokens_per_s = tokens * n / step
    est.gpu = gpu.name
    return est
