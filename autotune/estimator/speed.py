"""Roofline speed model: the step time of one GPU, op class by op class.

``step_time`` prices plain training (matmuls, attention as plain math, element-wise work, the
optimizer step's bytes, the launch floor) and hands a ``trials.techniques.terms.SpeedStep`` to
every registered technique: ``operators`` (the weights a matmul reads, a frozen base, the
attention kernel, dequantisation, the optimizer step's bytes, values and tensors), ``kernels``
(recomputation, fused passes, launches) and then ``speed`` (communication, host copies, loss
scaling), each in the technique's own module, whose figures the parts below describe; a
technique that moves another's bytes is priced as that one (``Technique.priced_as``: FSDP2 as
a ZeRO stage).

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
from autotune.estimator.workload import Workload
from autotune.models import stats_of
from trials.data import Shape, micro_shapes
from trials.techniques import TECHNIQUES
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.precision import computes_in_16_bits, precision_of
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


def step_time(
    workload: Workload,
    config: dict[str, Any],
    layer_act_bytes: int,
    offloaded_activations: int = 0,
    clip: bool = False,
) -> StepTime:
    """The roofline of one step on the workload's GPU (its global batch over its processes);
    variable-length data (the workload's ``documents``) is timed at a typical micro-batch
    (``trials.data.micro_shapes``), rows x length positions; ``clip``: gradients clipped by
    norm before the step. Paged optimizer states' migration is added where the budget is known
    (``autotune.estimator.paging.apply_budget``)."""
    gpu = workload.device
    if gpu is None:
        raise ValueError("the roofline prices a GPU: the workload names none")
    st = stats_of(workload.model_config)
    seq_len, global_batch_size = workload.seq_len_tokens, workload.global_batch_sequences
    shape = _typical_shape(workload, config)
    config = dict(TECHNIQUES.priced_as(config))
    precision = precision_of(config)
    half = computes_in_16_bits(config)
    wbytes = 2 if half else 4
    peak = gpu.flops_per_s(precision) * matmul_efficiency(gpu)
    hbm = gpu.hbm_gbps * GB * HBM_EFFICIENCY
    micro, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    tokens = micro * seq_len  # per micro-batch (positions, padding included)
    if shape is not None:
        tokens, seq_len = shape.positions, shape.length

    # --- per micro-batch: forward, backward ----------------------------------------------------
    per_layer_mm = st.layer_matrix_params + st.expert_params * max(1, st.top_k) // max(
        1, st.experts
    )
    mm_params = st.layers * per_layer_mm + st.vocab * st.hidden  # + the LM head
    q = st.heads * st.head_dim
    attn_flops = 4 * seq_len * q * tokens * st.layers
    attn_fwd = attn_flops / peak
    step = SpeedStep(
        config=config,
        stats=st,
        workload=workload,
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
        elementwise_passes=ELEMENTWISE_PASSES,
        offloaded_activations=offloaded_activations,
        mm_params=mm_params,
        attn_flops=attn_flops,
        attn_fwd=attn_fwd,
        attn_bwd=2 * attn_fwd,
        weight_bytes=wbytes,
        trainable=st.n_params,
        tensors=len(st.shapes),
    )
    # the operators (weights read, a frozen base, the attention kernel, the optimizer step),
    # then the matmuls; recomputation, fused kernels, launches; then communication and host
    # copies on top
    TECHNIQUES.operator_terms(step)
    weights_read = step.weight_bytes * mm_params
    step.fwd_mm = _roof(2 * tokens * mm_params, weights_read, peak, hbm)
    bwd_factor = 1 if step.frozen else 2  # frozen base: input gradients only
    step.bwd_mm = _roof(2 * bwd_factor * tokens * mm_params, bwd_factor * weights_read, peak, hbm)
    TECHNIQUES.kernel_terms(step)
    TECHNIQUES.speed_terms(step)
    bwd = step.bwd
    fwd_mm, bwd_mm, attn_fwd, attn_bwd = step.fwd_mm, step.bwd_mm, step.attn_fwd, step.attn_bwd
    dequant = step.dequant

    # --- optimizer step on the device -------------------------------------------------------------
    trainable = step.trainable
    opt_s = step.step_bytes * trainable / hbm if step.optimizer_on_device else 0.0
    opt_s += step.optimizer_extra
    if step.optimizer_on_device and not step.flat_partitions:  # DeepSpeed's are flat
        opt_s += step.tensors * step.per_tensor_ops * LAUNCH_S
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


def _typical_shape(workload: Workload, config: dict[str, Any]) -> Shape | None:
    """A typical micro-batch of variable-length data (None for fixed-length rows)."""
    if workload.documents is None:
        return None
    return micro_shapes(
        config,
        workload.seq_len_tokens,
        workload.global_batch_sequences,
        workload.documents,
        workload.processes,
    )[1]


def roofline(
    est: Estimate,
    workload: Workload,
    config: dict[str, Any],
    offloaded_activations: int = 0,
    layer_act_bytes: int | None = None,
) -> Estimate:
    """Fill ``est.step_time_s`` and ``est.tokens_per_s`` (all GPUs) for the workload's GPU;
    ``offloaded_activations``: bytes per micro-batch one rank moves to the host and back;
    variable-length data (the workload's ``documents``) is timed at a typical micro-batch (only
    its real tokens count)."""
    st = stats_of(workload.model_config)
    global_batch_size, seq_len = workload.global_batch_sequences, workload.seq_len_tokens
    micro, _ = micro_and_accumulation(config, global_batch_size, strict=False)
    shape = _typical_shape(workload, config)
    if shape is not None:
        micro, seq_len = shape.rows, shape.length
    if layer_act_bytes is None:
        layer_act_bytes = layer_activation_bytes(st, config, seq_len, micro)
    t = step_time(workload, config, layer_act_bytes, offloaded_activations)
    est.step_time_s = t.total
    _, accum = micro_and_accumulation(config, global_batch_size, strict=False)
    real = shape.tokens * accum if shape is not None else global_batch_size * seq_len
    est.tokens_per_s = real * max(1, workload.processes) / t.total
    gpu = workload.device
    assert gpu is not None  # step_time priced it
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
