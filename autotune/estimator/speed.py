"""Roofline speed model: the step time of one GPU, op class by op class.

Every part is FLOPs at the GPU's peak times an efficiency, or bytes at a link's bandwidth times
an efficiency, whichever is slower (a roofline per op class):

* **matmuls** (the linears, the LM head): 2 FLOPs per parameter per token forward, 4 backward
  (input and weight gradients; frozen weights - LoRA/QLoRA's base - skip the weight gradient),
  against reading the weights once per pass: ``max(FLOPs / (peak x MATMUL_EFFICIENCY), bytes /
  (HBM x HBM_EFFICIENCY))``. fp32 runs at the plain fp32 rate (PyTorch's default for fp32
  matmuls is no TF32); bf16/fp16 at the tensor-core rate; MoE layers multiply with ``top_k``
  experts per token.
* **attention**: QK^T and PV, 4 s d FLOPs per token per head forward, twice that backward;
  flash/sdpa kernels skip the masked half of a causal product and recompute in backward (2.5x);
  eager attention also pays for writing and reading the s x s scores (softmax, dropout, their
  gradients) at HBM bandwidth.
* **everything else** (norms, activations, residuals, RoPE, softmax of the loss): memory
  bound, ``ELEMENTWISE_PASSES`` reads/writes of the bytes a layer keeps for backward.
* **checkpointing** recomputes the forward of every checkpointed layer, less the ops it saves
  (``checkpoint_save``: the attention kernel, or also every matmul); chunked cross-entropy
  recomputes the LM head's matmul.
* **optimizer step**: bytes moved per parameter (AdamW 28: read p, g, m, v, write p, m, v;
  DeepSpeed adds the 16-bit copy) over the GPU's shard.
* **ZeRO communication** over NVLink (or PCIe), ring algorithms, at ``COMM_EFFICIENCY``:
  stage 0 (DDP) all-reduces fp32 gradients once per step, overlapped with backward; stages 1-2
  reduce-scatter 16-bit gradients each micro-batch (overlapped with backward) and all-gather the
  updated weights after the step; stage 3 all-gathers the weights in forward and in backward and
  reduce-scatters gradients per micro-batch, prefetched (overlapped with compute).
* **CPU offload** (ZeRO-Offload): 16-bit gradients to the host over PCIe (overlapped with
  backward), the CPU-Adam step bounded by the host's memory bandwidth (about 30 bytes per
  parameter), the updated 16-bit weights back over PCIe; ``offload_param`` brings each layer's
  weights up over PCIe in forward and backward, prefetched. Offloaded activations cross PCIe
  twice per micro-batch (to the host in forward, back in backward), not overlapped: the copies
  run on the compute stream, as ``save_on_cpu`` and the trial job's hooks make them.
* **QLoRA/LoRA**: int8/nf4 weights are dequantised to 16 bits before every use (forward and
  backward), a memory-bound pass over the quantized weights each time.

The efficiencies are calibrated once against published throughputs
(``benchmarks/speed_calibration.py``, where each figure, the prediction and the error are
listed); their median error is ``MODEL_ERROR``, and configurations whose predicted speeds differ
by less than it are reported as ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.estimator.activations import layer_activation_bytes
from autotune.estimator.base import Estimate
from autotune.estimator.gpus import GpuSpec
from autotune.models import ModelStats, stats_of
from trials.data import Documents, Shape, micro_shapes
from trials.techniques.checkpointing import saved_ops
from trials.techniques.cross_entropy import is_chunked
from trials.techniques.fsdp import RESHARD, fsdp_mode, offloads_shards
from trials.techniques.micro_batch import micro_and_accumulation

#: fraction of the dense tensor-core (or fp32) peak that training's GEMMs reach, per GPU
#: generation (CUDA major: 7 Volta, 8 Ampere/Ada, 9 Hopper), fitted to the published figures of
#: benchmarks/speed_calibration.py: Hopper's higher peak is reached less of the time
MATMUL_EFFICIENCY = {7: 0.30, 8: 0.72, 9: 0.44}
DEFAULT_MATMUL_EFFICIENCY = 0.6
#: fraction of the datasheet bandwidths reached by memory-bound kernels and by NCCL rings
HBM_EFFICIENCY = 0.75
COMM_EFFICIENCY = 0.70
PCIE_EFFICIENCY = 0.80
#: reads + writes of a layer's kept activations by its non-matmul ops, forward and backward
ELEMENTWISE_PASSES = 4.0
#: host memory bandwidth CPU-Adam reaches on a training server (DDR4/5, several channels)
HOST_MEMORY_GBPS = 100.0
#: optimizer step bytes moved per parameter on the device: fp32 weight read and written, its
#: gradient read, the states read and written (8-bit: a byte per moment, 4-bit half of it)
OPTIMIZER_STEP_BYTES = {
    "adamw": 28,
    "adafactor": 16,
    "lion": 20,
    "adamw_8bit": 16,
    "paged_adamw_8bit": 16,
    "adamw_torchao_8bit": 16,
    "adamw_torchao_4bit": 14,
}
CPU_ADAM_BYTES = 30  # fp32 p, g, m, v read; p, m, v and the 16-bit copy written
QUANT_BYTES = {"int8": 1.0, "nf4": 0.53}
#: speeds closer than this are not told apart: the calibration's median |error| rounded up
#: (benchmarks/speed_calibration.py: 4.2%, in-sample)
MODEL_ERROR = 0.06
GB = 1e9


@dataclass
class StepTime:
    """Seconds per optimizer step on one GPU, by part."""

    compute: float = 0.0
    memory: float = 0.0
    optimizer: float = 0.0
    communication: float = 0.0
    offload: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.optimizer + self.communication + self.offload


def matmul_efficiency(gpu: GpuSpec) -> float:
    return MATMUL_EFFICIENCY.get(gpu.sm[0], DEFAULT_MATMUL_EFFICIENCY)


def _roof(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    return max(flops / flops_per_s, nbytes / bytes_per_s)


def zero_equivalent(config: dict[str, Any]) -> dict[str, Any]:
    """FSDP2's traffic priced as the ZeRO stage that moves the same bytes: full_shard gathers
    each block in forward and again in backward and reduce-scatters its gradients (stage 3's
    volume, 1.5x DDP's all-reduce); shard_grad_op gathers once per step (stage 2's);
    ``fsdp_offload`` keeps the shards on the host and steps there (ZeRO-Offload's PCIe copies
    and host step, at the same bytes though torch's AdamW runs there, not DeepSpeed's AVX Adam).
    Any other config: itself."""
    mode = fsdp_mode(config)
    if mode not in RESHARD:
        return config
    out = {**config, "zero_stage": 3 if RESHARD[mode] else 2}
    if offloads_shards(config):
        out.update(offload_optimizer="cpu", offload_param="cpu")
    return out


def step_time(
    st: ModelStats,
    config: dict[str, Any],
    seq_len: int,
    global_batch_size: int,
    nproc: int,
    gpu: GpuSpec,
    layer_act_bytes: int,
    offloaded_activations: int = 0,
    shape: Shape | None = None,
) -> StepTime:
    """The roofline of one step (``global_batch_size`` sequences per GPU); ``shape``: a
    typical micro-batch of variable-length data (``trials.data``), rows x length positions."""
    config = zero_equivalent(config)
    precision = str(config.get("precision", "fp32"))
    half = precision in ("bf16", "fp16")
    wbytes = 2 if half else 4
    peak = gpu.flops_per_s(precision) * matmul_efficiency(gpu)
    hbm = gpu.hbm_gbps * GB * HBM_EFFICIENCY
    micro, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    tokens = micro * seq_len  # per micro-batch (positions, padding included)
    if shape is not None:
        tokens, seq_len = shape.positions, shape.length
    n = max(1, nproc)
    stage = int(config.get("zero_stage", 0) or 0)
    quant = str(config.get("quantization", "none") or "none")
    frozen = quant != "none"
    attention = str(config.get("attention", "sdpa"))
    optimizer = str(config.get("optimizer", "adamw"))

    # --- per micro-batch: forward, backward, recompute -----------------------------------------
    per_layer_mm = st.layer_matrix_params + st.expert_params * max(1, st.top_k) // max(
        1, st.experts
    )
    mm_params = st.layers * per_layer_mm + st.vocab * st.hidden  # + the LM head
    weights_read = wbytes * mm_params if not frozen else 2 * mm_params
    fwd_mm = _roof(2 * tokens * mm_params, weights_read, peak, hbm)
    bwd_factor = 1 if frozen else 2  # frozen base: input gradients only
    bwd_mm = _roof(2 * bwd_factor * tokens * mm_params, bwd_factor * weights_read, peak, hbm)
    q = st.heads * st.head_dim
    attn_fwd_flops = 4 * seq_len * q * tokens * st.layers
    if attention == "eager":
        attn_fwd = attn_fwd_flops / peak
        attn_bwd = 2 * attn_fwd
    else:  # fused kernels: causal half skipped, backward recomputes the scores (2.5x forward)
        attn_fwd = attn_fwd_flops / 2 / (peak * FLASH_EFFICIENCY.get(attention, 1.0))
        attn_bwd = 2.5 * attn_fwd
    elementwise = ELEMENTWISE_PASSES * layer_act_bytes * st.layers / hbm
    dequant = 0.0
    if frozen:
        qbytes = QUANT_BYTES.get(quant, 1.0)
        quantized = st.linear_params  # not the experts
        dequant = 2 * (qbytes + 2) * quantized / hbm  # forward and backward, read + write
    bwd = bwd_mm + attn_bwd + 2 * elementwise / 3 + dequant / 2
    ckpt = str(config.get("gradient_checkpointing", "off"))
    # checkpointing recomputes the forward of 1 in ``every`` layers
    rc = (
        0.0
        if ckpt == "off"
        else 1 / (1 if ckpt == "full" else int(config.get("checkpoint_every", 2)))
    )
    # what a checkpointed layer saves per op it does not recompute; chunked cross-entropy runs
    # the LM head's matmul again in backward
    save = saved_ops(config)
    head_flops = 2 * tokens * st.vocab * st.hidden
    recompute_compute = rc * (
        (0.0 if save == "matmuls" else fwd_mm) + (0.0 if save != "none" else attn_fwd)
    ) + (_roof(head_flops, wbytes * st.vocab * st.hidden, peak, hbm) if is_chunked(config) else 0.0)
    recompute_memory = rc * (elementwise / 3 + dequant / 2)
    fwd_all = (
        fwd_mm + attn_fwd + elementwise / 3 + dequant / 2 + recompute_compute + recompute_memory
    )

    # --- ZeRO communication per micro-batch and per step ---------------------------------------
    link = gpu.interconnect_gbps * GB * COMM_EFFICIENCY
    ring = (n - 1) / n
    psi = st.n_params
    comm_micro_exposed = 0.0
    comm_step = 0.0
    if n > 1:
        if stage == 0:  # DDP: fp32 gradients all-reduced once, in buckets during backward
            comm_step = max(0.0, 2 * ring * 4 * psi / link - bwd)
        elif stage in (1, 2):
            reduce = ring * wbytes * psi / link
            comm_micro_exposed = max(0.0, reduce - bwd) if stage == 2 else 0.0
            comm_step = ring * wbytes * psi / link + (reduce if stage == 1 else 0.0)
        else:  # gathers in forward and backward, reduce-scatter in backward, all prefetched
            gather = ring * wbytes * psi / link
            comm_micro_exposed = max(0.0, gather - fwd_all) + max(0.0, 2 * gather - bwd)

    # --- CPU offload ----------------------------------------------------------------------------
    pcie = gpu.pcie_gbps * GB * PCIE_EFFICIENCY
    offload = 0.0
    off_opt = config.get("offload_optimizer", "none") == "cpu" and stage >= 1
    off_param = config.get("offload_param", "none") == "cpu" and stage >= 3
    shard = psi / n
    if off_opt:
        grads_down = wbytes * shard / pcie
        offload += max(0.0, grads_down - bwd)  # copied out as buckets fill during backward
        offload += CPU_ADAM_BYTES * shard / (HOST_MEMORY_GBPS * GB)  # the GPUs of a host share it
        offload += wbytes * shard / pcie  # updated weights back up
    if off_param:
        fetch = wbytes * shard / pcie
        comm_micro_exposed += max(0.0, fetch - fwd_all) + max(0.0, fetch - bwd)
    # offloaded activations: out in forward, back in backward, on the compute stream
    offload += accum * 2 * offloaded_activations / pcie

    # --- optimizer step on the device -------------------------------------------------------------
    step_bytes = OPTIMIZER_STEP_BYTES.get(optimizer, 28)
    if frozen:
        trainable = 2 * 8 * (st.layers * (st.layer_matrix_params // max(1, st.hidden)) + 1)
    else:
        trainable = psi // (n if stage >= 1 else 1)
    opt_s = 0.0 if off_opt else (step_bytes + (2 if stage >= 1 and half else 0)) * trainable / hbm
    if precision == "fp16" and not frozen:  # loss scaling: unscale and check every gradient
        opt_s += 8 * psi / hbm

    return StepTime(
        compute=accum * (fwd_mm + attn_fwd + recompute_compute + bwd_mm + attn_bwd),
        memory=accum
        * (elementwise / 3 + dequant / 2 + recompute_memory + 2 * elementwise / 3 + dequant / 2),
        optimizer=opt_s,
        communication=accum * comm_micro_exposed + comm_step,
        offload=offload,
    )


#: fused attention kernels' efficiency relative to the GEMMs (FlashAttention-2 reaches about the
#: GEMM efficiency on A100/H100; sdpa's CUDA path dispatches to the same flash kernels)
FLASH_EFFICIENCY = {"flash_attention_2": 1.0, "sdpa": 0.9}


def roofline(
    est: Estimate,
    model_cfg: dict[str, Any],
    config: dict[str, Any],
    seq_len: int,
    global_batch_size: int,
    nproc: int,
    gpu: GpuSpec,
    offloaded_activations: int = 0,
    layer_act_bytes: int | None = None,
    documents: Documents | None = None,
) -> Estimate:
    """Fill ``est.step_time_s`` and ``est.tokens_per_s`` (all GPUs) for ``gpu``;
    ``offloaded_activations``: bytes per micro-batch one rank moves to the host and back;
    ``documents``: variable-length data, timed at a typical micro-batch (only its real tokens
    count)."""
    st = stats_of(model_cfg)
    micro = int(config.get("micro_batch_size", global_batch_size))
    shape = None
    if documents is not None:
        shape = micro_shapes(config, seq_len, global_batch_size, documents, nproc)[1]
        micro, seq_len = shape.rows, shape.length
    if layer_act_bytes is None:
        layer_act_bytes = layer_activation_bytes(st, config, seq_len, micro)
    t = step_time(
        st,
        config,
        seq_len,
        global_batch_size,
        nproc,
        gpu,
        layer_act_bytes,
        offloaded_activations,
        shape,
    )
    est.step_time_s = t.total
    _, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    real = shape.tokens * accum if shape is not None else global_batch_size * seq_len
    est.tokens_per_s = real * max(1, nproc) / t.total
    est.gpu = gpu.name
    est.time_breakdown = {
        "compute": t.compute,
        "memory": t.memory,
        "optimizer": t.optimizer,
        "communication": t.communication,
        "offload": t.offload,
    }
    return est
