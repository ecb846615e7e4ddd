"""Model-state bytes per GPU and per host (parameters, gradients, optimizer states) for every
precision x optimizer x ZeRO stage x offload x quantization, from the parameter shapes of the
transformers model (``autotune.models.stats_of``).

Accounting (Psi parameters, N GPUs in all, g per host, K optimizer-state bytes per parameter),
as DeepSpeed counts it (``estimate_zero2_model_states_mem_needs`` in
``deepspeed/runtime/zero/stage_1_and_2.py``, ``estimate_zero3_model_states_mem_needs`` in
``stage3.py``):

* Without ZeRO, the trial job's own loop (torch autocast over fp32 weights): 4 Psi weights,
  4 Psi gradients, K Psi states, nothing sharded (data parallel replicates them). ZeRO stage 0
  runs DeepSpeed's engine: in 16 bits 2 Psi weights beside fp32 copies (4 Psi), 16-bit
  gradients, and at the step fp32 copies of them (``FP16_UnfusedOptimizer``).
* ZeRO 1-3 is DeepSpeed's engine. Mixed precision: 16-bit weights (2 Psi), 16-bit gradients,
  an fp32 master partition (4 Psi/N), Adam's states (K Psi/N) and, for stage 2, the fp32
  gradient partition (4 Psi/N): stage 2 is 2 Psi + 18 Psi/N on the GPU, as DeepSpeed's estimate.
  Stage 1 does not shard the 16-bit gradients: 4 Psi + 16 Psi/N (the same as stage 2 on one GPU).
  Stage 3 shards everything (18 Psi/N) and holds the largest layer gathered (4 B/param of it).
* ``offload_optimizer: cpu``: the fp32 master, the fp32 gradients and the optimizer states live in
  host memory (16 Psi per host, or 18 Psi with stage 3's ``offload_param`` too); the GPU keeps the
  16-bit weights (stages 1-2: 2 Psi; stage 3: 2 Psi/N) and, with ``offload_param``, only the
  gathered layer. DeepSpeed's CPU-Adam steps in place on the host copies.
* host memory: the larger of what is offloaded and the model copy each process builds at load
  (4 Psi fp32 per process; with stage 3, ``zero.Init`` - which transformers uses under a ZeRO-3
  config - builds partitioned, so only the largest layer), times DeepSpeed's
  ``additional_buffer_factor`` (1.5: pinned staging buffers, allocator slack).
* ``phases`` (ZeRO): the same states by phase of a step, with the buffers DeepSpeed's estimate
  leaves out (gradient buckets, the offload staging buffer, stage 3's 16-bit gradient partition
  and gathered working set, AdamW's temporaries at the step), as DeepSpeed 0.19 allocates them;
  the estimators' peaks come from these (checked against measured CPU DeepSpeed trials in
  tests/test_estimator_measured.py). ``host_per_rank``: DeepSpeed's host buffers per rank.
* ``quantization`` int8/nf4: frozen base linear weights at 1 / 0.5 B (+ scales), other weights
  frozen in fp32, LoRA adapters (rank ``lora_r``, default 8, on every linear of every layer)
  trained in fp32 with the chosen optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.estimator.workload import Workload
from autotune.models import ModelStats, stats_of
from trials.techniques import OPTIMIZERS, setting
from trials.techniques.adapter import adapted_16bit, adapter_of, adapts, rank_of, targets_of
from trials.techniques.buckets import (
    contiguous_gradients,
    overlaps_comm,
    reduce_bucket_elements,
    sets_reduce_bucket,
)
from trials.techniques.cross_entropy import is_chunked
from trials.techniques.fsdp import RESHARD, fsdp_mode, offloads_shards, runs_fsdp
from trials.techniques.micro_batch import micro_and_accumulation
from trials.techniques.offload import offloads_optimizer, offloads_params
from trials.techniques.optimizer import optimizer_of
from trials.techniques.optimizer_in_backward import steps_in_backward
from trials.techniques.precision import computes_in_16_bits, precision_of, pure_bf16
from trials.techniques.quantization import (
    LORA_RANK,
    ROW_SCALE_BYTES,
    WEIGHT_BYTES,
    quantization_of,
    quantizes,
)
from trials.techniques.zero import runs_deepspeed, zero_stage

Shape = tuple[int, ...]

DEFAULT_LORA_R = LORA_RANK  # the trial's LoRA rank
#: DeepSpeed's defaults (``DeepSpeedZeroConfig``, deepspeed/runtime/zero/config.py), elements
DS_PREFETCH_PARAMS = 50_000_000  # stage3_prefetch_bucket_size
DS_REDUCE_BUCKET = 500_000_000  # reduce_bucket_size
DS_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance
DS_MAX_LIVE_PARAMS = 1_000_000_000  # stage3_max_live_parameters
DS_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold
DS_SUB_GROUP = 1_000_000_000  # sub_group_size
#: the engine's own all-reduce without ZeRO (``allreduce_gradients``: MEMORY_OPT_ALLREDUCE_SIZE)
DS_ALLREDUCE_BUCKET = 500_000_000
#: stage 3 takes a gradient's norm from fp64 copies of this many elements at a time
#: (``_constant_buffered_norm2``'s buffer_size)
DS_NORM_CHUNK = 250_000_000
#: DeepSpeed's estimators multiply host memory by this (pinned buffers, allocator slack)
DS_HOST_BUFFER_FACTOR = 1.5
#: bytes per parameter DeepSpeed keeps on the host under offload: fp32 master 4 + fp32 grads 4 +
#: Adam 8; stage 3's parameter offload adds the 16-bit partition (2)
HOST_OPTIMIZER_BYTES = 16
HOST_PARAM_BYTES = 2
#: bytes per element of the copy a gradient's norm is taken from (DeepSpeed's
#: ``get_norm_dtype``: fp64 on every accelerator with fp64)
NORM_BYTES = 8


def numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_shapes(cfg: dict[str, Any]) -> list[Shape]:
    """Every parameter's shape of the transformers model the config builds."""
    return list(stats_of(cfg).shapes)


#: (id of a model's ModelStats, optimizer) -> state bytes; ModelStats objects are kept alive by
#: ``autotune.models.model_stats``'s cache, so an id is not reused while it is in use
_STATE_BYTES: dict[tuple[int, str], int] = {}


def model_optimizer_bytes(st: ModelStats, name: str, pure: bool = False) -> int:
    """``optimizer_state_bytes`` over every parameter of the model, computed once per model."""
    key = (id(st), f"{name}:pure" if pure else name)
    if key not in _STATE_BYTES:
        _STATE_BYTES[key] = optimizer_state_bytes(name, st.shapes, pure)
    return _STATE_BYTES[key]


def optimizer_state_bytes(
    name: str, shapes: list[Shape] | tuple[Shape, ...], pure: bool = False
) -> int:
    """State bytes of the optimizer for these parameters (step counters ignored; ``pure``: bf16
    parameters, pure bf16): its module's term (``trials.techniques.optimizer``,
    ``OptimizerChoice.states_of``)."""
    return OPTIMIZERS[name].states_of(shapes, pure)


def model_in_16_bits(config: dict[str, Any]) -> bool:
    """Whether the model itself is 16-bit (no autocast over fp32 weights): DeepSpeed's engine in
    bf16/fp16, FSDP2 in bf16, pure bf16 on any engine, or a frozen 16-bit base under
    adapters."""
    half = computes_in_16_bits(config)
    sixteen = deepspeed_states(config) or pure_bf16(config) or adapted_16bit(config)
    # FSDP2's mixed-precision policy computes on 16-bit copies of the shards and casts the
    # root's inputs: the model runs in 16 bits
    return half and (sixteen or runs_fsdp(config))


def pure_outside_deepspeed(config: dict[str, Any]) -> bool:
    """Pure bf16 on the torch engine or FSDP2: the model built in bf16, its gradients and the
    optimizer's states made like it (DeepSpeed's pure bf16 is its own accounting)."""
    return pure_bf16(config) and not deepspeed_states(config)


def deepspeed_states(config: dict[str, Any]) -> bool:
    """Whether the model states are counted as DeepSpeed's engine keeps them (the model in 16
    bits, fp32 master copies beside it): the job runs DeepSpeed
    (``trials.techniques.zero.runs_deepspeed``, any ``zero_stage``, 0 included), or the traced
    estimator's marker ``deepspeed``."""
    return bool(setting(config, "deepspeed")) or runs_deepspeed(config)


@dataclass
class ModelStates:
    parts: dict[str, int]  # parameters, gradients, optimizer_states (per GPU)
    replaces_trace: bool = False  # the single-process trace can't see this accounting
    frozen_copies: int = 0  # 16-bit copies autocast made in the trace of weights now frozen
    host: dict[str, int] = field(default_factory=dict)  # per host: what lives in its RAM
    notes: list[str] = field(default_factory=list)
    #: ZeRO: what a rank holds on its device in each phase of a step (``Phases``)
    phases: Phases | None = None
    #: ZeRO with offload: the host buffers DeepSpeed keeps per rank (the offloaded states and
    #: its host staging buffers; what the CPU trial's tracker counts as ``host_offloaded``)
    host_per_rank: int = 0

    @property
    def gpu_bytes(self) -> int:
        """Model states per GPU, as DeepSpeed's estimators count them."""
        return sum(self.parts.values())

    @property
    def host_bytes(self) -> int:
        """Host RAM per machine for the model states (DeepSpeed's "per CPU")."""
        return sum(self.host.values())


@dataclass(frozen=True)
class Phases:
    """What a ZeRO rank holds on its device, by role (parameters, gradients, optimizer_states,
    temporaries), in each phase of a step, as DeepSpeed 0.19 allocates it. ``ModelStates.parts``
    is DeepSpeed's own estimate (``estimate_zero*_model_states_mem_needs``: every state at once,
    its buffers left out); a step holds less at any one time and some buffers on top.

    * ``compute``: through every forward and backward (the activations come on top);
    * ``accumulated``: from the first backward until the optimizer step (the gradients kept over
      the micro-batches of an accumulation window, and what lives with them);
    * ``backward``: only inside a backward pass;
    * ``step``: at the optimizer step, when no activation is left;
    * ``first_hook``: what the first gradient hook of the first micro-batch makes, which
      ``accumulated`` holds from then on (stage 1's bucket);
    * ``hook``: at every backward's first gradient hook: the gradient that fires it;
    * ``overflow``: at the first reduction inside backward (stage 2 under offload, when the
      gradients overflow the bucket before the embedding's), with ``overflow_held`` of the
      layers' activations still held (1: at the first hook);
    * ``boundary``: after the last backward, when no activation is left, besides ``compute``
      and ``accumulated``: the fp64 copy a gradient's norm is taken from (at the boundary's
      reduction under offload, at the start of the step without) and the buffers alive then.

    Stages 1-2 make the IPG bucket at the first gradient hook (``setup_buckets``, from
    ``process_gradients``), the output layer's: almost every activation is still held then.
    """

    compute: dict[str, int]
    accumulated: dict[str, int]
    backward: dict[str, int]
    step: dict[str, int]
    first_hook: dict[str, int] = field(default_factory=dict)
    hook: dict[str, int] = field(default_factory=dict)
    boundary: dict[str, int] = field(default_factory=dict)
    overflow: dict[str, int] = field(default_factory=dict)
    overflow_held: float = 0.0


def zero_states_at(phases: Phases, moment: str, accum: int) -> dict[str, int]:
    """A ZeRO rank's model states and DeepSpeed's buffers at one of the moments, by role:
    the optimizer step holds its own; forward and the start of backward hold the gradients
    kept over micro-batches once there were earlier ones (``accum`` > 1); the first gradient
    hook adds the buffers of the backward pass, and what the hook itself holds (``hook``),
    which the rest of backward after it does not; the end of backward holds them all; the
    accumulation boundary's reduction adds its own (no activation is left then)."""
    if moment == "optimizer step":
        parts = [phases.step]
    elif moment in ("first gradient hook", "after the first gradient hook"):
        parts = [phases.compute, phases.backward]
        parts.append(phases.accumulated if accum > 1 else phases.first_hook)
        if moment == "first gradient hook":
            parts.append(phases.hook)
    elif moment == "end of backward":
        parts = [phases.compute, phases.accumulated, phases.backward]
    elif moment == "accumulation boundary":
        parts = [phases.compute, phases.accumulated, phases.boundary]
    elif moment == "bucket overflow":
        parts = [phases.compute, phases.backward, phases.overflow]
        parts.append(phases.accumulated if accum > 1 else phases.first_hook)
    else:
        parts = [phases.compute, phases.accumulated] if accum > 1 else [phases.compute]
    held = {"parameters": 0, "gradients": 0, "optimizer_states": 0, "temporaries": 0}
    for part in parts:
        for role, nbytes in part.items():
            held[role] += nbytes
    return held


def adam_step_temporaries(numel: int, cuda: bool, nbytes: int = 4) -> int:
    """Temporaries of ``torch.optim.AdamW`` stepping one tensor of ``numel`` elements of
    ``nbytes`` each (fp32, or bf16 in pure bf16; what DeepSpeed builds with ``torch_adam``; ZeRO
    steps one flat partition). Its single-tensor update (the CPU's) makes ``exp_avg_sq.sqrt()``
    and its quotient by the bias correction before adding eps in place: two temporaries; the
    foreach update (CUDA's default) makes one (``_foreach_sqrt``, then in place) -
    ``torch/optim/adam.py``."""
    return (1 if cuda else 2) * nbytes * numel


#: (id of ModelStats, threshold) -> parameters below the threshold; see ``_STATE_BYTES``
_PERSISTENT: dict[tuple[int, int], int] = {}


def persistent_params(st: ModelStats, threshold: int) -> int:
    """Parameters ZeRO-3 keeps gathered for good: every tensor of at most
    ``stage3_param_persistence_threshold`` elements (``param.ds_numel <= param_threshold`` in
    ``mark_persistent_parameters``, deepspeed/runtime/zero/parameter_offload.py)."""
    key = (id(st), threshold)
    if key not in _PERSISTENT:
        _PERSISTENT[key] = sum(numel(s) for s in st.shapes if numel(s) <= threshold)
    return _PERSISTENT[key]


def _ipg_bucket(config: dict[str, Any], stage: int, wbytes: int) -> int:
    """DeepSpeed's gradient reduction bucket: ``reduce_bucket_size`` elements in the gradients'
    dtype, made whole whatever the model's size (``setup_buckets`` in stage_1_and_2.py, with a
    second one when ``overlap_comm``; stage3.py makes one in ``_setup_for_real_optimizer``).
    Stages 1-2 make it only with ``contiguous_gradients`` (DeepSpeed's default)."""
    elements = reduce_bucket_elements(config, DS_REDUCE_BUCKET)
    if stage == 3:
        return wbytes * elements
    if not contiguous_gradients(config):
        return 0
    return (2 if overlaps_comm(config) else 1) * wbytes * elements


def _stage3_knobs(config: dict[str, Any]) -> tuple[int, int, int]:
    """(max reuse distance, max live parameters, prefetch bucket) in elements: the trial's
    DeepSpeed config sets all three to ``reduce_bucket_size`` when the config has one
    (``trials.deepspeed_engine.deepspeed_config``), else DeepSpeed's defaults."""
    if sets_reduce_bucket(config):
        n = reduce_bucket_elements(config, 0)
        return n, n, n
    return DS_MAX_REUSE_DISTANCE, DS_MAX_LIVE_PARAMS, DS_PREFETCH_PARAMS


def _host(
    offloaded: int,
    load_copy: int,
    label: str = "offloaded states",
    factor: float = DS_HOST_BUFFER_FACTOR,
) -> dict[str, int]:
    """Host RAM: the larger of the offloaded states and the model copies made at load, plus
    DeepSpeed's buffer factor on it (FSDP2 pins the offloaded shards themselves: 1)."""
    base = max(offloaded, load_copy)
    parts = {label: offloaded, "model copy at load": max(0, load_copy - offloaded)}
    parts["pinned buffers and slack"] = int(base * (factor - 1))
    return {k: int(v) for k, v in parts.items()}


def model_states(
    model_cfg: dict[str, Any],
    config: dict[str, Any],
    nproc: int,
    *,
    nodes: int = 1,
    zero_init: bool = True,
    accumulation: int = 1,
    cuda: bool = True,
) -> ModelStates:
    """Per-GPU and per-host model states of ``config`` on ``nproc`` GPUs over ``nodes`` hosts.

    ``zero_init``: stage 3 builds the model partitioned (``deepspeed.zero.Init``, what
    transformers does under a ZeRO-3 config); False for a model built whole in each process.
    ``accumulation`` (micro-batches per step) and ``cuda`` (False: the CPU trial backend, where
    torch's AdamW takes its single-tensor path) shape the ZeRO ``phases`` only.
    """
    st = stats_of(model_cfg)
    psi = st.n_params
    n = max(1, int(nproc))
    per_host = max(1, n // max(1, nodes))
    opt = optimizer_of(config)
    precision = precision_of(config)
    stage = zero_stage(config)
    off_opt = offloads_optimizer(config)
    off_param = offloads_params(config)
    quant = quantization_of(config)
    load_copy = 4 * psi * per_host  # each process builds the fp32 model on the host first

    if quantizes(config):
        return _quantized(st, config, quant, opt, precision, load_copy)
    if adapts(config):
        return _adapted(st, config, opt, load_copy)

    if pure_outside_deepspeed(config):
        # the model built in bf16 (the load copy too), its gradients and states like it
        load_copy //= 2
        states = model_optimizer_bytes(st, opt, pure=True)
    else:
        states = model_optimizer_bytes(st, opt)
    if runs_fsdp(config):
        return _fsdp_states(st, config, n, per_host, states, load_copy)
    if stage == 0 and runs_deepspeed(config):
        return _deepspeed_without_zero(st, config, opt, states, load_copy, cuda)
    if stage == 0:
        wbytes = 2 if pure_outside_deepspeed(config) else 4
        grads = wbytes * psi
        if n > 1 and not runs_deepspeed(config) and not steps_in_backward(config):
            # DistributedDataParallel: its flat buckets, a second copy of every gradient (the
            # reducer's, torch's default gradient_as_bucket_view=False), from the first backward on
            grads += wbytes * psi
        notes = ["pure bf16: bf16 weights, gradients and optimizer states"] if wbytes == 2 else []
        return ModelStates(
            {"parameters": wbytes * psi, "gradients": grads, "optimizer_states": states},
            host=_host(0, load_copy),
            notes=notes,
        )

    half = precision in ("bf16", "fp16")
    wbytes = 2 if half else 4
    # master weights, their gradients and the optimizer's states: fp32, or bf16 in pure bf16
    pure = pure_bf16(config) and not off_opt
    mbytes = 2 if pure else 4
    if pure:
        states //= 2
    master = mbytes * psi  # DeepSpeed's master partition (a copy even when training in fp32)
    notes = [f"model states: ZeRO-{stage} over {n} GPU(s) by formula (DeepSpeed's accounting)"]
    largest = st.largest_module_params
    part = psi // n  # this rank's share of the flat partition
    bucket = _ipg_bucket(config, stage, wbytes)
    if stage in (1, 2):
        params = wbytes * psi
        # the 16-bit gradients: whole in stage 1, a partition in stage 2
        grads16 = (wbytes * psi if stage == 1 else wbytes * psi // n) if half else 0
        grads32 = mbytes * psi // n
        optim = (master + states) // n
        if off_opt:
            grads16 = grads32 = optim = 0
            notes.append("fp32 master weights, gradients and optimizer states in host memory")
            host = _host(HOST_OPTIMIZER_BYTES * psi * per_host // n, load_copy)
        else:
            host = _host(0, load_copy)
        elements = reduce_bucket_elements(config, DS_REDUCE_BUCKET)
        phases, host_rank = _phases12(
            stage, st, part, wbytes, mbytes, optim, (bucket, elements), off_opt, cuda
        )
        if off_opt and stage == 2 and accumulation > 1:
            # gradients accumulated over micro-batches in host memory, the partition's
            # parameters whole (accumulated_grads_in_cpu, async_accumulate_grad_in_cpu_via_gpu)
            host_rank += wbytes * part
        return ModelStates(
            {"parameters": params, "gradients": grads16 + grads32, "optimizer_states": optim},
            replaces_trace=True,
            host=host,
            notes=notes,
            phases=phases,
            host_per_rank=host_rank,
        )

    # stage 3: everything partitioned; the largest layer is gathered whole (DeepSpeed counts
    # 4 B/param of it); ``phases`` has the working set DeepSpeed's coordinator really keeps
    gathered = 4 * largest
    params = wbytes * psi // n
    grads = mbytes * psi // n
    optim = (master + states) // n  # with the 16-bit partition: 18 Psi/N in mixed precision
    load = 4 * largest * per_host if zero_init else load_copy
    offloaded = 0
    host_rank = 0
    if off_opt:
        offloaded += HOST_OPTIMIZER_BYTES * psi * per_host // n
        # and the 16-bit gradient partitions (grad_partitions_flat_buffer, on the host too)
        host_rank += HOST_OPTIMIZER_BYTES * part + wbytes * part
        grads = optim = 0
        notes.append("fp32 master weights, gradients and optimizer states in host memory")
    if off_param:
        offloaded += HOST_PARAM_BYTES * psi * per_host // n
        host_rank += wbytes * part
        params = 0
        notes.append("16-bit parameter partitions in host memory")
    return ModelStates(
        {"parameters": params + gathered, "gradients": grads, "optimizer_states": optim},
        replaces_trace=True,
        host=_host(offloaded, load),
        notes=notes,
        phases=_phases3(
            st, config, n, part, wbytes, mbytes, optim, bucket, off_opt, off_param, cuda
        ),
        host_per_rank=host_rank,
    )


def _deepspeed_without_zero(
    st: ModelStats, config: dict[str, Any], opt: str, states: int, load_copy: int, cuda: bool
) -> ModelStates:
    """DeepSpeed's engine at ``zero_stage`` 0 (deepspeed/runtime/engine.py). In 16 bits it casts
    the model and wraps the optimizer in ``FP16_UnfusedOptimizer`` (``DDP_BFLOAT16``/``FP16``;
    deepspeed/runtime/fp16/unfused_optimizer.py): fp32 copies of every weight for the
    optimizer, and at the step fp32 copies of every gradient, made before the optimizer runs,
    beside the 16-bit ones. In fp32 the torch optimizer runs as it is. Either way, at the
    boundary, ``allreduce_gradients`` flattens the gradients into one buffer (up to 5e8
    elements) even on one rank. Every rank holds all of it."""
    psi = st.n_params
    half = computes_in_16_bits(config)
    wbytes = 2 if half else 4
    weights = wbytes * psi + (4 * psi if half else 0)
    grads = wbytes * psi
    temps = OPTIMIZERS[opt].step_temporaries(st.largest_param, cuda)
    compute = {"parameters": weights, "optimizer_states": states}
    step = {
        "parameters": weights,
        "gradients": grads + (4 * psi if half else 0),
        "optimizer_states": states,
        "temporaries": temps,
    }
    phases = Phases(
        compute,
        {"gradients": grads},
        {},
        step,
        hook={"gradients": wbytes * st.largest_param},
        boundary={"temporaries": wbytes * min(psi, DS_ALLREDUCE_BUCKET)},
    )
    notes = ["model states: DeepSpeed without ZeRO (its engine's accounting)"]
    if half:
        notes.append("fp32 master weights beside the 16-bit model (FP16_UnfusedOptimizer)")
    return ModelStates(
        {"parameters": weights, "gradients": grads, "optimizer_states": states},
        replaces_trace=True,
        host=_host(0, load_copy),
        notes=notes,
        phases=phases,
    )


def _phases12(
    stage: int,
    st: ModelStats,
    part: int,
    wbytes: int,
    mbytes: int,
    optim: int,
    buckets: tuple[int, int],
    off_opt: bool,
    cuda: bool,
) -> tuple[Phases, int]:
    """ZeRO-1/2 (``DeepSpeedZeroOptimizer``, deepspeed/runtime/zero/stage_1_and_2.py) by phase,
    and the host buffers per rank under offload. ``buckets``: the IPG buckets' device bytes
    and ``reduce_bucket_size`` (elements)."""
    bucket, bucket_elements = buckets
    params = wbytes * st.n_params  # bit16_groups_flat: the 16-bit model, whole on every rank
    # under offload the gradients pass through one device buffer the size of the largest tensor
    # (temp_grad_buffer_for_gpu_offload); the host holds the fp32 master, its gradients and
    # Adam's moments (16 B/param), a 16-bit copy of the partition the updated weights come back
    # through (param_buffer_of_bit16_for_cpu_offload_groups) and a host twin of the device
    # buffer (temp_grad_buffer_for_cpu_offload), all made in ``__init__``
    staging = wbytes * st.largest_param if off_opt else 0
    host_rank = (HOST_OPTIMIZER_BYTES + wbytes) * part + staging if off_opt else 0
    compute = {"parameters": params, "optimizer_states": optim, "temporaries": staging}
    # the gradient a hook fires for is alive beside the bucket it is copied into: the largest
    # is the output layer's, the first hook's (a llama's head is as large as its embedding)
    one_grad = wbytes * st.largest_param
    # a gradient's norm is taken from a copy of this rank's slice of it in fp64, one gradient
    # at a time (``get_norm_dtype``: fp64 wherever the accelerator has it, CUDA and the CPU):
    # 8 B per element of the largest slice; under offload as the boundary's reduction copies
    # each gradient to the host (``set_norm_for_param_grad_in_gpu``), else at the start of the
    # step over the reduced 16-bit gradients (``get_grad_norm_direct``)
    norm = NORM_BYTES * min(st.largest_param, part)
    hook = {"gradients": one_grad}
    boundary = {"temporaries": norm}
    overflow: dict[str, int] = {}
    held = 0.0
    if stage == 1:
        # stage 1 reduces only at the accumulation boundary (``process_gradients`` leaves each
        # .grad in place without partition_gradients or overlap_comm): the 16-bit gradients
        # stay whole on the device, with or without offload, and the IPG bucket made at the
        # first gradient hook lives until the boundary's epilogue, where the norms are taken
        accumulated = {"gradients": wbytes * st.n_params, "temporaries": bucket}
        backward: dict[str, int] = {}
        first_hook = {"temporaries": bucket}
    else:
        # stage 2 reduces as gradients come: its partition's gradients are copied into
        # grads_in_partition (copy_grads_in_partition; on the host under offload, with the
        # norm taken there) and the IPG bucket is released by every backward's epilogue
        # (_release_ipg_buffers). The bucket is reduced when the next gradient would overflow
        # it (``reduce_independent_p_g_buckets_and_remove_grads``), a gradient larger than the
        # bucket at its own hook, and what is left at the epilogue
        accumulated = {"gradients": 0 if off_opt else wbytes * part}
        backward = {"temporaries": bucket}
        first_hook = {}
        first = _first_overflow(st, bucket_elements) if off_opt else None
        if off_opt:
            boundary = {"temporaries": bucket + norm}
        if first is not None:
            # the norm copy, beside the largest gradient when it was reduced alone (in place
            # in the bucket otherwise)
            reduced, held = first
            overflow = {"temporaries": norm}
            if reduced > bucket_elements:
                overflow["gradients"] = one_grad
    if off_opt:  # DeepSpeedCPUAdam steps on the host, in place
        step = {"parameters": params, "temporaries": staging}
    else:
        # ``step`` frees the 16-bit gradients, makes the fp32 gradient partition
        # (single_partition_of_fp32_groups[i].grad) and runs the optimizer on the flat partition
        step = {
            "parameters": params,
            "gradients": mbytes * part,
            "optimizer_states": optim,
            "temporaries": adam_step_temporaries(part, cuda, mbytes),
        }
    phases = Phases(
        compute, accumulated, backward, step, first_hook, hook, boundary, overflow, held
    )
    return phases, host_rank


def _first_overflow(st: ModelStats, bucket_elements: int) -> tuple[int, float] | None:
    """ZeRO 2-3: the first reduction inside backward, when the next gradient would overflow
    the bucket (``reduce_independent_p_g_buckets_and_remove_grads``): the gradient elements it
    reduces and the share of the layers' activations still held then. The output layer's
    gradient comes first (a llama's head, the size of the largest tensor; over the bucket, it
    is reduced alone, with every activation held), then the layers' from the last. None when
    every gradient fits the bucket until the embedding's (the epilogue reduces them, with no
    activation left: ``boundary``)."""
    if st.largest_param > bucket_elements:
        return st.largest_param, 1.0
    filled, done = st.largest_param, 0
    while done < st.layers and filled + st.layer_params <= bucket_elements:
        filled += st.layer_params
        done += 1
    if done >= st.layers:
        return None
    return filled, (st.layers - done) / st.layers


def _last_reduction(st: ModelStats, bucket_elements: int) -> tuple[int, bool]:
    """ZeRO-3: the gradient elements the epilogue reduces (what is left in the bucket after
    backward, ``independent_gradient_partition_epilogue``) and whether that is one tensor
    alone. The gradients come as ``_first_overflow`` walks them (the output layer's, the
    layers' from the last, the embedding's last), the bucket reduced whenever the next one would
    overflow it; a reduction is at most the bucket or the largest tensor."""
    rest = max(0, st.n_params - st.largest_param - st.layers * st.layer_params)
    filled = tensors = 0
    for elements in (st.largest_param, *[st.layer_params] * st.layers, rest):
        if filled and filled + elements > bucket_elements:
            filled = tensors = 0
        filled += elements
        tensors += 1
    return min(filled, max(bucket_elements, st.largest_param)), tensors == 1


def _phases3(
    st: ModelStats,
    config: dict[str, Any],
    n: int,
    part: int,
    wbytes: int,
    mbytes: int,
    optim: int,
    bucket: int,
    off_opt: bool,
    off_param: bool,
    cuda: bool,
) -> Phases:
    """ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``, deepspeed/runtime/zero/stage3.py, and its
    parameter coordinator, partitioned_param_coordinator.py) by phase."""
    partition = 0 if off_param else wbytes * part  # the 16-bit partition (ds_tensor)
    # gathered parameters: one rank with its partition on the device uses it in place
    # (``all_gather_coalesced`` takes ``_no_gather_coalesced``); otherwise the coordinator keeps
    # the persistent parameters gathered for good and, of the others, what is reused within
    # stage3_max_reuse_distance elements (``__params_to_release``), the module in use and what
    # it prefetches (up to stage3_prefetch_bucket_size, within stage3_max_live_parameters).
    # One rank with its partition offloaded fetches it with ``ds_tensor.to(device)``
    # (``NoGatherHandle``): a device copy on a GPU, the host partition itself where the
    # accelerator is the CPU (the CPU trial backend)
    if n == 1 and (not off_param or not cuda):
        persistent = working = 0
    else:
        persistent = persistent_params(st, DS_PERSISTENCE_THRESHOLD)
        reuse, live, prefetch = _stage3_knobs(config)
        window = reuse + st.largest_module_params + min(prefetch, live)
        working = persistent + min(st.n_params - persistent, window)
    # the 16-bit gradient partitions (grad_partitions_flat_buffer, made at init; on the host
    # under offload_optimizer) and the IPG bucket (made at init) live throughout
    grad_buffer = 0 if off_opt else wbytes * part
    compute = {
        "parameters": partition + wbytes * working,
        "gradients": grad_buffer,
        "optimizer_states": optim,
        "temporaries": bucket,
    }
    if off_opt:  # DeepSpeedCPUAdam steps on the host, in place
        step = {"parameters": partition + wbytes * persistent, "temporaries": bucket}
    else:
        # the step makes each sub-group's fp32 gradients (_prepare_fp32_grad_for_sub_group)
        # and runs the optimizer on the flat sub-group
        sub = min(part, DS_SUB_GROUP)
        step = {
            "parameters": partition + wbytes * persistent,
            "gradients": grad_buffer + mbytes * sub,
            "optimizer_states": optim,
            "temporaries": bucket + adam_step_temporaries(sub, cuda, mbytes),
        }
    # a gathered parameter's gradient is whole when its hook fires; the norms are taken from
    # fp64 copies of each gradient partition, at most 250M elements at a time
    # (``_constant_buffered_norm2``): under offload as a reduction in backward moves the
    # partitions to the host (``_offload_grad_partition_at_boundary``; on a GPU from a device
    # copy of the host buffer, ``partition_grads``), else at the start of the step
    # (``get_grad_norm_direct``). Stage 3 reduces when the bucket would overflow, as stage 2
    one_grad = wbytes * st.largest_param
    sliced = min(st.largest_param, part)
    norm = NORM_BYTES * min(sliced, DS_NORM_CHUNK)
    overflow: dict[str, int] = {}
    held = 0.0
    # A reduction (``__avg_scatter_grads``) flattens what the bucket held into one buffer
    # (``reduce_scatter_coalesced``'s torch.cat, in the communication dtype; one tensor alone is
    # used in place), whose partitions stay views of it until ``partition_grads`` is done; on
    # the CPU backend gloo copies that input for the reduce-scatter itself. Under offload
    # ``partition_grads`` takes the norms then (from a device copy of the host partition on a
    # GPU); without, the step does, once the buffer is gone.
    bucket_elements = reduce_bucket_elements(config, DS_REDUCE_BUCKET)
    offload_norm = norm + (wbytes * sliced if cuda else 0)
    first = _first_overflow(st, bucket_elements)
    if off_opt and first is not None:
        reduced, held = first
        flat = one_grad if reduced == st.largest_param else wbytes * reduced
        overflow = {
            "gradients": flat,
            "temporaries": max(offload_norm, 0 if cuda else wbytes * reduced),
        }
    last, alone = _last_reduction(st, bucket_elements)
    flat = 0 if alone else wbytes * last
    gloo = 0 if cuda else wbytes * last
    if off_opt:
        boundary = {"gradients": flat, "temporaries": max(gloo, offload_norm)}
    elif flat + gloo >= norm:
        boundary = {"gradients": flat, "temporaries": gloo}
    else:
        boundary = {"temporaries": norm}
    return Phases(
        compute,
        {},
        {},
        step,
        hook={"gradients": one_grad},
        boundary=boundary,
        overflow=overflow,
        overflow_held=held,
    )


def _fsdp_states(
    st: ModelStats, config: dict[str, Any], n: int, per_host: int, states: int, load_copy: int
) -> ModelStates:
    """FSDP2: fp32 shards of the parameters (bf16 in pure bf16), their gradients and the
    optimizer's states, 1/N of each per rank (``fsdp_held`` has what a rank holds besides,
    moment by moment)."""
    psi = st.n_params
    mbytes = 2 if pure_bf16(config) else 4
    sharded = {
        "parameters": mbytes * psi // n,
        "gradients": mbytes * psi // n,
        "optimizer_states": states // n,
    }
    notes = [f"model states: FSDP2 {fsdp_mode(config)} over {n} GPU(s) by formula"]
    if mbytes == 2:
        notes.append("pure bf16: bf16 shards, gradients and optimizer states")
    offloaded = 0
    if offloads_shards(config):
        offloaded = sum(sharded.values()) * per_host
        sharded = dict.fromkeys(sharded, 0)
        notes.append("parameter shards, their gradients and optimizer states in host memory")
    return ModelStates(
        sharded, replaces_trace=True, host=_host(offloaded, load_copy, factor=1.0), notes=notes
    )


def fsdp_held(
    st: ModelStats, config: dict[str, Any], n: int, moment: str, accum: int, cuda: bool
) -> dict[str, int]:
    """What an FSDP2 rank holds by role at one moment of a step (``fully_shard`` on each block
    and the root, torch/distributed/fsdp/_fully_shard): its shards and optimizer states; the
    root's parameters (embeddings, head, final norm) gathered from the root's forward to the
    end of backward; a block's gathered for its forward and backward (with the next one
    prefetched), or, under ``shard_grad_op``, every block's from its forward to its backward;
    a gathered gradient in the parameters' dtype and its copy in the reduce dtype (fp32 in mixed
    precision, bf16 in pure bf16) for the reduce-scatter; the root's reduced at the very end of
    backward. Offloaded: shards, gradients and states on the host, the step there too."""
    psi = st.n_params
    pure = pure_bf16(config)
    w = 2 if computes_in_16_bits(config) else 4
    m = 2 if pure else 4  # the shards' (and their gradients') bytes, the reduce dtype's
    block = st.layer_params
    root = psi - st.layers * block
    offloaded = offloads_shards(config)
    shards = 0 if offloaded else m * psi // n
    opt = optimizer_of(config)
    optim = 0 if offloaded else model_optimizer_bytes(st, opt, pure) // n
    grads_kept = 0 if offloaded or accum == 1 else m * psi // n  # reduced each micro-batch
    reduced = 0 if offloaded else m * (psi - root) // n  # every block's reduced gradient shard
    # full_shard: each block resharded after its forward, none gathered at the end of forward
    # or the start of backward; shard_grad_op: every block gathered until its backward
    blocks_fwd = 0 if RESHARD[fsdp_mode(config)] else st.layers * w * block
    # the reduce-scatter's input made from the gathered gradients; on a CPU the collective
    # of 16-bit gradients cast to fp32 adds an fp32 copy (measured on gloo); one rank has no
    # collective (``foreach_reduce`` copies the input to the output)
    cast = 4 if w != m and not cuda and n > 1 else 0
    gathered = w * root
    if n == 1 and w == m and not offloaded:
        # one rank, no cast, shards on the device: the "gathered" parameters are the shards
        # themselves (``FSDPParamGroup.wait_for_unshard``'s world-size-1 path)
        gathered = blocks_fwd = 0
    held = {"parameters": shards, "gradients": 0, "optimizer_states": optim, "temporaries": 0}
    if moment == "optimizer step":
        held["gradients"] = 0 if offloaded else m * psi // n
        biggest = (st.largest_param + n - 1) // n
        held["temporaries"] = 0 if offloaded else adam_step_temporaries(biggest, cuda, m)
    elif moment in ("end of forward", "start of backward"):
        held["parameters"] += gathered + blocks_fwd
        # the head's gradient: beside the logits' only under chunked cross-entropy (summed
        # slice by slice); the full loss's logits gradients are gone before the head's backward
        chunked = is_chunked(config)
        head = w * st.vocab * st.hidden if moment == "start of backward" and chunked else 0
        held["gradients"] = grads_kept + head
    elif moment == "first layer's backward":
        # the root's gathered parameters and its gradients so far (the head's), every block's
        # reduced gradient shard, the first block's gathered (and the embedding prefetched)
        held["parameters"] += gathered + (2 * w * block if gathered else 0)
        held["gradients"] = max(grads_kept, reduced) + w * st.vocab * st.hidden
        held["temporaries"] = (w + m + cast) * block  # its gathered gradient, the reduce's copy
    else:  # end of backward: the root's gradients reduced, its parameters resharded first
        # (``FSDPParamGroup.post_backward`` reshards before ``foreach_reduce``); several CPU
        # ranks keep that much again in gloo's reduce-scatter buffers (two gloo processes hold
        # 9.4 MB more than torch's fake process group on the test model: left as this term)
        if n > 1 and not cuda:
            held["parameters"] += gathered
        held["gradients"] = max(grads_kept, reduced)
        # the copy-in (the root's gradients and the reduce's input), then the input and the
        # reduced output; offloaded on a CPU, that output is the host gradient itself
        # (``.to("cpu")`` of a CPU tensor is no copy)
        output = 0 if offloaded and not cuda else m * root // n
        held["temporaries"] = max((w + m + cast) * root, m * root + output)
    return held


def estimator_states(workload: Workload, config: dict[str, Any]) -> ModelStates:
    """``model_states`` as both estimators need them: the accumulation steps of this batch, the
    nodes of ``gpu``, and no ``gpu`` meaning the CPU trial backend (torch's AdamW then takes its
    single-tensor path: ``adam_step_temporaries``)."""
    gpu = workload.device
    _, accum = micro_and_accumulation(config, workload.global_batch_sequences, strict=False)
    return model_states(
        workload.model_config,
        config,
        workload.processes,
        nodes=gpu.nodes if gpu else 1,
        accumulation=accum,
        cuda=gpu is not None,
    )


def host_with_activations(
    host: dict[str, int], per_rank: int, workload: Workload, notes: list[str]
) -> dict[str, int]:
    """``host`` (per machine) plus the activations each of the workload's ranks on a machine
    offloads (``per_rank`` bytes), noted in ``notes``; both estimators count them so."""
    if not per_rank:
        return dict(host)
    notes.append("activations offloaded to host memory up to the output layer")
    gpu = workload.device
    ranks = max(1, workload.processes // (gpu.nodes if gpu else 1))
    return {**host, "activations": per_rank * ranks}


#: (id of ModelStats, LoRA rank) -> (quantized params, LoRA shapes); see ``_STATE_BYTES``
_LORA: dict[tuple[int, int], tuple[int, tuple[Shape, ...], int, int]] = {}


def clear_caches() -> None:
    """Forget the per-model sums above (``_STATE_BYTES``, ``_PERSISTENT``, ``_LORA``). For tests:
    a process that forks per mutant (mutmut) inherits sums its parent computed with the
    unmutated code, and a mutant of the function that computes them would never run."""
    _STATE_BYTES.clear()
    _PERSISTENT.clear()
    _LORA.clear()
    _ADAPTERS.clear()


def _lora(st: ModelStats, r: int) -> tuple[int, tuple[Shape, ...], int, int]:
    """The quantized base weights (every linear layer but the head, ``ModelStats.linear_shapes``:
    their count, that of their output rows), the LoRA shapes and their parameter count. LoRA
    goes on every 2-D weight of the layers (the linear layers and an MoE's router, as peft's
    ``all-linear`` adapts them), not on the experts' 3-D tensors, which peft adapts too (a gap:
    ``tests/test_estimator_zero_parts.py``'s strict xfail)."""
    key = (id(st), r)
    if key not in _LORA:
        quantized = st.linear_params
        rows = sum(out_f for out_f, _ in st.linear_shapes)
        adapted = [s for s in st.shapes if len(s) == 2 and numel(s) < st.vocab * st.hidden]
        lora_shapes: list[Shape] = []
        for out_f, in_f in adapted:
            lora_shapes += [(r, in_f), (out_f, r)]
        _LORA[key] = (quantized, tuple(lora_shapes), sum(numel(s) for s in lora_shapes), rows)
    return _LORA[key]


#: (id of ModelStats, rank, targets, adapter) -> adapter shapes, outputs, optimizer -> state
#: bytes; see ``_STATE_BYTES``
_ADAPTERS: dict[tuple[int, int, str, str], tuple[list[Shape], int, dict[str, int]]] = {}


def adapter_shapes(st: ModelStats, config: dict[str, Any]) -> tuple[list[Shape], int]:
    """The trainable shapes of the config's LoRA/DoRA adapters (A and B of each adapted layer,
    DoRA's magnitude vectors) and the adapted layers' summed output width (once per model)."""
    key = (id(st), rank_of(config), targets_of(config), adapter_of(config))
    if key not in _ADAPTERS:
        _ADAPTERS[key] = (*_adapter_shapes(st, config), {})
    shapes, outputs, _ = _ADAPTERS[key]
    return shapes, outputs


def adapter_state_bytes(st: ModelStats, config: dict[str, Any], opt: str) -> int:
    """The optimizer's state bytes for the config's adapters (once per model and optimizer)."""
    shapes, _ = adapter_shapes(st, config)
    cache = _ADAPTERS[(id(st), rank_of(config), targets_of(config), adapter_of(config))][2]
    if opt not in cache:
        cache[opt] = optimizer_state_bytes(opt, shapes)
    return cache[opt]


def _adapter_shapes(st: ModelStats, config: dict[str, Any]) -> tuple[list[Shape], int]:
    r = rank_of(config)
    if targets_of(config) == "all_linear":  # every 2-D weight of the layers, as peft adapts
        adapted = [s for s in st.shapes if len(s) == 2 and numel(s) < st.vocab * st.hidden]
    else:  # the attention's q, k, v and output projections
        q, kv = st.heads * st.head_dim, st.kv_heads * st.head_dim
        adapted = [(q, st.hidden), (kv, st.hidden), (kv, st.hidden), (st.hidden, q)]
        adapted *= st.layers
    shapes: list[Shape] = []
    for out_f, in_f in adapted:
        shapes += [(r, in_f), (out_f, r)]
    outputs = sum(int(s[0]) for s in adapted)
    if adapter_of(config) == "dora":
        shapes += [(int(s[0]),) for s in adapted]
    return shapes, outputs


def _adapted(st: ModelStats, config: dict[str, Any], opt: str, load_copy: int) -> ModelStates:
    """LoRA/DoRA on a frozen base (``trials.techniques.adapter``): the base in 16 bits under
    bf16/fp16 (fp32 otherwise), the adapters, their gradients and the optimizer's states in
    fp32."""
    shapes, _ = adapter_shapes(st, config)
    trainable = sum(numel(s) for s in shapes)
    base = (2 if adapted_16bit(config) else 4) * st.n_params
    r = rank_of(config)
    return ModelStates(
        {
            "parameters": base + 4 * trainable,
            "gradients": 4 * trainable,
            "optimizer_states": adapter_state_bytes(st, config, opt),
        },
        replaces_trace=True,
        host=_host(0, load_copy),
        notes=[
            f"{adapter_of(config)} r={r} on {targets_of(config)} over a frozen base "
            f"({trainable / 1e6:.2f}M trainable) by formula"
        ],
    )


def qlora_shapes(st: ModelStats, config: dict[str, Any]) -> tuple[Shape, ...]:
    """The trainable shapes of a quantized base's LoRA adapters."""
    return _lora(st, int(config.get("lora_r", DEFAULT_LORA_R)))[1]


def _quantized(
    st: ModelStats, config: dict[str, Any], quant: str, opt: str, precision: str, load_copy: int
) -> ModelStates:
    r = int(setting(config, "lora_r", DEFAULT_LORA_R))
    quantized, lora_shapes, lora, rows = _lora(st, r)
    key = (id(st), f"lora{r}:{opt}")
    if key not in _STATE_BYTES:
        _STATE_BYTES[key] = optimizer_state_bytes(opt, lora_shapes)
    # embeddings, norms, the head and an MoE's experts and router stay frozen in fp32, as the
    # trial job builds them (``linear_shapes``)
    frozen = int(quantized * WEIGHT_BYTES[quant] + rows * ROW_SCALE_BYTES[quant]) + 4 * (
        st.n_params - quantized
    )
    return ModelStates(
        {
            "parameters": frozen + 4 * lora,
            "gradients": 4 * lora,
            "optimizer_states": _STATE_BYTES[key],
        },
        replaces_trace=True,
        # the 16-bit copies the traced estimator removes from its trace of the unquantized model
        # under autocast: the quantized layers' and the experts' (which the job keeps in fp32;
        # with them the traced and analytical Mixtral peaks agree within 10%, without them not)
        frozen_copies=2 * (quantized + st.layers * st.expert_params)
        if precision in ("bf16", "fp16")
        else 0,
        host=_host(0, load_copy),
        notes=[f"{quant} base weights + LoRA r={r} ({lora / 1e6:.1f}M trainable) by formula"],
    )
