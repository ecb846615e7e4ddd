"""Roofline speed model: the step time of one GPU, op class by op class.

``step_time`` prices plain training (matmuls, attention, element-wise work, dequantisation, the
optimizer step, the launch floor) and hands a ``trials.techniques.terms.SpeedStep`` to every
registered technique: ``kernels`` (recomputation, fused passes, launches) and then ``speed``
(communication, host copies), each in the technique's own module; the parts below name them.

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
  ZeRO 1-2's offloaded gradients are copied out in the reduction hooks on the compute stream
  (``stage_1_and_2.py``: ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), every
  micro-batch, and accumulated on the host through the GPU (the fp32 buffer up and back,
  ``async_accumulate_grad_in_cpu_via_gpu``) after the first: not overlapped (stage 3 copies
  each micro-batch's gradients out and adds them on the host).
* **QLoRA/LoRA**: int8/nf4 weights are dequantised to 16 bits before every use (forward and
  backward), a memory-bound pass over the quantized weights each time; a frozen base (LoRA,
  DoRA or QLoRA) skips the weight gradients.
* **step floor**: eager PyTorch launches every operator from the CPU (``LAUNCH_S`` each); the
  GPU runs them asynchronously, so a micro-batch takes the longer of the GPU's time and the
  CPU's launches (small micro-batches are launch-bound). ``compile`` fuses the element-wise
  chains into fewer kernels (``COMPILED_OPS``). The optimizer's per-tensor work
  (``TENSOR_STEP_OPS``: launches per parameter tensor of its step; the step in backward steps
  each tensor alone) and gradient clipping (a norm over every gradient, then a scaling pass)
  add to the step.
* **compile** also fuses the element-wise work: ``COMPILED_ELEMENTWISE_PASSES`` instead of
  ``ELEMENTWISE_PASSES`` over the kept activations.
* **low-bit optimizer states** are dequantised and requantised block-wise in the step
  (``QUANT_STEP_BYTES``: the kernels' extra cost, in HBM-equivalent bytes per parameter).
* **paged optimizer states** (bitsandbytes' paged optimizers, ``autotune.estimator.paging``):
  the states that do not fit the device budget migrate each step, in (prefetched before each
  tensor's update) while as many bytes are evicted, on a full-duplex PCIe link: ``migrated /
  PCIe`` per step, not overlapped (bitsandbytes synchronises after each paged tensor).
* **attention kernels at long sequences**: FlashAttention-2 and sdpa without a mask run the same
  flash kernel; sdpa given a mask (packed or padded rows without FlashAttention-2's varlen
  path) falls back to the memory-efficient kernel, about half as fast (``FLASH_EFFICIENCY``).

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
from trials.techniques import TECHNIQUES, setting
from trials.techniques.adapter import adapts, rank_of
from trials.techniques.fsdp import RESHARD, fsdp_mode, offloads_shards
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.offload import offloads_optimizer
from trials.techniques.precision import pure_bf16
from trials.techniques.terms import SpeedStep

#: fraction of the dense tensor-core (or fp32) peak that training's GEMMs reach, per GPU
#: generation (CUDA major: 7 Volta, 8 Ampere/Ada, 9 Hopper), fitted to the published figures of
#: benchmarks/speed_calibration.py: Hopper's higher peak is reached less of the time
MATMUL_EFFICIENCY = {7: 0.30, 8: 0.72, 9: 0.44}
DEFAULT_MATMUL_EFFICIENCY = 0.6
#: per compute capability where one differs from its generation: consumer Ada (SM 8.9) fitted
#: to torchtune's RTX 4090 rows (benchmarks/finetune_anchors.py: LoRA at 3,083 tokens/s needs
#: about 85% of its FP32-accumulate peak)
MATMUL_EFFICIENCY_SM = {(8, 9): 0.85}
#: fraction of the datasheet bandwidths reached by memory-bound kernels and by NCCL rings
HBM_EFFICIENCY = 0.75
COMM_EFFICIENCY = 0.70
PCIE_EFFICIENCY = 0.80
#: reads + writes of a layer's kept activations by its non-matmul ops, forward and backward
ELEMENTWISE_PASSES = 4.0
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
#: pure bf16 (no fp32 masters): the step reads and writes 16-bit weights and reads 16-bit
#: gradients, 3 x 2 bytes per parameter fewer than ``OPTIMIZER_STEP_BYTES`` counts
PURE16_SAVED_BYTES = 6
QUANT_BYTES = {"int8": 1.0, "nf4": 0.53}
#: CPU time eager PyTorch spends per operator it launches (Python, dispatcher, cudaLaunchKernel):
#: about 10 us (PyTorch's "Accelerating PyTorch with CUDA Graphs" post, 2021: the CPU
#: overhead per kernel launch is what CUDA graphs remove; torch's profiler shows 5-20 us per
#: aten op on a training step)
LAUNCH_S = 10e-6
#: aten operators one decoder layer runs in forward: two RMSNorms of 6 ops (pow, mean, add,
#: rsqrt, mul, weight mul) and their casts, 7 linears, RoPE on q and k (slices, neg, cat, two
#: muls and an add each), the views and transposes around attention, sdpa, SiLU, the gate
#: product, two residual adds (transformers' LlamaDecoderLayer: about 48); backward about
#: twice as many
LAYER_OPS_FORWARD = 48
LAYER_OPS_BACKWARD = 96
#: launches per parameter tensor of the optimizer's step: torch's AdamW steps every tensor with
#: foreach kernels over the whole list (none per tensor) unless each tensor is stepped alone
#: (the step in backward: about 12 ops each, torch's single-tensor AdamW); bitsandbytes' 8-bit
#: optimizers run one kernel per tensor behind about 200 us of Python (``Optimizer8bit.step``:
#: the per-tensor config lookup, ``prefetch_state``, the ctypes call of
#: ``optimizer_update_8bit_blockwise`` with its argument checks): 20 launches' worth; torchao's
#: compiled per-tensor step about 3
TENSOR_STEP_OPS = {
    "adamw": 0,
    "adafactor": 0,
    "lion": 0,
    "adamw_8bit": 20,
    "paged_adamw_8bit": 20,
    "adamw_torchao_8bit": 3,
    "adamw_torchao_4bit": 3,
}
#: block-wise (de)quantisation of low-bit optimizer states in the step, as HBM-equivalent bytes
#: per parameter beyond the bytes the step moves: each moment's code looked up (dequantised to
#: fp32) and its new value searched in the 256-entry code book, with a block's absmax reduced
#: first (bitsandbytes' ``kOptimizerStatic8bit2StateBlockwise``): about the cost of moving the
#: two moments in fp32 once more (16 B) plus the block reductions (8 B); with the per-tensor
#: Python above, torchtune's Llama 3.2 3B table's +8-bit AdamW rung (7,309 -> 6,960 tokens/s,
#: 4.8% slower) comes out slower, where the bytes alone would make it faster. 4-bit (two codes
#: a byte, 128-value blocks) taken 1.25x the 8-bit cost (no published figure)
QUANT_STEP_BYTES = {
    "adamw_8bit": 24,
    "paged_adamw_8bit": 24,
    "adamw_torchao_8bit": 24,
    "adamw_torchao_4bit": 30,
}
#: gradient clipping (``clip_grad_norm_``): the norm reads every gradient, the scaling reads and
#: writes them: 3 passes over the gradients' bytes
CLIP_PASSES = 3
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
    #: launch-bound time beyond the GPU's (the per-step floor)
    launch: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.memory
            + self.optimizer
            + self.communication
            + self.offload
            + self.launch
        )


def matmul_efficiency(gpu: GpuSpec) -> float:
    if gpu.sm in MATMUL_EFFICIENCY_SM:
        return MATMUL_EFFICIENCY_SM[gpu.sm]
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
    clip: bool = False,
) -> StepTime:
    """The roofline of one step (``global_batch_size`` sequences per GPU); ``shape``: a
    typical micro-batch of variable-length data (``trials.data``), rows x length positions;
    ``clip``: gradients clipped by norm before the step. Paged optimizer states' migration is
    added where the budget is known (``autotune.estimator.paging.apply_budget``)."""
    config = zero_equivalent(config)
    precision = str(setting(config, "precision"))
    half = precision in ("bf16", "fp16")
    wbytes = 2 if half else 4
    peak = gpu.flops_per_s(precision) * matmul_efficiency(gpu)
    hbm = gpu.hbm_gbps * GB * HBM_EFFICIENCY
    micro, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    tokens = micro * seq_len  # per micro-batch (positions, padding included)
    if shape is not None:
        tokens, seq_len = shape.positions, shape.length
    n = max(1, nproc)
    stage = int(setting(config, "zero_stage") or 0)
    quant = str(setting(config, "quantization") or "none")
    frozen = quant != "none" or adapts(config)
    attention = str(setting(config, "attention"))
    optimizer = str(setting(config, "optimizer"))

    # --- per micro-batch: forward, backward ----------------------------------------------------
    per_layer_mm = st.layer_matrix_params + st.expert_params * max(1, st.top_k) // max(
        1, st.experts
    )
    mm_params = st.layers * per_layer_mm + st.vocab * st.hidden  # + the LM head
    weights_read = wbytes * mm_params if quant == "none" else 2 * mm_params
    fwd_mm = _roof(2 * tokens * mm_params, weights_read, peak, hbm)
    bwd_factor = 1 if frozen else 2  # frozen base: input gradients only
    bwd_mm = _roof(2 * bwd_factor * tokens * mm_params, bwd_factor * weights_read, peak, hbm)
    q = st.heads * st.head_dim
    attn_fwd_flops = 4 * seq_len * q * tokens * st.layers
    if attention == "eager":
        attn_fwd = attn_fwd_flops / peak
        attn_bwd = 2 * attn_fwd
    else:  # fused kernels: causal half skipped, backward recomputes the scores (2.5x forward)
        kernel = attention
        if attention == "sdpa" and shape is not None:
            kernel = "sdpa_masked"  # packed or padded rows: sdpa gets a mask
        attn_fwd = attn_fwd_flops / 2 / (peak * FLASH_EFFICIENCY.get(kernel, 1.0))
        attn_bwd = 2.5 * attn_fwd
    dequant = 0.0
    if quant != "none":
        qbytes = QUANT_BYTES.get(quant, 1.0)
        quantized = st.linear_params  # not the experts
        dequant = 2 * (qbytes + 2) * quantized / hbm  # forward and backward, read + write
    step = SpeedStep(
        config=config,
        stats=st,
        gpu=gpu,
        nproc=n,
        accum=accum,
        tokens=tokens,
        seq_len=seq_len,
        half=half,
        wbytes=wbytes,
        peak=peak,
        hbm=hbm,
        pcie=gpu.pcie_gbps * GB * PCIE_EFFICIENCY,
        link=gpu.interconnect_gbps * GB * COMM_EFFICIENCY,
        layer_act_bytes=layer_act_bytes,
        fwd_mm=fwd_mm,
        bwd_mm=bwd_mm,
        attn_fwd=attn_fwd,
        attn_bwd=attn_bwd,
        dequant=dequant,
        elementwise_passes=ELEMENTWISE_PASSES,
        offloaded_activations=offloaded_activations,
        per_tensor_ops=TENSOR_STEP_OPS.get(optimizer, 0),
    )
    # recomputation, fused kernels, launches; then communication and host copies on top
    TECHNIQUES.kernel_terms(step)
    TECHNIQUES.speed_terms(step)
    bwd = step.bwd
    psi = st.n_params

    # --- optimizer step on the device -------------------------------------------------------------
    off_opt = offloads_optimizer(config)
    step_bytes = OPTIMIZER_STEP_BYTES.get(optimizer, 28) + QUANT_STEP_BYTES.get(optimizer, 0)
    if pure_bf16(config):  # the weight read and written, its gradient read: 2 bytes, not 4
        step_bytes -= PURE16_SAVED_BYTES
    if frozen:
        rank = rank_of(config)
        trainable = 2 * rank * (st.layers * (st.layer_matrix_params // max(1, st.hidden)) + 1)
        tensors = 2 * st.layers * 7  # an A and a B per adapted linear
    else:
        trainable = psi // (n if stage >= 1 else 1)
        tensors = len(st.shapes)
    opt_s = 0.0 if off_opt else (step_bytes + (2 if stage >= 1 and half else 0)) * trainable / hbm
    if precision == "fp16" and not frozen:  # loss scaling: unscale and check every gradient
        opt_s += 8 * psi / hbm
    if not off_opt and stage == 0:  # DeepSpeed steps its flat partitions
        opt_s += tensors * step.per_tensor_ops * LAUNCH_S
    if clip:
        opt_s += CLIP_PASSES * (2 if half else 4) * trainable / hbm

    # --- the per-step floor: the CPU's launches against the GPU's time per micro-batch ---------
    elementwise, recompute_compute = step.elementwise, step.recompute_compute
    recompute_memory = step.recompute_memory
    gpu_micro = step.fwd_all + bwd
    ops = st.layers * (LAYER_OPS_FORWARD * (1 + step.recompute_share) + LAYER_OPS_BACKWARD)
    ops *= step.ops_factor
    launch = max(0.0, ops * LAUNCH_S - gpu_micro)

    return StepTime(
        compute=accum * (fwd_mm + attn_fwd + recompute_compute + bwd_mm + attn_bwd),
        memory=accum
        * (elementwise / 3 + dequant / 2 + recompute_memory + 2 * elementwise / 3 + dequant / 2),
        optimizer=opt_s,
        communication=accum * step.comm_micro_exposed + step.comm_step,
        offload=step.offload + step.activation_copies,
        launch=accum * launch,
    )


#: fused attention kernels' efficiency relative to the GEMMs (FlashAttention-2 reaches about the
#: GEMM efficiency on A100/H100; sdpa's CUDA path dispatches to the same flash kernels)
#: given a mask sdpa falls back to the memory-efficient (xformers/cutlass) kernel, about half
#: FlashAttention-2's speed (Dao 2023, FlashAttention-2, figure 4: 2x over xformers' cutlass
#: kernel on A100)
FLASH_EFFICIENCY = {"flash_attention_2": 1.0, "sdpa": 0.9, "sdpa_masked": 0.5}


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
    micro = int(setting(config, "micro_batch_size", global_batch_size))
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
        "launch": t.launch,
    }
    return est
