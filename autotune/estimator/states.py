"""Model-state bytes per GPU and per host (parameters, gradients, optimizer states) for every
precision x optimizer x ZeRO stage x offload x quantization, from the parameter shapes of the
transformers model (``autotune.models.stats_of``).

Accounting (Psi parameters, N GPUs in all, g per host, K optimizer-state bytes per parameter),
as DeepSpeed counts it (``estimate_zero2_model_states_mem_needs`` in
``deepspeed/runtime/zero/stage_1_and_2.py``, ``estimate_zero3_model_states_mem_needs`` in
``stage3.py``):

* ZeRO stage 0 is the trial job's own loop (torch autocast over fp32 weights): 4 Psi weights,
  4 Psi gradients, K Psi states, nothing sharded (data parallel replicates them).
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
* ``quantization`` int8/nf4: frozen base linear weights at 1 / 0.5 B (+ scales), other weights
  frozen in fp32, LoRA adapters (rank ``lora_r``, default 8, on every linear of every layer)
  trained in fp32 with the chosen optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.models import ModelStats, stats_of
from trials.techniques import OPTIMIZERS
from trials.techniques.quantization import (
    EXPERT_WEIGHT_BYTES,
    LORA_RANK,
    ROW_SCALE_BYTES,
    WEIGHT_BYTES,
)
from trials.techniques.zero import zero_stage

Shape = tuple[int, ...]

DEFAULT_LORA_R = LORA_RANK  # the trial's LoRA rank
DS_PREFETCH_PARAMS = 50_000_000  # DeepSpeed stage3_prefetch_bucket_size default
DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed reduce_bucket_size default (elements)
#: DeepSpeed's estimators multiply host memory by this (pinned buffers, allocator slack)
DS_HOST_BUFFER_FACTOR = 1.5
#: bytes per parameter DeepSpeed keeps on the host under offload: fp32 master 4 + fp32 grads 4 +
#: Adam 8; stage 3's parameter offload adds the 16-bit partition (2)
HOST_OPTIMIZER_BYTES = 16
HOST_PARAM_BYTES = 2


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


def model_optimizer_bytes(st: ModelStats, name: str) -> int:
    """``optimizer_state_bytes`` over every parameter of the model, computed once per model."""
    key = (id(st), name)
    if key not in _STATE_BYTES:
        _STATE_BYTES[key] = optimizer_state_bytes(name, st.shapes)
    return _STATE_BYTES[key]


def optimizer_state_bytes(name: str, shapes: list[Shape] | tuple[Shape, ...]) -> int:
    """State bytes of the optimizer for these parameters (step counters ignored): its module's
    term (``trials.techniques.optimizer``, ``OptimizerChoice.state_bytes``)."""
    return OPTIMIZERS[name].state_bytes(shapes)


def deepspeed_states(config: dict[str, Any]) -> bool:
    """Whether the model states are counted as DeepSpeed's ZeRO keeps them (16-bit weights
    beside fp32 master partitions): a ZeRO stage above 0, or the traced estimator's marker
    ``deepspeed``. Not ``trials.techniques.zero.runs_deepspeed`` (which engine the job runs,
    stage 0 included): a stage-0 trial's states are estimated as plain training's."""
    return bool(config.get("deepspeed")) or zero_stage(config) > 0


@dataclass
class ModelStates:
    parts: dict[str, int]  # parameters, gradients, optimizer_states (per GPU)
    extra: int = 0  # gathered working set, communication buckets (temporaries)
    replaces_trace: bool = False  # the single-process trace can't see this accounting
    frozen_copies: int = 0  # 16-bit copies autocast made in the trace of weights now frozen
    host: dict[str, int] = field(default_factory=dict)  # per host: what lives in its RAM
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_bytes(self) -> int:
        """Model states per GPU, as DeepSpeed's estimators count them."""
        return sum(self.parts.values())

    @property
    def host_bytes(self) -> int:
        """Host RAM per machine for the model states (DeepSpeed's "per CPU")."""
        return sum(self.host.values())


def _host(offloaded: int, load_copy: int, label: str = "offloaded states") -> dict[str, int]:
    """Host RAM: the larger of the offloaded states and the model copies made at load, plus
    DeepSpeed's buffer factor on it."""
    base = max(offloaded, load_copy)
    parts = {label: offloaded, "model copy at load": max(0, load_copy - offloaded)}
    parts["pinned buffers and slack"] = int(base * (DS_HOST_BUFFER_FACTOR - 1))
    return {k: int(v) for k, v in parts.items()}


def model_states(
    model_cfg: dict[str, Any],
    config: dict[str, Any],
    nproc: int,
    *,
    nodes: int = 1,
    zero_init: bool = True,
) -> ModelStates:
    """Per-GPU and per-host model states of ``config`` on ``nproc`` GPUs over ``nodes`` hosts.

    ``zero_init``: stage 3 builds the model partitioned (``deepspeed.zero.Init``, what
    transformers does under a ZeRO-3 config); False for a model built whole in each process.
    """
    st = stats_of(model_cfg)
    psi = st.n_params
    n = max(1, int(nproc))
    per_host = max(1, n // max(1, nodes))
    opt = str(config.get("optimizer", "adamw"))
    precision = str(config.get("precision", "fp32"))
    stage = int(config.get("zero_stage", 0) or 0)
    off_opt = config.get("offload_optimizer", "none") == "cpu" and stage >= 1
    off_param = config.get("offload_param", "none") == "cpu" and stage >= 3
    quant = str(config.get("quantization", "none") or "none")
    load_copy = 4 * psi * per_host  # each process builds the fp32 model on the host first

    if quant != "none":
        return _quantized(st, config, quant, opt, precision, load_copy)

    states = model_optimizer_bytes(st, opt)
    if stage == 0:
        return ModelStates(
            {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer_states": states},
            host=_host(0, load_copy),
        )

    half = precision in ("bf16", "fp16")
    wbytes = 2 if half else 4
    master = 4 * psi  # DeepSpeed's fp32 partition (a copy even when training in fp32)
    notes = [f"model states: ZeRO-{stage} over {n} GPU(s) by formula (DeepSpeed's accounting)"]
    largest = st.largest_module_params
    reduce_bucket = int(config.get("reduce_bucket_size", DS_REDUCE_BUCKET))
    if stage in (1, 2):
        params = wbytes * psi
        # the 16-bit gradients: whole in stage 1, a partition in stage 2
        grads16 = (wbytes * psi if stage == 1 else wbytes * psi // n) if half else 0
        grads32 = 4 * psi // n
        optim = (master + states) // n
        extra = 2 * wbytes * reduce_bucket if stage == 2 else 0  # ipg buckets
        if off_opt:
            grads16 = grads32 = optim = 0
            notes.append("fp32 master weights, gradients and optimizer states in host memory")
            host = _host(HOST_OPTIMIZER_BYTES * psi * per_host // n, load_copy)
        else:
            host = _host(0, load_copy)
        return ModelStates(
            {"parameters": params, "gradients": grads16 + grads32, "optimizer_states": optim},
            extra=min(extra, wbytes * psi),
            replaces_trace=True,
            host=host,
            notes=notes,
        )

    # stage 3: everything partitioned; the largest layer is gathered whole (DeepSpeed counts
    # 4 B/param of it), the prefetch bucket and live parameters are the working set beyond
    gathered = 4 * largest
    params = wbytes * psi // n
    grads = 4 * psi // n
    optim = (master + states) // n  # with the 16-bit partition: 18 Psi/N in mixed precision
    live = int(config.get("reduce_bucket_size", DS_PREFETCH_PARAMS))
    extra = wbytes * min(live, DS_PREFETCH_PARAMS)
    load = 4 * largest * per_host if zero_init else load_copy
    offloaded = 0
    if off_opt:
        offloaded += HOST_OPTIMIZER_BYTES * psi * per_host // n
        grads = optim = 0
        notes.append("fp32 master weights, gradients and optimizer states in host memory")
    if off_param:
        offloaded += HOST_PARAM_BYTES * psi * per_host // n
        params = 0
        notes.append("16-bit parameter partitions in host memory")
    return ModelStates(
        {"parameters": params + gathered, "gradients": grads, "optimizer_states": optim},
        extra=extra,
        replaces_trace=True,
        host=_host(offloaded, load),
        notes=notes,
    )


#: (id of ModelStats, LoRA rank) -> (quantized params, LoRA shapes); see ``_STATE_BYTES``
_LORA: dict[tuple[int, int], tuple[int, tuple[Shape, ...], int, int]] = {}


def _lora(st: ModelStats, r: int) -> tuple[int, tuple[Shape, ...], int, int]:
    """The quantized base weights (every linear but the embeddings and the head: their count,
    that of their output rows), the LoRA shapes and their parameter count."""
    key = (id(st), r)
    if key not in _LORA:
        linear = [s for s in st.shapes if len(s) == 2 and numel(s) < st.vocab * st.hidden]
        quantized = sum(numel(s) for s in linear)
        rows = sum(s[0] for s in linear)
        lora_shapes: list[Shape] = []
        for out_f, in_f in linear:
            lora_shapes += [(r, in_f), (out_f, r)]
        _LORA[key] = (quantized, tuple(lora_shapes), sum(numel(s) for s in lora_shapes), rows)
    return _LORA[key]


def _quantized(
    st: ModelStats, config: dict[str, Any], quant: str, opt: str, precision: str, load_copy: int
) -> ModelStates:
    r = int(config.get("lora_r", DEFAULT_LORA_R))
    dense, lora_shapes, lora, rows = _lora(st, r)
    experts = st.layers * st.expert_params
    quantized = dense + experts
    key = (id(st), f"lora{r}:{opt}")
    if key not in _STATE_BYTES:
        _STATE_BYTES[key] = optimizer_state_bytes(opt, lora_shapes)
    # embeddings, norms and the head stay frozen in fp32, as the trial job builds them
    frozen = (
        int(dense * WEIGHT_BYTES[quant] + rows * ROW_SCALE_BYTES[quant])
        + int(experts * EXPERT_WEIGHT_BYTES[quant])
        + 4 * (st.n_params - quantized)
    )
    return ModelStates(
        {
            "parameters": frozen + 4 * lora,
            "gradients": 4 * lora,
            "optimizer_states": _STATE_BYTES[key],
        },
        replaces_trace=True,
        frozen_copies=2 * quantized if precision in ("bf16", "fp16") else 0,
        host=_host(0, load_copy),
        notes=[f"{quant} base weights + LoRA r={r} ({lora / 1e6:.1f}M trainable) by formula"],
    )
