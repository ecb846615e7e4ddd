"""What a technique's estimator terms see and change: one training step's bytes per GPU
(``MemoryStep``) and its seconds (``SpeedStep``), as the analytical estimator
(``autotune.estimator.analytical``) and the roofline (``autotune.estimator.speed``) add them up,
and the traced estimator's peak (``TraceStep``, ``autotune.estimator.traced``).

The estimator fills a step with plain training's figures (no technique used), then calls every
registered technique's hook in registry order (``Technique.memory``, ``Technique.moments``;
``Technique.operators``, ``Technique.kernels``, ``Technique.speed``;
``Technique.traced_states``, ``Technique.traced_activations``); each hook adds or removes its
own bytes or seconds, and the estimator sums what the step holds at each moment. The formulas
several techniques share (the bytes a checkpointed layer's saved ops keep, ZeRO's and FSDP2's
held states, adapters' activations) stay in ``autotune.estimator`` and reach the terms through
``step.formulas``, so that nothing under ``trials/`` imports the estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: a trial config (``trials.techniques.base.Config``; this module imports nothing of the
#: package, which names it in its hooks' signatures)
Config = Mapping[str, Any]

#: a moment of the step: (gradients, activations, logits/loss, temporaries) bytes held then,
#: beside the model states
Moment = tuple[int, int, int, int]


class Formulas(Protocol):
    """The estimator's shared formulas a technique's memory terms call
    (``autotune.estimator.formulas``)."""

    def saved_op_bytes(self, st: Any, config: Config, length: int, micro: int) -> int:
        """What a checkpointed layer keeps of the ops ``checkpoint_save`` names."""
        ...

    def zero_states_at(self, phases: Any, moment: str, accum: int) -> dict[str, int]:
        """A ZeRO rank's states and DeepSpeed's buffers at a moment, by role."""
        ...

    def fsdp_held(
        self, st: Any, config: Config, n: int, moment: str, accum: int, cuda: bool
    ) -> dict[str, int]:
        """What an FSDP2 rank holds by role at a moment."""
        ...

    def adapter_activation_bytes(self, st: Any, config: Config, tokens: int) -> int:
        """What LoRA/DoRA adapters keep for backward beside (or spare of) their frozen base's
        activations, over ``tokens`` positions."""
        ...


@dataclass
class MemoryStep:
    """One step's bytes on one GPU. The fixed part describes the workload and plain training;
    the terms change the rest.

    ``Technique.memory`` (first pass, registry order) changes the activations and logits:
    ``kept`` (the decoder layers' saved tensors at the end of forward), ``head_acts`` (the final
    norm's and the head's), ``recompute`` (a layer recomputed in backward), ``bwd_inputs``
    (the layer inputs still held at the end of backward), ``logit_tokens`` and
    ``bwd_logits_extra`` (the loss's), ``host_acts`` (activations in host memory),
    ``head_on_host`` (of ``head_acts``, what lives there) and ``resident`` (its buffers). The
    estimator then derives
    ``acts``, ``cache_in_fwd``/``cache_in_bwd`` (autocast's 16-bit weight copies held), the
    logits bytes and ``bwd_layers``, builds plain training's ``moments`` and calls
    ``Technique.moments`` (second pass), which may add, replace or remove moments and say what
    the model states hold at each (``held``)."""

    config: Config
    #: ``autotune.models.ModelStats`` of the model
    stats: Any
    formulas: Formulas
    #: ``autotune.estimator.states.ModelStates``: the model states by formula
    #: what is trained and on what (``autotune.estimator.workload.Workload``)
    workload: Any
    states: Any
    accum: int
    #: the largest micro-batch: rows and positions per row
    micro: int
    length: int
    tokens: int
    half: bool  # 16-bit compute (bf16/fp16)
    model16: bool  # the model itself in 16 bits (no autocast copies of its weights)
    pure: bool  # pure bf16 outside DeepSpeed
    adapted: bool  # LoRA/DoRA on a frozen base
    quantized: bool  # frozen quantized base weights
    deepspeed: bool  # DeepSpeed's engine keeps the states
    per_layer: int  # one decoder layer's saved activations
    stream: int  # a layer's input (the residual stream)
    layer_linear: int  # one layer's linear parameters
    head_params: int
    weight_cache: int  # autocast's 16-bit copies of the weights, kept for backward
    layer_weight_cache: int  # those of one layer (recomputed layers make them again)
    final_norm: int  # what the final norm keeps
    grads: int
    gbytes: int  # a gradient's bytes per value
    largest: int  # the largest trainable tensor's values
    step_temps: int  # the optimizer step's temporaries
    # --- first pass ---------------------------------------------------------------------
    kept: int = 0
    head_acts: int = 0
    recompute: int = 0
    bwd_inputs: int = 0
    n_ckpt: int = 0  # layers checkpointed
    saved_kept: int = 0  # of ``kept``, the checkpointed layers' saved ops' outputs
    logit_tokens: int = 0
    bwd_logits_extra: int = 0
    host_acts: int = 0
    head_on_host: int = 0
    #: bytes a technique keeps on the device through the whole step (its own buffers),
    #: counted with the parameters at every moment
    resident: int = 0
    # --- derived, then the second pass --------------------------------------------------------
    acts: int = 0
    cache_in_fwd: int = 0
    cache_in_bwd: int = 0
    bwd_layers: int = 0
    fwd_logits: int = 0
    bwd_logits: int = 0
    moments: dict[str, Moment] = field(default_factory=dict)
    #: moment -> the model states by role held then (None: the parameters, the moment's
    #: gradients, the optimizer states and its temporaries)
    held: Callable[[str], dict[str, int]] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        """A GPU's step (else the CPU trial backend's)."""
        return bool(self.workload.gpu is not None)

    @property
    def nproc(self) -> int:
        return int(self.workload.processes)

    @property
    def documents(self) -> bool:
        """Variable-length data (``trials.data.Documents``)."""
        return self.workload.documents is not None

    @property
    def grads_before(self) -> int:
        """The gradients accumulated over earlier micro-batches, held in forward."""
        return self.grads if self.accum > 1 else 0


@dataclass
class SpeedStep:
    """One step's seconds on one GPU as the roofline (``autotune.estimator.speed``) prices
    plain training, per micro-batch unless said otherwise. Three passes of the terms, in
    registry order: ``Technique.operators`` changes what plain training's operators are
    (``weight_bytes`` a matmul reads per weight, a ``frozen`` base without weight gradients,
    the attention kernel's ``attn_fwd``/``attn_bwd``, ``dequant``: weights dequantised per use)
    and the optimizer step's work (``step_bytes`` per parameter, ``trainable`` values and
    ``tensors`` stepped, ``per_tensor_ops``, ``flat_partitions``, ``optimizer_on_device``), after
    which the estimator prices the matmuls (``fwd_mm``, ``bwd_mm``); ``Technique.kernels``
    changes what a micro-batch runs (``recompute_share`` and ``recompute_compute``: the forward
    run again in backward; ``elementwise_passes``: fused element-wise work; ``ops_factor``: the
    operators launched; ``per_tensor_ops``: launches per parameter tensor of the optimizer
    step), after which the forward and backward times are final; ``Technique.speed`` adds what
    overlaps them or comes on top (``comm_micro_exposed``, ``comm_step``: communication not
    hidden; ``offload``: host copies and a host step, per step; ``activation_copies``:
    activations to the host and back, per step; ``optimizer_extra``: the step's own extra
    passes)."""

    config: Config
    stats: Any  # autotune.models.ModelStats
    #: what is trained and on what (``autotune.estimator.workload.Workload``)
    workload: Any
    accum: int
    tokens: int  # positions per micro-batch
    seq_len: int
    half: bool
    wbytes: int  # a 16-bit or fp32 weight's bytes
    peak: float  # matmul FLOP/s reached
    hbm: float  # memory-bound bytes/s reached
    pcie: float  # host link bytes/s reached
    link: float  # GPU-to-GPU bytes/s reached by the collectives
    layer_act_bytes: int  # what one layer keeps for backward
    elementwise_passes: float
    offloaded_activations: int  # bytes per micro-batch moved to the host and back
    mm_params: int  # the matmuls' weights a token meets (the linears, the LM head)
    #: the attention products' forward FLOPs, every score computed (QK^T and PV)
    attn_flops: float
    #: the attention products as plain math (every score computed, backward twice the
    #: forward) until a kernel's term replaces them
    attn_fwd: float
    attn_bwd: float
    weight_bytes: int  # a matmul's bytes read per weight
    trainable: int  # values the optimizer steps on this GPU
    tensors: int  # tensors the optimizer steps
    # --- first pass: the operators ----------------------------------------------------------
    #: the base's weights take no gradient (only the inputs' gradients are computed)
    frozen: bool = False
    dequant: float = 0.0  # forward and backward
    step_bytes: int = 0  # bytes per trainable value the optimizer's step moves on the device
    #: the step runs over flat partitions (one launch per partition, not per tensor)
    flat_partitions: bool = False
    optimizer_on_device: bool = True
    # --- the matmuls, priced once the operators are known ----------------------------------
    fwd_mm: float = 0.0
    bwd_mm: float = 0.0
    # --- second pass: the kernels ----------------------------------------------------------
    recompute_share: float = 0.0
    recompute_compute: float = 0.0
    ops_factor: float = 1.0
    per_tensor_ops: int = 0
    # --- second pass: on top --------------------------------------------------------------
    comm_micro_exposed: float = 0.0
    comm_step: float = 0.0
    offload: float = 0.0
    activation_copies: float = 0.0
    optimizer_extra: float = 0.0  # seconds the optimizer's step spends beyond its bytes

    @property
    def gpu(self) -> Any:
        """The GPU priced (``autotune.estimator.gpus.GpuSpec``), spanning the nodes."""
        return self.workload.device

    @property
    def nproc(self) -> int:
        return max(1, int(self.workload.processes))

    @property
    def documents(self) -> bool:
        """The data has variable-length rows (packed or padded: attention is given a mask)."""
        return self.workload.documents is not None

    @property
    def elementwise(self) -> float:
        """The non-matmul ops' reads and writes of the kept activations, forward and backward."""
        return self.elementwise_passes * self.layer_act_bytes * self.stats.layers / self.hbm

    @property
    def bwd(self) -> float:
        return self.bwd_mm + self.attn_bwd + 2 * self.elementwise / 3 + self.dequant / 2

    @property
    def recompute_memory(self) -> float:
        return self.recompute_share * (self.elementwise / 3 + self.dequant / 2)

    @property
    def fwd_all(self) -> float:
        """The forward with its recomputation (what prefetched traffic hides behind)."""
        return (
            self.fwd_mm
            + self.attn_fwd
            + self.elementwise / 3
            + self.dequant / 2
            + self.recompute_compute
            + self.recompute_memory
        )


#: the model states of the traced estimator's one unsharded process
TRACED_STATES = ("parameters", "gradients", "optimizer_states")


@dataclass
class TraceStep:
    """The traced estimator's peak (``autotune.estimator.traced``): one unsharded fake process
    ran the step, and the terms combine its trace with what it cannot run. ``parts``: the
    trace's figures by role at its peak (no prefix), at the peak after a backward pass's first
    gradient hook (``hook:``), at that hook (``first_hook:``) and in backward before it
    (``bwd:``). Two passes, in registry order: ``Technique.traced_states`` takes the model
    states the one process could not hold (ZeRO's, FSDP2's shards, adapters over a frozen base)
    from the formulas beside the trace's moment they meet, and says so (``taken``; else the
    estimator swaps the trace's states for the formula's where ``states.replaces_trace``);
    ``Technique.traced_activations`` corrects what the fake step kept that the real one does
    not (or the reverse)."""

    config: Config
    stats: Any  # autotune.models.ModelStats
    formulas: Formulas
    #: what is trained and on what (``autotune.estimator.workload.Workload``)
    workload: Any
    states: Any  # autotune.estimator.states.ModelStates
    accum: int
    tokens: int  # the largest micro-batch's positions
    parts: Mapping[str, int]
    roles: tuple[str, ...]  # the breakdown's roles (``autotune.estimator.base.PARTS``)
    peak: int
    breakdown: dict[str, int]
    notes: list[str]
    #: the analytical estimator's peak for a config of the same workload
    analytical_peak: Callable[[Config], int]
    taken: bool = False

    @property
    def nproc(self) -> int:
        return int(self.workload.processes)

    @property
    def cuda(self) -> bool:
        return bool(self.workload.gpu is not None)

    def net(self, prefix: str = "") -> tuple[int, dict[str, int]]:
        """A traced peak (``prefix`` as in ``parts``) and its breakdown, less the trace's
        model states."""
        breakdown = {k: self.parts[prefix + k] for k in self.roles}
        peak = self.parts[prefix + "peak"]
        for k in TRACED_STATES:
            peak -= breakdown.pop(k)
        return peak, breakdown
