"""One interface for memory/speed estimators: a workload (``workload.Workload``: the model, its
data, the processes and the GPU) and a trial config in, an ``Estimate`` (peak bytes per GPU, its
breakdown, predicted tokens/s) out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from autotune.estimator.workload import Workload

#: the parts of a peak, in display order
PARTS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "logits/loss",
    "temporaries",
)


@dataclass
class Estimate:
    peak_bytes: int
    breakdown: dict[str, int]
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    method: str = ""
    gpu: str = ""
    notes: list[str] = field(default_factory=list)
    #: host RAM per machine: offloaded states, model copies at load, pinned buffers
    host_breakdown: dict[str, int] = field(default_factory=dict)
    #: seconds per step by part of the roofline (compute, memory, optimizer, communication...)
    time_breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return sum(self.host_breakdown.values())


class Estimator(ABC):
    """Predicts the per-GPU peak memory (and, with the roofline model, the speed) of a config."""

    name: str = "base"

    @abstractmethod
    def estimate(self, workload: Workload, config: dict[str, Any]) -> Estimate:
        """``config`` trained on ``workload``; with the workload's ``documents`` (variable-length
        data, ``trials.data``) the activations are those of the trial's largest micro-batch,
        padded or packed as the config says."""
