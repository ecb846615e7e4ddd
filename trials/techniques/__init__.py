"""The techniques autotune searches, one module each, and the registry every other part reads.

A trial config is a flat dict such as::

    {"gradient_checkpointing": "selective", "checkpoint_every": 2, "precision": "bf16",
     "attention": "sdpa", "optimizer": "adamw", "micro_batch_size": 2}

Each key is a ``Knob`` of one ``Technique`` (``trials.techniques.base``); each technique module
holds everything about its family: choices, plain value, fidelity classes, memory order,
hardware requirements, how the job applies it and how it is exported. ``TECHNIQUES`` lists them in
the order dimensions are shown and applied; the search space, the hardware checks, the
strategy, the ladder, the selector, the exports and the job iterate over it.

Adding a technique is one new module here (a ``Technique`` subclass and its ``TECHNIQUE``) and
one line in ``_BUILT_IN``; ``tests/test_techniques.py`` shows a toy one reaching every part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trials.techniques import (
    activation_offload,
    adapter,
    allocator,
    attention,
    buckets,
    checkpointing,
    compile,
    cross_entropy,
    fsdp,
    micro_batch,
    offload,
    optimizer,
    optimizer_in_backward,
    packing,
    precision,
    quantization,
    zero,
)
from trials.techniques.attention import ATTENTION
from trials.techniques.base import (
    FIDELITY_CLASSES,
    Choice,
    Config,
    Forbid,
    Knob,
    Run,
    Technique,
    When,
)
from trials.techniques.checkpointing import CHECKPOINTING
from trials.techniques.optimizer import OPTIMIZERS
from trials.techniques.precision import PRECISIONS
from trials.techniques.terms import TRACED_STATES, MemoryStep, SpeedStep, TraceStep

__all__ = [
    "ATTENTION",
    "CHECKPOINTING",
    "FIDELITY_CLASSES",
    "OPTIMIZERS",
    "PRECISIONS",
    "TECHNIQUES",
    "Choice",
    "Forbid",
    "Knob",
    "Registry",
    "Run",
    "Technique",
    "When",
    "choice_fidelity",
    "classes_up_to",
    "fidelity_class",
    "is_exact",
    "numerics_of",
    "setting",
]


class Registry:
    """The registered techniques, in order, and the tables every consumer derives from them
    (derived on each call or re-indexed on each registration: a technique registered later,
    e.g. by a test, is seen at once)."""

    def __init__(self, techniques: list[Technique]) -> None:
        self._techniques: list[Technique] = []
        self._knobs: dict[str, Knob] = {}  # by dimension, in order
        self._fidelity: dict[tuple[str, str], str] = {}
        for technique in techniques:
            self.register(technique)

    def __iter__(self) -> Iterator[Technique]:
        return iter(list(self._techniques))

    def register(self, technique: Technique) -> None:
        clash = [k.name for k in technique.knobs if k.name in self._knobs]
        if clash:
            raise ValueError(f"dimension '{clash[0]}' is already a registered technique's")
        self._techniques.append(technique)
        self._index()

    def unregister(self, technique: Technique) -> None:
        self._techniques.remove(technique)
        self._index()

    def _index(self) -> None:
        self._knobs = {k.name: k for t in self._techniques for k in t.knobs}
        #: (dimension, str(choice)) -> fidelity class, for the choices that are not exact
        self._fidelity = {
            (k.name, str(v)): cls for k in self._knobs.values() for v, cls in k.fidelity.items()
        }

    @contextmanager
    def extended(self, technique: Technique) -> Iterator[Technique]:
        """``technique`` registered for the duration (tests)."""
        self.register(technique)
        try:
            yield technique
        finally:
            self.unregister(technique)

    # --- per dimension ----------------------------------------------------------------------

    def knobs(self) -> list[Knob]:
        return list(self._knobs.values())

    def knob(self, dimension: str) -> Knob | None:
        return self._knobs.get(dimension)

    def fidelity(self, dimension: str, choice: object) -> str:
        """The class one choice puts a configuration in (``exact`` when it changes no
        numerics: the choices its ``Knob.fidelity`` does not list)."""
        return self._fidelity.get((dimension, str(choice)), "exact")

    def known_dimensions(self) -> dict[str, tuple[Choice, ...] | None]:
        """dimension -> the values it may take (None: any positive integer)."""
        return {k.name: k.choices for k in self.knobs()}

    def baseline(self) -> dict[str, Choice]:
        """Plain training: each dimension's value that means "this technique is not used"."""
        return {k.name: k.baseline for k in self.knobs() if k.baseline is not None}

    def memory_orders(self) -> dict[str, Callable[[Any], float]]:
        """Memory order of exact, monotone dimensions: a later value never needs less memory."""
        return {k.name: k.memory_order for k in self.knobs() if k.memory_order is not None}

    def numerics_dimensions(self) -> tuple[str, ...]:
        """The dimensions whose choices change the numbers a step computes (the others are
        exact): a loss probe is keyed by these choices alone."""
        return tuple(k.name for k in self.knobs() if k.fidelity)

    # --- rules ------------------------------------------------------------------------------

    def forbids(self) -> list[Forbid]:
        """Every technique's rules, in registry order (the search space inherits them)."""
        return [rule for technique in self._techniques for rule in technique.forbids]

    def whens(self) -> list[When]:
        """Every technique's conditions on a dimension's presence, in registry order (the
        search space inherits them)."""
        return [rule for technique in self._techniques for rule in technique.whens]

    def refusal(self, config: Config, accumulation: int) -> str | None:
        """Why the job cannot run ``config`` with this many accumulation steps: a rule it
        refuses (``Forbid.job``), a choice that runs on the whole batch only
        (``Knob.whole_batch_only``) or a dimension present where a condition it refuses fails
        (``When.job``); None when it can."""
        for rule in self.forbids():
            if rule.job and rule.holds(config):
                return rule.why
        for knob in self.knobs():
            if (
                accumulation > 1
                and knob.name in config
                and config[knob.name] in knob.whole_batch_only
            ):
                return f"{knob.name}={config[knob.name]} needs the whole batch in one micro-batch"
        plain = self.baseline()
        for when in self.whens():
            if when.job and when.broken(config, plain):
                return when.why
        return None

    def complexity(self, config: Config) -> tuple[int, int]:
        """The config's (sharding, offloads) summed over its dimensions (``Knob.complexity``)."""
        shards = offloads = 0
        for knob in self.knobs():
            if knob.complexity is not None and knob.name in config:
                shard, offload = knob.complexity(config[knob.name])
                shards, offloads = shards + shard, offloads + offload
        return shards, offloads

    def probe_plain(self, global_batch_size: int) -> dict[str, Choice]:
        """What a loss probe at this global batch sets beside its numerics (``probe_plain``)."""
        plain: dict[str, Choice] = {}
        for knob in self.knobs():
            if knob.probe_plain and knob.baseline_of is not None:
                plain[knob.name] = knob.baseline_of((global_batch_size,), global_batch_size)
            elif knob.probe_plain and knob.baseline is not None:
                plain[knob.name] = knob.baseline
        return plain

    # --- the job and the exports ------------------------------------------------------------

    def apply(self, model: Any, config: Config, device: Any) -> Any:
        """Every technique applied to the built model, in order (the job)."""
        for technique in self._techniques:
            model = technique.apply(model, config, device)
        return model

    # --- the estimators -----------------------------------------------------------------------

    def memory_terms(self, step: MemoryStep) -> None:
        """Every technique's activation and logits terms, in order (``Technique.memory``)."""
        for technique in self._techniques:
            technique.memory(step)

    def moment_terms(self, step: MemoryStep) -> None:
        """Every technique's moments of the step, in order (``Technique.moments``)."""
        for technique in self._techniques:
            technique.moments(step)

    def model_in_16_bits(self, config: Config) -> bool:
        """Whether any technique runs the model itself in 16 bits
        (``Technique.model_in_16_bits``)."""
        return any(technique.model_in_16_bits(config) for technique in self._techniques)

    def priced_as(self, config: Config) -> Config:
        """The configuration the roofline prices for ``config`` (``Technique.priced_as``, in
        order)."""
        for technique in self._techniques:
            config = technique.priced_as(config)
        return config

    def operator_terms(self, step: SpeedStep) -> None:
        """Every technique's change to plain training's operators, in order
        (``Technique.operators``)."""
        for technique in self._techniques:
            technique.operators(step)

    def kernel_terms(self, step: SpeedStep) -> None:
        """Every technique's change to a micro-batch's kernels, in order
        (``Technique.kernels``)."""
        for technique in self._techniques:
            technique.kernels(step)

    def speed_terms(self, step: SpeedStep) -> None:
        """Every technique's seconds on top of the micro-batches', in order
        (``Technique.speed``)."""
        for technique in self._techniques:
            technique.speed(step)

    def untraced(self) -> frozenset[str]:
        """The dimensions the traced estimator's fake process does not run
        (``Technique.untraced``)."""
        return frozenset(d for technique in self._techniques for d in technique.untraced)

    def traced_terms(self, step: TraceStep) -> None:
        """Every technique's combination with the traced step, in order: the states
        (``Technique.traced_states``), then the activations (``traced_activations``)."""
        for technique in self._techniques:
            technique.traced_states(step)
        if not step.taken and step.states.replaces_trace:
            # the trace's one unsharded process: its model states swapped for the formula's
            for k in TRACED_STATES:
                step.peak += step.states.parts[k] - step.breakdown[k]
                step.breakdown[k] = step.states.parts[k]
        if step.taken or step.states.replaces_trace:
            step.notes.extend(step.states.notes)
        for technique in self._techniques:
            technique.traced_activations(step)

    def environment(self, config: Config, inherited: dict[str, str]) -> dict[str, str]:
        """Every technique's environment variables for a CUDA trial (``Technique.environment``)."""
        env: dict[str, str] = {}
        for technique in self._techniques:
            env.update(technique.environment(config, inherited))
        return env

    def apply_traced(self, model: Any, config: Config, device: Any) -> Any:
        """The techniques the traced estimator's fake step applies, in order."""
        for technique in self._techniques:
            if technique.traced:
                model = technique.apply(model, config, device)
        return model


#: the techniques, in the order their dimensions are listed and applied
_BUILT_IN: list[Technique] = [
    checkpointing.TECHNIQUE,
    cross_entropy.TECHNIQUE,
    activation_offload.TECHNIQUE,
    precision.TECHNIQUE,
    attention.TECHNIQUE,
    optimizer.TECHNIQUE,
    optimizer_in_backward.TECHNIQUE,
    micro_batch.TECHNIQUE,
    packing.TECHNIQUE,
    compile.TECHNIQUE,
    fsdp.TECHNIQUE,
    zero.TECHNIQUE,
    offload.TECHNIQUE,
    quantization.TECHNIQUE,
    adapter.TECHNIQUE,
    buckets.TECHNIQUE,
    allocator.TECHNIQUE,
]
TECHNIQUES = Registry(_BUILT_IN)


def setting(config: Config, dimension: str, otherwise: Any = None) -> Any:
    """The config's value of ``dimension``, or where it has none that dimension's baseline (its
    technique unused), or for a dimension without one (a size, a stride) ``otherwise``."""
    value = config.get(dimension)
    if value is not None:
        return value
    knob = TECHNIQUES.knob(dimension)
    if knob is not None and knob.baseline is not None:
        return knob.baseline
    return otherwise


# --- fidelity classes ----------------------------------------------------------------------------


def choice_fidelity(dimension: str, choice: object) -> str:
    """The class one choice puts a configuration in (``exact`` when it changes no numerics)."""
    return TECHNIQUES.fidelity(dimension, choice)


def fidelity_class(config: Config) -> str:
    """The worst (latest in ``FIDELITY_CLASSES``) class among the config's choices."""
    worst = 0
    for dimension, choice in config.items():
        worst = max(worst, FIDELITY_CLASSES.index(choice_fidelity(dimension, choice)))
    return FIDELITY_CLASSES[worst]


def is_exact(config: Config) -> bool:
    """True when the config only uses techniques that must reproduce the reference loss."""
    return fidelity_class(config) == "exact"


def classes_up_to(widest: str) -> tuple[str, ...]:
    """The classes a study searches under ``--allow widest``: ``widest`` and every class closer
    to exact (``exact`` alone, ``mixed`` = exact + mixed, ..., ``adapters`` = all)."""
    return FIDELITY_CLASSES[: FIDELITY_CLASSES.index(widest) + 1]


def numerics_of(config: Config) -> dict[str, Any]:
    """The config's numerics-changing choices, with the plain (baseline) values filled in, and
    what a loss probe needs besides for them to take effect (``Knob.probe_needs``)."""
    plain = TECHNIQUES.baseline()
    numerics: dict[str, Any] = {
        d: str(config.get(d, plain[d])) for d in TECHNIQUES.numerics_dimensions()
    }
    for dimension, choice in list(numerics.items()):
        knob = TECHNIQUES.knob(dimension)
        if knob is not None:
            numerics.update(knob.probe_needs.get(choice, {}))
    return numerics
