"""What a technique is: the base class every technique module subclasses.

A *technique* is one family of choices that changes how a model is trained (checkpointing,
precision, ZeRO, ...). It owns one or more search dimensions (``Knob``: a config key, its
choices, the value that means "not used", the fidelity class of each choice, its memory order,
what each choice needs of the hardware), and it says, in its own methods, how the trial job
applies it and how it is exported. Nothing else in the project names a technique's choices:
``trials.techniques.TECHNIQUES`` lists the techniques and every other part iterates over it (the
search space's known dimensions, the hardware checks, the strategy's pruning order, the ladder's
baseline, "simplest wins", the fidelity classes, the exports, the job).

Like Optuna's ``BaseSampler``: the base class is small and every method has a neutral default,
so a technique overrides only what it does. This module imports nothing heavy; a technique
imports torch, transformers or DeepSpeed inside the method that needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trials.hardware import Hardware
    from trials.techniques.terms import MemoryStep, SpeedStep, TraceStep

Choice = str | int | float | bool
Config = Mapping[str, Any]
#: hardware -> why a choice can't run there, or None when it can
Check = Callable[["Hardware"], "str | None"]

#: How far a configuration's training math is from plain fp32 AdamW full training, best first.
#: ``exact``: the same math up to float reordering (checkpointing, ZeRO, offload, attention
#: kernels, buckets, micro-batch/accumulation at a fixed global batch, packing, compile); ``mixed``:
#: 16-bit compute over fp32 master weights; ``reduced_state``: weights or optimizer state below
#: fp32 (pure bf16, 8-bit optimizer state); ``other_optimizer``: a different update rule
#: (Adafactor, Lion);
#: ``adapters``: LoRA/QLoRA, a different training problem (the base weights stay frozen).
FIDELITY_CLASSES: tuple[str, ...] = (
    "exact",
    "mixed",
    "reduced_state",
    "other_optimizer",
    "adapters",
)


@dataclass(frozen=True)
class Knob:
    """One search dimension (a key of the trial config) and everything known about its values.

    ``choices``: the values it may take (None: any positive integer). ``baseline``: the value
    that means "this technique is not used" (plain training: the ladder's first rung, "ties go
    to the simplest"); None for a dimension with no such value (micro-batch size, bucket sizes).
    ``fidelity``: the class of each choice that changes the numerics (the others are exact).
    ``memory_order``: for a dimension where a later value never needs less memory, at the same
    other choices, the key that orders its values (the strategy prunes by it after an OOM).
    ``requires``: per choice, the hardware check; ``requires_with``: per choice, (another
    dimension, check), the check applying only when the space has that dimension too;
    ``requires_dimension``: a check that drops the whole dimension where it means nothing.
    ``fits_batch`` excludes the choices a global batch rules out (a micro-batch must divide it).
    """

    name: str
    choices: tuple[Choice, ...] | None
    baseline: Choice | None = None
    #: plain training's value that depends on the study (the micro-batch: the whole global
    #: batch): (choices, global batch) -> value; for the ladder's first rung
    baseline_of: Callable[[Sequence[Choice], int], Choice] | None = None
    fidelity: Mapping[Choice, str] = field(default_factory=dict)
    memory_order: Callable[[Any], float] | None = None
    requires: Mapping[Choice, Check] = field(default_factory=dict)
    requires_with: Mapping[Choice, tuple[str, Check]] = field(default_factory=dict)
    requires_dimension: Check | None = None
    #: whether a choice can run at this global batch (per process); None: any can
    fits_batch: Callable[[Choice, int], bool] | None = None
    #: the choices that can't run with gradient accumulation: the space allows them only with
    #: the micro-batch that is the whole global batch (a rule added when the space is resolved)
    whole_batch_only: tuple[Choice, ...] = ()
    #: the choices a YAML boolean stands for, (true, false): YAML 1.1 reads a bare ``off`` as
    #: false
    from_bool: tuple[Choice, Choice] | None = None
    #: the choice as the results table's config column shows it ("" when not used); None:
    #: ``name=value``
    short: Callable[[Any], str] | None = None
    #: per choice, what else a loss probe's config must set for the choice to take effect
    #: (the probe trains only the numerics choices; pure bf16 exists only under ZeRO)
    probe_needs: Mapping[Choice, Mapping[str, Choice]] = field(default_factory=dict)
    #: a dimension that means something only for variable-length data (``trials.data``): the
    #: reason it is dropped on fixed-length data
    needs_documents: str | None = None
    #: per choice, what "simplest wins" weighs beyond counting the techniques used, as (how far
    #: it shards the model's states, how many of them it puts in host memory); None: (0, 0)
    complexity: Callable[[Any], tuple[int, int]] | None = None
    #: the loss regression's ridge strength for this dimension's lossy choices: the prior belief
    #: that they do not regress the loss (None: the strategy's default)
    loss_prior: float | None = None
    #: a loss probe's config sets this dimension to its plain value (``baseline``, or
    #: ``baseline_of`` at the probe's batch) beside the numerics choices
    probe_plain: bool = False


@dataclass(frozen=True)
class Run:
    """What applying or exporting a configuration needs besides its choices: the batch shape
    (per process), the number of processes, the device kind and the learning rate."""

    micro_batch: int
    accumulation: int
    processes: int
    device: str  # "cpu" | "cuda"
    lr: float


@dataclass(frozen=True, init=False)
class Forbid:
    """A combination of choices a technique rules out: the configurations where every named
    dimension holds one of its listed values. ``why`` says what breaks (the job's refusal
    quotes it). The search space inherits it (``autotune.space``): the dimension of the rule
    declared last in the space loses the listed values whenever the others were chosen, as a
    YAML ``forbid`` rule does; a rule naming a dimension the space lacks does not apply (that
    dimension keeps its default). ``job``: the trial job refuses the combination too (it cannot
    run at all; the other rules spare the search what runs but never pays).
    """

    choices: Mapping[str, tuple[Choice, ...]]
    why: str
    job: bool

    def __init__(
        self, choices: Mapping[str, Choice | Sequence[Choice]], why: str, job: bool = False
    ) -> None:
        if len(choices) < 2:
            raise ValueError("a rule names at least two dimensions")
        as_tuples = {
            k: tuple(v) if isinstance(v, list | tuple) else (v,) for k, v in choices.items()
        }
        object.__setattr__(self, "choices", as_tuples)
        object.__setattr__(self, "why", why)
        object.__setattr__(self, "job", job)

    def holds(self, config: Config) -> bool:
        """Whether ``config`` is the combination this rule forbids."""
        return all(k in config and config[k] in v for k, v in self.choices.items())


@dataclass(frozen=True, init=False)
class When:
    """A dimension that exists only where other dimensions hold one of the listed values (each
    listed dimension's value, where a configuration lacks it, is its baseline). ``why`` says
    what the dimension means nothing, or cannot run, without them. Every search space inherits
    it (``autotune.space``): the dimension is sampled only where the conditions hold, as under a
    YAML ``when``; a condition on a dimension the space lacks holds when that dimension's
    baseline is listed (otherwise the space is refused), and the listed dimensions must be
    declared before it. Several ``When`` of one dimension all hold. ``job``: the trial job
    refuses a configuration that has the dimension where the conditions fail (the dimension's
    presence itself chooses something, as ``zero_stage`` chooses the DeepSpeed engine).
    """

    dimension: str
    conditions: Mapping[str, tuple[Choice, ...]]
    why: str
    job: bool

    def __init__(
        self,
        dimension: str,
        conditions: Mapping[str, Choice | Sequence[Choice]],
        why: str,
        job: bool = False,
    ) -> None:
        if not conditions:
            raise ValueError("a condition names at least one other dimension")
        as_tuples = {
            k: tuple(v) if isinstance(v, list | tuple) else (v,) for k, v in conditions.items()
        }
        object.__setattr__(self, "dimension", dimension)
        object.__setattr__(self, "conditions", as_tuples)
        object.__setattr__(self, "why", why)
        object.__setattr__(self, "job", job)

    def broken(self, config: Config, baseline: Mapping[str, Choice]) -> bool:
        """Whether ``config`` has the dimension where a condition fails (a dimension the config
        lacks counts as its ``baseline``)."""
        return self.dimension in config and not all(
            config.get(k, baseline.get(k)) in v for k, v in self.conditions.items()
        )


class Technique:
    """One family of training techniques. Subclass it, give ``family`` and ``knobs``, override
    the hooks it needs, and register an instance in ``trials.techniques.TECHNIQUES``.

    The hooks, each neutral by default:

    * ``apply(model, config, device)``: the job calls it on the built model, in registry order,
      before the engine wraps it; returns the (possibly replaced) model;
    * ``deepspeed(config, run)``: its part of the DeepSpeed JSON (merged key by key into the
      one config ``trials.deepspeed_engine.deepspeed_config`` builds, which both the job and the
      export use);
    * ``training_arguments``, ``accelerate``, ``axolotl``: its keys in those exports;
    * ``companion``: its keys in ``<stem>.autotune.json``, what a training script needs that
      the config files cannot say (the model's ``attn_implementation``, the batch shape).
    """

    family: str = ""
    knobs: tuple[Knob, ...] = ()
    #: the combinations it rules out (the space and the job read them through the registry)
    forbids: tuple[Forbid, ...] = ()
    #: the dimensions (its own or others') that exist only under conditions on other ones
    whens: tuple[When, ...] = ()
    #: whether the traced estimator applies it too (``autotune.estimator.traced``: a step under
    #: ``FakeTensorMode``, where only what works on fake tensors can run)
    traced: bool = False
    #: its dimensions the traced estimator's one fake process does not run: their accounting
    #: is by formula (``traced_states``), and the trace is shared by every choice of them
    untraced: tuple[str, ...] = ()

    def apply(self, model: nn.Module, config: Config, device: torch.device) -> nn.Module:
        return model

    def deepspeed(self, config: Config, run: Run) -> dict[str, Any]:
        return {}

    def training_arguments(self, config: Config, run: Run) -> dict[str, Any]:
        return {}

    def accelerate(self, config: Config, run: Run) -> dict[str, Any]:
        return {}

    def axolotl(self, config: Config, run: Run) -> dict[str, Any]:
        return {}

    def companion(self, config: Config, run: Run) -> dict[str, Any]:
        return {}

    # --- estimator terms (``trials.techniques.terms``), each neutral by default ----------------

    def memory(self, step: MemoryStep) -> None:
        """Its bytes in the step's activations and logits (first pass, registry order): what
        it adds to or removes from ``step.kept``, ``step.head_acts``, ``step.logit_tokens``,
        ``step.host_acts`` ..."""

    def moments(self, step: MemoryStep) -> None:
        """Its moments of the step (second pass, registry order): the moments it adds,
        replaces or removes in ``step.moments``, and what the model states hold at each
        (``step.held``)."""

    def model_in_16_bits(self, config: Config) -> bool:
        """Whether, with its choice, the model itself runs in 16 bits (no autocast copies of
        the weights, a 16-bit residual stream and logits): DeepSpeed's engine, FSDP2's
        mixed-precision policy, pure bf16, adapters over a 16-bit base. The estimators ask
        every technique (any of them)."""
        return False

    def priced_as(self, config: Config) -> Config:
        """The configuration whose costs the roofline prices in place of ``config`` (a
        technique that moves the bytes another's choice does: FSDP2 as a ZeRO stage); applied
        in registry order before the speed terms."""
        return config

    def operators(self, step: SpeedStep) -> None:
        """What plain training's operators become (first pass of the speed terms, before the
        matmuls are priced): the weights a matmul reads, a frozen base, the attention kernel,
        dequantisation, and the optimizer step's bytes, values and tensors."""

    def kernels(self, step: SpeedStep) -> None:
        """How it changes what a micro-batch runs (first pass of the speed terms):
        recomputation, fused element-wise work, launches."""

    def speed(self, step: SpeedStep) -> None:
        """Its seconds on top of the micro-batches' (second pass): communication, host
        copies, a host step."""

    def traced_states(self, step: TraceStep) -> None:
        """The model states the traced estimator's one unsharded process could not hold
        (first pass): which of the trace's moments to take and the formula's states beside
        it; ``step.taken`` once done."""

    def traced_activations(self, step: TraceStep) -> None:
        """What the traced estimator's fake step kept that the real one does not, or the
        reverse (second pass): ``step.peak``, ``step.breakdown`` and a note."""

    def environment(self, config: Config, inherited: Mapping[str, str]) -> dict[str, str]:
        """Environment variables the trial's processes need from their start on CUDA (the
        runner sets them; ``inherited``: the runner's own environment)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(k.name for k in self.knobs)})"


def merge(into: dict[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """``part`` merged into ``into`` key by key (nested mappings merged, not replaced)."""
    for key, value in part.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into
