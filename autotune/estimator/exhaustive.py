"""Every configuration of a space scored by the analytical estimator, and the best of each
fidelity class (``trials.techniques.FIDELITY_CLASSES``: exact, mixed, reduced_state,
other_optimizer, adapters), and the host-memory frontier: the best full training at each host
memory size where it changes (``host_frontier``).

The per-model quantities (parameter shapes, optimizer-state bytes) are computed once per model,
so a configuration costs a few arithmetic operations: llama-70b's whole estimate space on 8 GPUs
(thousands of configurations) is scored in a few seconds. Configurations whose predicted speed
is within the speed model's error of a class's best (``speed.MODEL_ERROR``) are ties: the
estimator cannot tell them apart, and the answer says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.estimator.analytical import AnalyticalEstimator
from autotune.estimator.base import Estimate
from autotune.estimator.paging import apply_budget
from autotune.estimator.speed import MODEL_ERROR
from autotune.estimator.workload import Workload
from trials.techniques import FIDELITY_CLASSES, fidelity_class


@dataclass
class Scored:
    config: dict[str, Any]
    estimate: Estimate
    fits: bool
    why_not: str = ""  # over the device budget, over the host memory


@dataclass
class ClassBest:
    cls: str
    best: Scored
    ties: list[Scored] = field(default_factory=list)  # within MODEL_ERROR of the best's speed


def score(
    workload: Workload,
    configs: Iterable[dict[str, Any]],
    *,
    budget_bytes: int,
    host_budget_bytes: int | None = None,
) -> list[Scored]:
    """Every configuration with its prediction on ``workload`` (its GPU named) and whether it
    fits both memories (a paged optimizer's states beyond the budget in host memory,
    ``autotune.estimator.paging``)."""
    est = AnalyticalEstimator()
    out: list[Scored] = []
    for config in configs:
        e = est.estimate(workload, config)
        apply_budget(e, workload, config, budget_bytes)
        why = ""
        if e.peak_bytes > budget_bytes:
            why = "device memory"
        elif host_budget_bytes is not None and e.host_bytes > host_budget_bytes:
            why = "host memory"
        out.append(Scored(config, e, not why, why))
    return out


def best_per_class(scored: list[Scored], tie: float = MODEL_ERROR) -> dict[str, ClassBest]:
    """The fastest fitting configuration of each class (least device memory among equal
    speeds), with the ones within ``tie`` of its speed."""
    out: dict[str, ClassBest] = {}
    for cls in FIDELITY_CLASSES:
        fitting = [s for s in scored if s.fits and fidelity_class(s.config) == cls]
        if not fitting:
            continue
        fitting.sort(key=lambda s: (-s.estimate.tokens_per_s, s.estimate.peak_bytes))
        best = fitting[0]
        floor = best.estimate.tokens_per_s * (1 - tie)
        ties = [s for s in fitting[1:] if s.estimate.tokens_per_s >= floor]
        out[cls] = ClassBest(cls, best, ties)
    return out


#: the classes of the headline answer: every weight trained with AdamW's update, in fp32, under
#: mixed precision, or with reduced-precision state (pure bf16 without fp32 masters, 8-bit or
#: paged states: how torchtune's full fine-tuning recipes run on one card)
HEADLINE_CLASSES = ("exact", "mixed", "reduced_state")


def headline(
    per_class: dict[str, ClassBest],
    tie: float = MODEL_ERROR,
    classes: tuple[str, ...] = HEADLINE_CLASSES,
) -> ClassBest | None:
    """The answer to "how do I train this model": the fastest best of ``HEADLINE_CLASSES``; a
    more faithful class within ``tie`` of it (the speed model cannot tell them apart) wins."""
    candidates = [per_class[c] for c in classes if c in per_class]
    if not candidates:
        return None
    fastest = max(c.best.estimate.tokens_per_s for c in candidates)
    return next(c for c in candidates if c.best.estimate.tokens_per_s >= fastest * (1 - tie))


#: host memory sizes machines are built with (GB): the frontier names the smallest that holds
#: a configuration's host memory
HOST_SIZES_GB = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
#: the classes the frontier answers for: the headline's, so that each step is what the headline
#: answers with that much host memory
FULL_TRAINING = HEADLINE_CLASSES


@dataclass
class HostStep:
    host_size_gb: int  # the machine size from which this configuration is the answer
    best: Scored


def host_size_gb(host_bytes: int) -> int:
    """The smallest machine size (``HOST_SIZES_GB``) holding ``host_bytes``; past the table,
    the bytes rounded up to whole GB."""
    for size in HOST_SIZES_GB:
        if host_bytes <= size * 10**9:
            return size
    return -(-host_bytes // 10**9)


def host_frontier(
    scored: list[Scored],
    classes: tuple[str, ...] = FULL_TRAINING,
    tie: float = MODEL_ERROR,
) -> list[HostStep]:
    """The headline configuration for each host memory size at which it changes: sizes
    ascending, each step faster than the one before by more than ``tie`` (the speed model cannot
    tell closer speeds apart), or as fast and of a more faithful class (``classes`` in order:
    fp32 master weights where pure bf16 was the answer with less host memory). A configuration
    over the device budget never appears; one over the host budget (``score``'s
    ``host_budget_bytes``) neither, so ``--host-memory`` still limits the answer."""
    by_size: dict[int, dict[str, Scored]] = {}  # the best of each class at each size
    for s in scored:
        cls = fidelity_class(s.config) if s.fits else ""
        if cls not in classes:
            continue
        best = by_size.setdefault(host_size_gb(s.estimate.host_bytes), {}).get(cls)
        if best is None or (s.estimate.tokens_per_s, -s.estimate.peak_bytes) > (
            best.estimate.tokens_per_s,
            -best.estimate.peak_bytes,
        ):
            by_size[host_size_gb(s.estimate.host_bytes)][cls] = s
    out: list[HostStep] = []
    upto: dict[str, Scored] = {}  # the best of each class within the sizes so far
    last: tuple[float, int] | None = None  # the last step's speed and class rank
    for size in sorted(by_size):
        for cls, s in by_size[size].items():
            if cls not in upto or s.estimate.tokens_per_s > upto[cls].estimate.tokens_per_s:
                upto[cls] = s
        head = headline({c: ClassBest(c, upto[c]) for c in classes if c in upto}, tie, classes)
        assert head is not None
        tps, rank = head.best.estimate.tokens_per_s, classes.index(head.cls)
        if (
            last is None
            or tps > last[0] * (1 + tie)
            or (tps >= last[0] * (1 - tie) and rank < last[1])
        ):
            out.append(HostStep(size, head.best))
            last = (tps, rank)
    return out
